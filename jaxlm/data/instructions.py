"""Prompt/response pairs for decoder instruction tuning: rows -> token ids -> rows of whole pairs, packed apart.

  data = build_instruction_data(config.data, tokenizer, seed, cache_dir, max_positions)
  loader = make_train_iterator(data.train, batch_size_per_process, seed, shuffle)   # jaxlm.data's grain loader
  batch = next(loader)  # inputs, targets, segment_ids, positions: int32 [B, T]; loss_mask: float32 [B, T]

The batches have the layout of pretraining's packed rows (jaxlm/data/packing.py), so the decoder's loss and eval
steps are pretraining's:
  * a pair is the prompt's tokens (with the tokenizer's own special tokens, e.g. Llama's BOS), then the response's
    tokens and EOS; its inputs are the pair without its last token, its targets without its first;
  * loss_mask is 1 exactly on the targets that are response tokens or the closing EOS: no loss on a prompt token;
  * pairs are packed whole into rows of data.seq_len (first fit, longest first), each with its own segment id and
    positions from 0, so no token attends to another pair (models/masks.py) and each pair is computed as if alone.
Sources: `.csv`/`.tsv`/`.jsonl`/`.parquet` files or an HF dataset, read as for classification (data.train_files,
data.eval_files or a seeded data.eval_fraction held out), columns `data.prompt_column` and `data.response_column`.
Bad input: a missing column or a prompt that fills data.seq_len by itself is a one-line error naming the key or the
row; a row with an empty prompt or response is skipped and counted; a pair longer than data.seq_len keeps its prompt
and the start of its response (counted, and warned about above `jaxlm.data.seq_lengths.TRUNCATION_WARNING_RATE`).
data.seq_len=0 chooses the length from the training pairs (`jaxlm.data.seq_lengths.choose_seq_len`), long enough for
every prompt.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tokenizers

from jaxlm.config import DataConfig
from jaxlm.data import classification as cls_data
from jaxlm.data import seq_lengths
from jaxlm.data.tokenizer import eos_id as tokenizer_eos_id


@dataclasses.dataclass
class Pairs:
  """Tokenized pairs of one split, in reading order."""
  prompts: list[list[int]]
  responses: list[list[int]]  # cut so that prompt + response fits data.seq_len; EOS not included
  closed: np.ndarray  # bool [N]: the response is whole, so EOS follows it
  texts: list[tuple[str, str]]  # (prompt, response) as read, for the report's generated examples

  def __len__(self) -> int:
    return len(self.prompts)


class PackedPairs:
  """Rows of whole pairs; `batch(indices)` is a dict of [B, T] arrays in pretraining's example layout."""

  def __init__(self, rows: dict[str, np.ndarray]):
    self.rows = rows
    self.seq_len = rows["inputs"].shape[1]
    self.num_tokens = int(rows["loss_mask"].sum())  # response targets in all rows
    self.num_slots = rows["inputs"].size
    self.num_used = int((rows["segment_ids"] > 0).sum())  # slots holding a token of some pair

  def __len__(self) -> int:
    return self.rows["inputs"].shape[0]

  def batch(self, indices) -> dict[str, np.ndarray]:
    indices = np.asarray(indices, dtype=np.int64)
    return {k: v[indices] for k, v in self.rows.items()}


@dataclasses.dataclass
class InstructionData:
  train: PackedPairs
  eval: PackedPairs
  eval_pairs: Pairs  # the held-out pairs, unpacked (generation in the report)
  seq_len: int  # data.seq_len, or the one chosen from the data
  eos_id: int
  stats: dict[str, Any]  # flat numbers for the report


def pair_tokens(prompt: list[int], response: list[int], closed: bool, eos_id: int
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """(inputs, targets, loss weights) of one pair: targets are the next tokens; weights 1 on response targets."""
  tokens = np.array([*prompt, *response, *([eos_id] if closed else [])], np.int32)
  weights = np.zeros(len(tokens) - 1, np.float32)
  weights[len(prompt) - 1:] = 1.0  # target j is tokens[j + 1]: a response token (or EOS) from j = len(prompt) - 1
  return tokens[:-1], tokens[1:], weights


def pack_pairs(pairs: Pairs, seq_len: int, eos_id: int) -> PackedPairs:
  """First-fit decreasing: each pair (whole) goes into the first row with room, longest pairs first."""
  lengths = [len(p) + len(r) + int(c) - 1 for p, r, c in zip(pairs.prompts, pairs.responses, pairs.closed)]
  order = sorted(range(len(pairs)), key=lambda i: (-lengths[i], i))
  room = np.zeros(len(pairs), np.int64)  # free slots per row (at most one row per pair)
  placed: list[list[int]] = []  # pair indices per row
  for i in order:
    fits = np.flatnonzero(room[:len(placed)] >= lengths[i])
    row = int(fits[0]) if len(fits) else len(placed)
    if row == len(placed):
      placed.append([])
      room[row] = seq_len
    room[row] -= lengths[i]
    placed[row].append(i)
  n = len(placed)
  rows = {"inputs": np.full((n, seq_len), eos_id, np.int32), "targets": np.full((n, seq_len), eos_id, np.int32),
          "segment_ids": np.zeros((n, seq_len), np.int32), "positions": np.zeros((n, seq_len), np.int32),
          "loss_mask": np.zeros((n, seq_len), np.float32)}
  for row, members in enumerate(placed):
    start = 0
    for segment, i in enumerate(sorted(members), start=1):
      inputs, targets, weights = pair_tokens(pairs.prompts[i], pairs.responses[i], bool(pairs.closed[i]), eos_id)
      end = start + len(inputs)
      rows["inputs"][row, start:end], rows["targets"][row, start:end] = inputs, targets
      rows["segment_ids"][row, start:end], rows["positions"][row, start:end] = segment, np.arange(len(inputs))
      rows["loss_mask"][row, start:end] = weights
      start = end
  return PackedPairs(rows)


def eval_batches(packed: PackedPairs, global_batch: int, process_index: int, process_count: int
                 ) -> list[dict[str, np.ndarray]]:
  """Every held-out row once, as this process's slices of global batches; the last batch is filled with copies of
  row 0 that carry no loss (loss_mask 0), so the eval loss is the mean over the held-out response tokens."""
  local = slice(process_index * global_batch // process_count, (process_index + 1) * global_batch // process_count)
  filler = (-len(packed)) % global_batch
  indices = np.concatenate([np.arange(len(packed)), np.zeros(filler, np.int64)])
  batches = []
  for start in range(0, len(indices), global_batch):
    batch = packed.batch(indices[start:start + global_batch])
    batch["loss_mask"] = batch["loss_mask"] * (np.arange(start, start + global_batch) < len(packed))[:, None]
    batches.append({k: v[local] for k, v in batch.items()})
  return batches


# ----------------------------------------------------------------------------------------------- reading pairs


def read_pairs(config: DataConfig, split: str, cache_dir: str | None) -> tuple[list[tuple[str, int, str, str]], int]:
  """[(where, row, prompt, response)] of `split` and the number of rows skipped for an empty prompt or response."""
  rows, skipped = [], 0
  for where, dataset in cls_data.read_rows(config, split, cache_dir):
    for key, column in (("data.prompt_column", config.prompt_column),
                        ("data.response_column", config.response_column)):
      if column not in dataset.column_names:
        raise ValueError(f"{key}={column!r} is not a column of {where!r}; its columns are {dataset.column_names}")
    for i, (prompt, response) in enumerate(zip(dataset[config.prompt_column], dataset[config.response_column])):
      if not (isinstance(prompt, str) and prompt.strip() and isinstance(response, str) and response.strip()):
        skipped += 1
        continue
      rows.append((where, i + 1, prompt, response))
  return rows, skipped


def build_instruction_data(config: DataConfig, tokenizer: tokenizers.Tokenizer, seed: int, cache_dir: str | None,
                           max_positions: int) -> InstructionData:
  """Reads, splits, tokenizes and packs the pairs described by `config` (module docstring)."""
  eos = tokenizer_eos_id(tokenizer)
  train_rows, skipped = read_pairs(config, "train", cache_dir)
  eval_rows, eval_skipped = read_pairs(config, "eval", cache_dir)
  skipped += eval_skipped
  if not train_rows:
    raise ValueError(f"the training data holds no pair with a non-empty {config.prompt_column!r} and "
                     f"{config.response_column!r} ({skipped} rows skipped); check the files and data.*_column")
  if not eval_rows:  # hold out a seeded random fraction
    if len(train_rows) < 2:
      raise ValueError("holding out eval pairs needs >= 2 training pairs; add data or give data.eval_files")
    order = np.random.default_rng(seed).permutation(len(train_rows))
    held_out = min(len(train_rows) - 1, max(1, round(config.eval_fraction * len(train_rows))))
    eval_rows = [train_rows[i] for i in sorted(order[:held_out])]
    train_rows = [train_rows[i] for i in sorted(order[held_out:])]

  def encode(rows):
    # The prompt carries the tokenizer's special tokens (a BOS where the model expects one); the response none.
    prompts = [e.ids for e in tokenizer.encode_batch([r[2] for r in rows])]
    responses = [e.ids for e in tokenizer.encode_batch([r[3] for r in rows], add_special_tokens=False)]
    return prompts, responses

  encoded = {"train": encode(train_rows), "eval": encode(eval_rows)}
  seq_len = config.seq_len
  if seq_len == 0:
    prompts, responses = encoded["train"]
    lengths = np.array([len(p) + len(r) for p, r in zip(prompts, responses)])  # inputs: the pair + EOS - 1
    seq_len = seq_lengths.choose_seq_len(lengths, max_positions, at_least=max(len(p) for p in prompts) + 1)
  pairs, full_lengths = {}, []
  for split, rows in (("train", train_rows), ("eval", eval_rows)):
    prompts, responses = encoded[split]
    for (where, row, _, _), prompt in zip(rows, prompts):
      if len(prompt) >= seq_len:
        raise ValueError(f"the prompt of row {row} of {where!r} is {len(prompt)} tokens, which leaves no room for "
                         f"its response in data.seq_len={seq_len}; raise data.seq_len (the model has "
                         f"{max_positions} positions) or shorten the prompt")
    full_lengths.extend(len(p) + len(r) for p, r in zip(prompts, responses))
    # A pair fits when its inputs (prompt + response + EOS - 1) do; a longer one keeps what fills seq_len, no EOS.
    closed = np.array([len(p) + len(r) <= seq_len for p, r in zip(prompts, responses)], bool)
    kept = [r if c else r[:seq_len + 1 - len(p)] for p, r, c in zip(prompts, responses, closed)]
    pairs[split] = Pairs(prompts, kept, closed, [(r[2], r[3]) for r in rows])
  train, eval_ = pack_pairs(pairs["train"], seq_len, eos), pack_pairs(pairs["eval"], seq_len, eos)
  lengths = np.array(full_lengths)
  truncated = int((lengths > seq_len).sum())
  stats: dict[str, Any] = {
      "train_pairs": len(pairs["train"]), "eval_pairs": len(pairs["eval"]), "skipped_empty_pairs": skipped,
      "seq_len": seq_len, **{f"tokens_p{q}": float(np.percentile(lengths, q)) for q in (50, 90, 99)},
      "tokens_max": int(lengths.max()), "truncated_pairs": truncated, "truncation_rate": truncated / len(lengths),
      "train_rows": len(train), "eval_rows": len(eval_), "train_response_tokens": train.num_tokens,
      "eval_response_tokens": eval_.num_tokens, "packing_efficiency": train.num_used / max(1, train.num_slots),
  }
  return InstructionData(train, eval_, pairs["eval"], seq_len, eos, stats)
