"""Calibration of post-training optimizations: what each matmul weight's input looks like on a few batches.

  statistics = calibration.input_statistics(model, batches, forward)   # {weight path: InputStats}
  scales = calibration.static_scales(statistics)                        # W8A8's per-tensor input scales

One probed forward per batch records, for every quantizable weight of every layer, its input's absmax and sum of
squares per input channel: W8A8's static scales (quant), SmoothQuant's factors (smoothing) and Wanda's input norms
(prune) all come from it. Each weight is wrapped in an `int8.Probe`, a stand-in whose own matmul records its input:
its tag (one per layer, sliced by the layer scan like any parameter) names whose input a matmul saw, and a host
callback collects the statistics.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.compress import int8


def check_calibration(batches: list[Any], vocab_size: int | None) -> None:
  """Refuses empty calibration data and token ids outside the model's vocabulary (data of another tokenizer)."""
  if not batches:
    raise ValueError("the calibration data is empty: give at least one batch of the task's inputs")
  if vocab_size is None:
    return
  for i, batch in enumerate(batches):
    ids = [batch] if not isinstance(batch, dict) else [batch[k] for k in ("inputs", "input_ids") if k in batch]
    for array in ids:
      array = np.asarray(array)
      if not np.issubdtype(array.dtype, np.integer) or array.size == 0:
        continue
      low, high = int(array.min()), int(array.max())
      if low < 0 or high >= vocab_size:
        raise ValueError(f"calibration batch {i} holds token id {high if high >= vocab_size else low}, outside the "
                         f"model's vocabulary [0, {vocab_size}): it was tokenized with another tokenizer; tokenize it "
                         "with the model's own tokenizer.json")


def token_mask(batch: Any) -> jax.Array | None:
  """The batch's real tokens [B, S] (its `attention_mask`, the HF convention: 0 = padding), or None (no padding)."""
  return jnp.asarray(batch["attention_mask"]) if isinstance(batch, dict) and "attention_mask" in batch else None


_PROBE_RUNS: dict = {}  # (probe graphdef, forward) -> the jitted calibration forward


class InputStats(NamedTuple):
  absmax: np.ndarray  # [calls, L, *C]: each call's (batch's) input absmax per channel; no L when unstacked
  sumsq: np.ndarray  # [L, *C]: the input's sum of squares per channel over every call
  stacked: bool
  gram: np.ndarray | None = None  # [L, n, n] (n = prod C, flattened): X^T X over every call, float64; if asked


def input_statistics(model: nnx.Module, batches: list[Any], forward: Callable[[nnx.Module, Any], Any],
                     gram: bool = False) -> dict:
  """What every quantizable weight's matmul reads over `batches`, per input channel (the weight's contracted axes C):

    {parameter path: InputStats}; weights no matmul read (lookup-only tables) are absent. `gram` also sums each
    input's Gram matrix X^T X (SparseGPT's Hessian; a [C, C] transfer per matmul per batch, so only when asked).
    Padding tokens (0 in a dict batch's `attention_mask`) count as zero rows: they are computed but never read."""
  check_calibration(batches, getattr(getattr(model, "config", None), "vocab_size", None))
  graphdef, state = nnx.split(model)
  probed = jax.tree.map(lambda x: x, state)
  tags: dict[str, tuple[int, int]] = {}  # path -> (first tag, layers or 0)
  next_tag = 0
  for path, variable in nnx.to_flat_state(probed):
    if int8.quantizable(path, variable) is None:
      continue
    value = variable.get_value()
    layers = value.shape[0] if int8.is_stacked(variable, value) else 0
    tag = jnp.arange(next_tag, next_tag + layers, dtype=jnp.int32) if layers else jnp.int32(next_tag)
    tags["/".join(map(str, path))] = (next_tag, layers)
    next_tag += max(layers, 1)
    variable.set_value(int8.Probe(value, tag, gram))
  probe_def, probe_state = nnx.split(nnx.merge(graphdef, probed))
  key = (probe_def, forward)
  if key not in _PROBE_RUNS:  # one compile per model structure and forward, whatever the batches or weights
    def probed_forward(s, batch):
      int8.PROBE_TOKENS[0] = token_mask(batch)
      try:
        return forward(nnx.merge(probe_def, s), batch)
      finally:
        int8.PROBE_TOKENS[0] = None
    _PROBE_RUNS[key] = jax.jit(probed_forward)
  run = _PROBE_RUNS[key]
  int8.PROBE_RECORDS.clear()
  int8.PROBE_GRAMS.clear()
  for batch in batches:
    jax.block_until_ready(run(probe_state, batch))
  jax.effects_barrier()
  records, grams = dict(int8.PROBE_RECORDS), dict(int8.PROBE_GRAMS)
  int8.PROBE_RECORDS.clear()
  int8.PROBE_GRAMS.clear()
  statistics = {}
  for name, (first, layers) in tags.items():
    per_tag = [records.get(t) for t in range(first, first + max(layers, 1))]
    if any(r is None for r in per_tag):
      continue  # never multiplied (a lookup-only table)
    absmax = np.stack([np.stack([a for a, _ in r]) for r in per_tag], axis=1)  # [calls, L or 1, *C]
    sumsq = np.stack([np.sum([q for _, q in r], axis=0) for r in per_tag])  # [L or 1, *C]
    gram_matrices = np.stack([grams[t] for t in range(first, first + max(layers, 1))]) if gram else None
    if gram_matrices is not None and not layers:
      gram_matrices = gram_matrices[0]
    statistics[name] = InputStats(absmax if layers else absmax[:, 0], sumsq if layers else sumsq[0], bool(layers),
                                  gram_matrices)
  return statistics


def static_scales(statistics: dict, smoothing_factors: dict | None = None) -> dict:
  """Per-tensor input scale of each weight's matmul: the mean over calls of the per-call absmax, / 127 (qwix's
  SimpleMovingAverage rule), of the input divided by its smoothing factors s where it has them. {path: [L] or []}."""
  scales = {}
  for name, stats in statistics.items():
    s = (smoothing_factors or {}).get(name)
    absmax = stats.absmax / np.asarray(s)[None] if s is not None else stats.absmax  # [calls, L?, *C]
    per_call = np.max(absmax, axis=tuple(range(2 if stats.stacked else 1, absmax.ndim)))  # [calls, L?]
    values = np.maximum(np.mean(per_call, axis=0) / int8.INT8_MAX, np.finfo(np.float32).tiny)
    scales[name] = jnp.asarray(values.astype(np.float32))
  return scales


def calibrate(model: nnx.Module, batches: list[Any], forward: Callable[[nnx.Module, Any], Any]) -> dict:
  """Input scale of every quantizable weight's matmul: the mean over `batches` of the per-batch absmax, / 127.

  Returns {parameter path: scale [L] (stacked) or []}."""
  return static_scales(input_statistics(model, batches, forward))
