"""Magnitude pruning (global or per layer, to an exact sparsity), 2:4 semi-structured pruning, activation-aware
(Wanda) pruning, and a short fine-tune that keeps the pruned weights at zero.

  masks = prune.magnitude_masks(model, 0.5)            # one threshold over all prunable weights
  masks = prune.magnitude_masks(model, 0.5, per_layer=True)   # each matrix of each layer to 50%
  masks = prune.two_four_masks(model)                  # in every 4 consecutive inputs of an output, keep 2
  masks = prune.wanda_masks(model, 0.5, batches, forward)                 # |W| * ||X_j||, 50% of each output row
  masks = prune.wanda_masks(model, 0.5, batches, forward, pattern="2:4")  # the same score, 2 of every 4 inputs
  pruned = prune.apply_masks(model, masks)
  params = prune.finetune(graphdef, params, masks, loss_fn, batches, learning_rate=1e-4)

Wanda (Sun et al., 2024) scores weight W_ij (input j, output i) by |W_ij| * ||X_j||_2, the L2 norm of its input
channel over every token of the calibration batches (`calibration.input_statistics`, the probe that calibrates
W8A8), and compares weights within one output row: a large weight on a quiet input may go, a small one on a loud
input stays.
Prunable weights are the matmul weights of `jaxlm.quant.CONTRACTED_AXES` except the embedding tables (a pruned
vocabulary row would delete a token). Masks are pure dicts of bool arrays over those parameters only. Ties at the
threshold are broken by position (a stable sort), so exactly round(sparsity * n) weights are zeroed. The 2:4 groups
run along the contracted (input) axis, the one NVIDIA's sparse tensor cores compress; qwix's N:M mask helper groups
along a matrix's last axis and returns a float mask, so ours is written for any contracted axis of our weights.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, traverse_util

from jaxlm import calibration as calibration_lib, quant

Masks = dict  # nested pure dict: parameter path -> bool array (True = kept)


def prunable(model_or_state: Any) -> dict[tuple, tuple[jax.Array, tuple[int, ...], bool]]:
  """{path: (value, contracted axes, stacked)} of the weights pruning may touch."""
  state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
  out = {}
  for path, variable in nnx.to_flat_state(state):
    contracted = quant.quantizable(path, variable)
    if contracted is None or path[-1] == "embedding":
      continue
    value = variable.get_value()
    out[path] = (value, contracted, quant.is_stacked(variable, value))
  return out


@functools.partial(jax.jit, static_argnums=1)
def _keep_largest(magnitudes: jax.Array, num_pruned: int) -> jax.Array:
  """Bool mask of the same shape, False on exactly `num_pruned` smallest entries (ties: the earlier ones first)."""
  flat = magnitudes.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  keep = jnp.ones(flat.shape, bool).at[order[:num_pruned]].set(False)
  return keep.reshape(magnitudes.shape)


def check_sparsity(sparsity: float) -> None:
  if not 0.0 <= sparsity < 1.0:
    raise ValueError(f"sparsity {sparsity} is out of range: it must be in [0, 1) (the fraction of weights set to zero)")


def magnitude_masks(model: Any, sparsity: float, per_layer: bool = False) -> Masks:
  """Masks zeroing the smallest-|w| fraction `sparsity`: over all prunable weights at once (global), or within
  each weight matrix of each layer (`per_layer`)."""
  check_sparsity(sparsity)
  weights = prunable(model)
  flat_masks = {}
  if per_layer:
    for path, (w, _, stacked) in weights.items():
      slices = w if stacked else w[None]
      per_slice = round(sparsity * slices[0].size)
      per = jax.vmap(lambda s: _keep_largest(jnp.abs(s), per_slice))(slices)
      flat_masks[path] = per if stacked else per[0]
  else:
    magnitudes = jnp.concatenate([jnp.abs(w.astype(jnp.float32)).reshape(-1) for w, _, _ in weights.values()])
    keep = _keep_largest(magnitudes, round(sparsity * magnitudes.size))
    start = 0
    for path, (w, _, _) in weights.items():
      flat_masks[path] = keep[start:start + w.size].reshape(w.shape)
      start += w.size
  return traverse_util.unflatten_dict(flat_masks)


@functools.partial(jax.jit, static_argnames=("axis", "n", "m"))
def n_m_mask(w: jax.Array, axis: int, n: int = 2, m: int = 4) -> jax.Array:
  """Keeps the n largest |w| in every m consecutive entries along `axis` (which m must divide)."""
  if w.shape[axis] % m:
    raise ValueError(f"{n}:{m} pruning needs the contracted axis ({w.shape[axis]}) to be a multiple of {m}")
  moved = jnp.moveaxis(jnp.abs(w), axis, -1)
  groups = moved.reshape(moved.shape[:-1] + (moved.shape[-1] // m, m))
  # Rank within each group (stable, so ties keep the earlier entries): the top n survive.
  ranks = jnp.argsort(jnp.argsort(-groups, axis=-1, stable=True), axis=-1, stable=True)
  keep = (ranks < n).reshape(moved.shape)
  return jnp.moveaxis(keep, -1, axis)


def two_four_masks(model: Any) -> Masks:
  """2:4 masks along each weight's innermost contracted axis (for w_o [H, K, D]: along K)."""
  return traverse_util.unflatten_dict({path: n_m_mask(w, max(contracted))
                                       for path, (w, contracted, _) in prunable(model).items()})


PATTERNS = ("unstructured", "2:4")


def row_mask(scores: Any, contracted: tuple[int, ...], num_pruned: int) -> np.ndarray:
  """False on the `num_pruned` lowest scores of each output row (all contracted axes of one output; ties: the
  earlier inputs go first). NumPy: a sort per matrix, where a jitted one would compile once per weight shape."""
  scores = np.asarray(scores)
  tail = tuple(range(scores.ndim - len(contracted), scores.ndim))
  moved = np.moveaxis(scores, contracted, tail)
  rows = moved.reshape(moved.shape[:-len(contracted)] + (-1,))
  lowest = np.argsort(rows, axis=-1, kind="stable")[..., :num_pruned]
  keep = np.ones(rows.shape, bool)
  np.put_along_axis(keep, lowest, False, axis=-1)
  return np.moveaxis(keep.reshape(moved.shape), tail, contracted)


def wanda_scores(w: Any, input_norm: Any, contracted: tuple[int, ...], stacked: bool) -> np.ndarray:
  """|W| * ||X_j||: `input_norm` [L?, *C] is the L2 norm of each input channel (the weight's contracted axes)."""
  w = np.asarray(w, np.float32)
  shape = [1] * w.ndim
  if stacked:
    shape[0] = w.shape[0]
  for axis in contracted:
    shape[axis] = w.shape[axis]
  return np.abs(w) * np.asarray(input_norm, np.float32).reshape(shape)


def wanda_masks(model: Any, sparsity: float, calibration: Iterable[Any],
                forward: Callable[[nnx.Module, Any], Any], pattern: str = "unstructured") -> Masks:
  """Wanda masks: in each output row of each layer's matrix, the `sparsity` fraction of inputs with the lowest
  |W| * ||X_j|| go ("unstructured"), or the 2 lowest of every 4 consecutive inputs ("2:4", along the innermost
  contracted axis as `two_four_masks`; `sparsity` must then be 0.5). `forward(model, batch)` runs the model on a
  calibration batch (training data) as the task does."""
  check_sparsity(sparsity)
  if pattern not in PATTERNS:
    raise ValueError(f"pruning pattern {pattern!r} is not one of {', '.join(PATTERNS)}")
  if pattern == "2:4" and sparsity != 0.5:
    raise ValueError(f"2:4 pruning zeroes exactly half of each row, not sparsity {sparsity}; give 0.5")
  batches = list(calibration)
  statistics = calibration_lib.input_statistics(model, batches, forward)
  flat_masks = {}
  for path, (w, contracted, stacked) in prunable(model).items():
    name = "/".join(map(str, path))
    if name not in statistics:
      raise ValueError(f"no calibration batch ran the matmul of {name}: forward(model, batch) must run the whole "
                       "model as the task does")
    scores = wanda_scores(w, np.sqrt(statistics[name].sumsq), contracted, stacked)
    if pattern == "2:4":
      flat_masks[path] = n_m_mask(jnp.asarray(scores), max(contracted))
    else:
      per_row = int(np.prod([w.shape[a] for a in contracted]))
      flat_masks[path] = jnp.asarray(row_mask(scores, contracted, round(sparsity * per_row)))
  return traverse_util.unflatten_dict(flat_masks)


def is_n_m(w: jax.Array, axis: int, n: int = 2, m: int = 4) -> bool:
  """True when every m consecutive entries along `axis` hold at most n non-zeros."""
  moved = np.moveaxis(np.asarray(w) != 0, axis, -1)
  groups = moved.reshape(moved.shape[:-1] + (moved.shape[-1] // m, m))
  return bool(np.all(groups.sum(-1) <= n))


def apply_masks(model_or_params: Any, masks: Masks) -> Any:
  """Zeroes the pruned weights: of an nnx model (returns a pruned copy) or of a pure-dict parameter tree."""
  flat_masks = traverse_util.flatten_dict(masks)
  if isinstance(model_or_params, nnx.Module):
    graphdef, state = nnx.split(model_or_params)
    pure = apply_masks(state.to_pure_dict(), masks)
    state = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)
  flat = traverse_util.flatten_dict(model_or_params)
  unknown = [p for p in flat_masks if p not in flat]
  if unknown:
    raise ValueError(f"mask for {'/'.join(map(str, unknown[0]))}, which the parameters do not have")
  return traverse_util.unflatten_dict({p: jnp.where(flat_masks[p], v, 0).astype(v.dtype) if p in flat_masks else v
                                       for p, v in flat.items()})


def sparsity(model_or_params: Any, masks: Masks) -> float:
  """Fraction of zeros among the masked (prunable) weights."""
  flat = traverse_util.flatten_dict(nnx.state(model_or_params).to_pure_dict()
                                    if isinstance(model_or_params, nnx.Module) else model_or_params)
  values = [flat[p] for p in traverse_util.flatten_dict(masks)]
  return float(sum(int(np.sum(np.asarray(v) == 0)) for v in values) / sum(v.size for v in values))


def weight_sparsity(model_or_state: Any) -> float:
  """Fraction of exact zeros among the prunable weights of a float model (no masks needed)."""
  values = [np.asarray(w) for w, _, _ in prunable(model_or_state).values()]
  return float(sum(int(np.sum(v == 0)) for v in values) / max(1, sum(v.size for v in values)))


def full_masks(params: Any, masks: Masks) -> Any:
  """`masks` extended to every parameter (True where nothing is pruned), in the structure of `params`."""
  flat_masks = traverse_util.flatten_dict(masks)
  return traverse_util.unflatten_dict({p: flat_masks.get(p, jnp.ones(v.shape, bool))
                                       for p, v in traverse_util.flatten_dict(params).items()})


def keep_masks(masks: Any) -> optax.GradientTransformation:
  """An optax stage that zeroes the updates of pruned weights (chain it last), so they stay exactly zero through
  Adam's moments and decoupled weight decay."""

  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda u, m: jnp.where(m, u, 0).astype(u.dtype), updates, masks), state

  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def finetune(graphdef: nnx.GraphDef, params: Any, masks: Masks,
             loss_fn: Callable[[Any, Any], tuple[jax.Array, Any]], batches: Iterable[Any], *,
             learning_rate: float = 1e-4, weight_decay: float = 0.0) -> Any:
  """A short AdamW fine-tune of pruned `params` (a pure dict) that keeps the masks; returns the new params.

  `loss_fn(params, batch) -> (loss sum, (count, aux))` as `jaxlm.steps.make_loss_fn` builds; the loss is the sum
  divided by the count."""
  del graphdef  # the loss function closes over it; kept in the signature so calls read like the train step
  params = apply_masks(params, masks)
  mask_tree = full_masks(params, masks)
  optimizer = optax.chain(optax.adamw(learning_rate, weight_decay=weight_decay), keep_masks(mask_tree))
  opt_state = optimizer.init(params)

  @jax.jit
  def step(params, opt_state, batch):
    def mean_loss(p):
      total, (count, _) = loss_fn(p, batch)
      return total / jnp.maximum(count, 1.0)

    loss, grads = jax.value_and_grad(mean_loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  for batch in batches:
    params, opt_state, loss = step(params, opt_state, batch)
    # One step in flight: on simulated CPU devices, queued multi-device steps can starve each other's collectives
    # (XLA aborts after a 40 s rendezvous timeout), as jaxlm.train notes.
    jax.block_until_ready(loss)
  return params


def count_nonzero(tree: Any) -> int:
  return int(sum(np.count_nonzero(np.asarray(x)) for x in jax.tree.leaves(tree)))
