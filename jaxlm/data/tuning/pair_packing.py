"""Padding-free preference pairs (`preference.padding_free`): whole pairs packed side by side into rows, where the
padded layout (preferences.lay_out) gives every pair a [2, T] slot of which the shorter sequences fill only part.

  layout = packing_layout(row_pairs, allowed)       # a preferences.Layout for build_preference_data
  batch = data.train.batch(indices)  # inputs, targets, positions, segment_ids: int32 [B, L]; loss_mask: float32
                                     # [B, L]; ref_logp: float32 [B, P, 2]; pair_weight: float32 [B, P]

A row holds L = row_pairs * 2 * T token slots, the slots of row_pairs padded pairs (T = data.seq_len). A pair's two
sequences are cut exactly as the padded layout cuts them (preferences.pair_sequences) and go into one row, chosen
then rejected: the row's j-th pair has segment ids 2j + 1 (chosen) and 2j + 2 (rejected) and positions from 0 in
each, so no token attends outside its own sequence (the decoder's document mask) and each sequence is computed as if
alone. Keeping a pair in one row keeps its loss within one micro-batch and one device, so gradient accumulation and
data parallelism split rows as they split padded pairs. Rows are filled best-fit decreasing (each pair, longest
first, into the row it leaves least room in). P is the most pairs any row of either split holds; a row's pair slots
past its own pairs weigh 0 (pair_weight) and hold no token.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np

from jaxlm.data.tuning.preferences import Layout, Pair, PreferencePairs, pair_sequences

ROW_PAIRS_CHOICES = (1, 2, 4, 8, 16)  # row_pairs=0 picks among these (those that split the batch evenly)
GOOD_FILL = 0.9  # row_pairs=0 takes the shortest rows whose tokens fill at least this share of the slots


def best_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
  """Item indices per bin: each item, longest first (ties: lower index first), goes into the open bin with the least
  room that fits it, or a new bin. Every length must be <= capacity."""
  rooms: list[tuple[int, int]] = []  # (room left, bin) sorted: the best fit is the first room >= the length
  bins: list[list[int]] = []
  for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
    at = bisect.bisect_left(rooms, (lengths[i], -1))
    if at == len(rooms):
      bins.append([])
      room, b = capacity, len(bins) - 1
    else:
      room, b = rooms.pop(at)
    bins[b].append(i)
    bisect.insort(rooms, (room - lengths[i], b))
  return [sorted(members) for members in bins]


def pair_length(pair: Pair, seq_len: int) -> int:
  """The token slots a pair takes in a packed row: both sequences' inputs (each sequence without its last token)."""
  sequences, _, _ = pair_sequences(pair, seq_len)
  return sum(len(s) - 1 for s in sequences)


def fill(lengths: Sequence[int], capacity: int) -> float:
  """The share of the slots that hold a token when `lengths` are packed into rows of `capacity`."""
  return sum(lengths) / max(1, capacity * len(best_fit_decreasing(lengths, capacity)))


def choose_row_pairs(lengths: Sequence[int], seq_len: int, allowed: Sequence[int]) -> int:
  """The fewest padded pairs' slots per row (of `allowed`) whose rows fill GOOD_FILL of their slots, else the
  allowed count that fills the most (rows longer than needed cost attention, which sees the whole row)."""
  fills = {k: fill(lengths, 2 * seq_len * k) for k in sorted(allowed)}
  good = [k for k, f in fills.items() if f >= GOOD_FILL]
  return good[0] if good else max(fills, key=lambda k: (fills[k], -k))


def pack_pairs(pairs: list[Pair], seq_len: int, pad_id: int, row_pairs: int,
               pair_slots: int = 0) -> tuple[PreferencePairs, int]:
  """The pairs packed into rows of row_pairs * 2 * seq_len slots (module docstring), each row with at least
  `pair_slots` pair slots; returns the rows and how many pairs were cut."""
  return _Packing(pairs, seq_len, row_pairs).rows(pad_id, pair_slots)


class _Packing:
  """The pairs' cut sequences and which pairs share each row."""

  def __init__(self, pairs: list[Pair], seq_len: int, row_pairs: int):
    self.sequences = [pair_sequences(pair, seq_len) for pair in pairs]
    self.row_len = 2 * seq_len * row_pairs
    self.placed = best_fit_decreasing([sum(len(s) - 1 for s in seqs) for seqs, _, _ in self.sequences], self.row_len)
    self.most_pairs = max(map(len, self.placed), default=1)

  def rows(self, pad_id: int, pair_slots: int) -> tuple[PreferencePairs, int]:
    n, p, length = len(self.placed), max(pair_slots, self.most_pairs), self.row_len
    rows = {"inputs": np.full((n, length), pad_id, np.int32), "targets": np.full((n, length), pad_id, np.int32),
            "positions": np.zeros((n, length), np.int32), "segment_ids": np.zeros((n, length), np.int32),
            "loss_mask": np.zeros((n, length), np.float32), "ref_logp": np.zeros((n, p, 2), np.float32),
            "pair_weight": np.zeros((n, p), np.float32)}
    for row, members in enumerate(self.placed):
      start = 0
      for j, i in enumerate(members):
        sequences, prompt_length, _ = self.sequences[i]
        for side, tokens in enumerate(sequences):
          k = len(tokens) - 1
          span = slice(start, start + k)
          rows["inputs"][row, span], rows["targets"][row, span] = tokens[:-1], tokens[1:]
          rows["positions"][row, span], rows["segment_ids"][row, span] = np.arange(k), 2 * j + 1 + side
          rows["loss_mask"][row, start + prompt_length - 1:start + k] = 1.0  # targets from the first response token
          start += k
        rows["pair_weight"][row, j] = 1.0
    return PreferencePairs(rows), sum(cut for _, _, cut in self.sequences)


def packing_layout(row_pairs: int, allowed: Sequence[int]) -> Layout:
  """A preferences.Layout that packs every split into rows of `row_pairs` padded pairs' slots (0: chosen from the
  training pairs by `choose_row_pairs` among `allowed`), every split's rows with the same number of pair slots (one
  compiled shape for the reference pass)."""

  def layout(splits: dict[str, list[Pair]], seq_len: int, pad_id: int) -> dict[str, tuple[PreferencePairs, int]]:
    k = row_pairs or choose_row_pairs([pair_length(x, seq_len) for x in splits["train"]], seq_len, allowed)
    packings = {split: _Packing(pairs, seq_len, k) for split, pairs in splits.items()}
    slots = max(packing.most_pairs for packing in packings.values())
    return {split: packing.rows(pad_id, slots) for split, packing in packings.items()}

  return layout


def allowed_row_pairs(batch_size: int, divisor: int) -> tuple[int, ...]:
  """The ROW_PAIRS_CHOICES that leave a whole number of rows per step, divisible by `divisor` (the data shards
  times the micro-batches, and the processes)."""
  return tuple(k for k in ROW_PAIRS_CHOICES if batch_size % k == 0 and (batch_size // k) % divisor == 0)
