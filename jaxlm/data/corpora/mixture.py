"""Pretraining batches as a pure function of (seed, step, corpora, mixture weights), sharded per process.

Global sample g (step s holds samples s * B ... s * B + B - 1 of the global batch B) is assigned to a corpus and to a
position in that corpus's own endless stream, in closed form (`pick`): corpus 0 takes floor(n * w0) of the first n
samples, corpus 1 floor(m * w1 / (1 - w0)) of the m samples left, and so on, so every corpus gets its share of
tokens to within a few windows at every step, and any step is computed without replaying the ones before it.
Position i of corpus k is window perm_k,epoch(i mod N_k) with epoch = i // N_k: each window once per epoch, a new
order every epoch (grain's index shuffle, random access in O(1) memory).

The loader state saved with a checkpoint is the step and the mixture's history; weights changed on resume apply from
the resumed step on, each corpus continuing its stream where it stopped (the log says so).
"""

from __future__ import annotations

import fractions
import math
from collections.abc import Sequence
from typing import Any

import grain.python as gp
import numpy as np

from jaxlm.data.corpora.shards import TokenWindows
from jaxlm.data.packing import make_examples

_DENOMINATOR = 10**6  # weights are kept as exact fractions, so assignments never depend on float rounding


def exact_weights(weights: Sequence[float]) -> list[fractions.Fraction]:
  if not weights or any(not math.isfinite(w) or w <= 0 for w in weights):
    raise ValueError(f"mixture weights {list(weights)} must be positive numbers; give data.mixture as "
                     f"folder=weight,folder=weight")
  total = sum(weights)
  exact = [fractions.Fraction(w / total).limit_denominator(_DENOMINATOR) for w in weights[:-1]]
  return exact + [1 - sum(exact)]


def pick(sample: int, weights: Sequence[fractions.Fraction]) -> tuple[int, int]:
  """(corpus, position in that corpus's stream) of the `sample`-th sample under `weights` (see module docstring)."""
  rest = fractions.Fraction(1)
  for corpus, weight in enumerate(weights[:-1]):
    share = weight / rest
    taken = sample * share.numerator // share.denominator  # this corpus's samples before `sample`
    if (sample + 1) * share.numerator // share.denominator > taken:
      return corpus, taken
    sample -= taken
    rest -= weight
  return len(weights) - 1, sample


def counts(samples: int, weights: Sequence[fractions.Fraction]) -> list[int]:
  """How many of the first `samples` samples each corpus takes under `weights`."""
  rest, result = fractions.Fraction(1), []
  for weight in weights[:-1]:
    share = weight / rest
    taken = samples * share.numerator // share.denominator
    result.append(taken)
    samples -= taken
    rest -= weight
  return result + [samples]


class PretrainingBatches:
  """An endless iterator of example dicts of [B_local, T] arrays; `batch(step)` is any step's batch directly.

  Every process computes the same global batch and gathers only its contiguous slice, so the global batch at every
  step is the same for 1, 2 or 4 processes. `get_state`/`set_state` give and take the JSON loader state.
  """

  def __init__(self, corpora: Sequence[TokenWindows], weights: Sequence[float], batch_size_per_process: int,
               seed: int, shuffle: bool = True, process_index: int = 0, process_count: int = 1):
    if batch_size_per_process < 1:
      raise ValueError(f"batch_size_per_process={batch_size_per_process} must be >= 1; raise train.batch_size")
    if len(corpora) != len(weights):
      raise ValueError(f"{len(corpora)} corpora but {len(weights)} mixture weights")
    for corpus in corpora:
      if len(corpus) == 0:
        raise ValueError(f"a corpus holds no window of data.seq_len + 1 = {corpus.seq_len + 1} tokens "
                         f"({corpus.corpus_tokens} tokens in {corpus.documents} documents); lower data.seq_len or "
                         f"add data")
    self.corpora = list(corpora)
    self.global_batch = batch_size_per_process * process_count
    self._first = process_index * batch_size_per_process
    self._local = batch_size_per_process
    self.weights = [float(w) for w in weights]
    # The mixture's history: from which global sample on which weights applied.
    self.history: list[tuple[int, list[fractions.Fraction]]] = [(0, exact_weights(self.weights))]
    self._orders = [_order(len(c), seed, k, shuffle) for k, c in enumerate(self.corpora)]
    self.step = 0

  def __iter__(self) -> PretrainingBatches:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    batch = self.batch(self.step)
    self.step += 1
    return batch

  def windows(self, step: int) -> list[tuple[int, int]]:
    """(corpus, window) of each row of the global batch at `step`."""
    start = step * self.global_batch
    return [self._window(sample) for sample in range(start, start + self.global_batch)]

  def _window(self, sample: int) -> tuple[int, int]:
    segment = max(i for i, (begin, _) in enumerate(self.history) if begin <= sample)
    offsets = [0] * len(self.corpora)
    for (begin, weights), (end, _) in zip(self.history[:segment], self.history[1:segment + 1]):
      offsets = [o + c for o, c in zip(offsets, counts(end - begin, weights))]
    begin, weights = self.history[segment]
    corpus, position = pick(sample - begin, weights)
    return corpus, int(self._orders[corpus][offsets[corpus] + position])

  def batch(self, step: int) -> dict[str, np.ndarray]:
    rows = self.windows(step)[self._first:self._first + self._local]
    if len(self.corpora) == 1:
      return self.corpora[0].batch([w for _, w in rows])
    tokens, segments = zip(*(self.corpora[k].rows([w]) for k, w in rows))
    return make_examples(np.concatenate(tokens), np.concatenate(segments))

  def get_state(self) -> dict[str, Any]:
    return {"next_index": self.step, "global_batch": self.global_batch,
            "mixture": [[begin, [str(w) for w in weights]] for begin, weights in self.history]}

  def set_state(self, state: dict[str, Any]) -> None:
    if "next_index" not in state:
      raise ValueError(f"loader state keys {sorted(state)} do not match this loader's {sorted(self.get_state())}; "
                       f"the checkpoint was written by a different data pipeline")
    step = int(state["next_index"])
    saved_batch = int(state.get("global_batch", self.global_batch))
    if saved_batch != self.global_batch:
      raise ValueError(f"the checkpoint was written with a global batch of {saved_batch} sequences, this run has "
                       f"{self.global_batch}; resume with train.batch_size={saved_batch}")
    history = [(int(b), [fractions.Fraction(w) for w in ws]) for b, ws in state.get("mixture", [])] or \
        [(0, self.history[0][1])]
    if len(history[-1][1]) != len(self.corpora):
      raise ValueError(f"the checkpoint mixed {len(history[-1][1])} corpora, this run has {len(self.corpora)}; "
                       f"resume with the same data.mixture folders (their weights may change)")
    current = self.history[0][1]
    if history[-1][1] != current:
      before = [round(float(w), 4) for w in history[-1][1]]
      begin = step * self.global_batch
      history = [h for h in history if h[0] < begin] + [(begin, current)]
      print(f"data.mixture weights changed on resume at step {step}: from {before} to "
            f"{[round(float(w), 4) for w in current]}; each corpus continues where it stopped")
    self.history = history
    self.step = step


def _order(length: int, seed: int, corpus: int, shuffle: bool) -> gp.MapDataset:
  order = gp.MapDataset.range(length)
  if shuffle:  # grain's seed must fit 32 bits; each corpus gets its own order
    order = order.shuffle(seed=(int(seed) * 1_000_003 + corpus) % 2**32)
  return order.repeat(None)
