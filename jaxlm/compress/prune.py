"""Magnitude pruning (global or per layer, to an exact sparsity), 2:4 semi-structured pruning, activation-aware
(Wanda) pruning, SparseGPT (masks plus a per-layer reconstruction of the kept weights), and a short fine-tune that
keeps the pruned weights at zero, alone or several averaged (a sparse soup).

  masks = prune.magnitude_masks(model, 0.5)            # one threshold over all prunable weights
  masks = prune.magnitude_masks(model, 0.5, per_layer=True)   # each matrix of each layer to 50%
  masks = prune.two_four_masks(model)                  # in every 4 consecutive inputs of an output, keep 2
  masks = prune.wanda_masks(model, 0.5, batches, forward)                 # |W| * ||X_j||, 50% of each output row
  masks = prune.wanda_masks(model, 0.5, batches, forward, pattern="2:4")  # the same score, 2 of every 4 inputs
  model, masks = prune.sparsegpt(model, 0.5, batches, forward)            # + reconstruction of the kept weights
  pruned = prune.apply_masks(model, masks)
  params = prune.finetune(graphdef, params, masks, loss_fn, batches, learning_rate=1e-4)
  params = prune.finetune_soup(graphdef, params, masks, loss_fn, batch_orders)  # one fine-tune per order, averaged

Wanda (Sun et al., 2024) scores weight W_ij (input j, output i) by |W_ij| * ||X_j||_2, the L2 norm of its input
channel over every token of the calibration batches (`calibration.input_statistics`, the probe that calibrates
W8A8), and compares weights within one output row: a large weight on a quiet input may go, a small one on a loud
input stays.
Prunable weights are the matmul weights of `jaxlm.compress.int8.CONTRACTED_AXES` inside the stacked transformer blocks:
the embedding tables (a pruned vocabulary row would delete a token) and the small dense heads (BERT's pooler, classifier
and MLM transform, under 0.1% of the weights, where every pruned weight is a class's feature) stay dense. Masks are
pure dicts of bool arrays over those parameters only. Ties at the threshold are broken by position (a stable sort),
so exactly round(sparsity * n) weights are zeroed. The 2:4 groups
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

from jaxlm.compress import calibration as calibration_lib
from jaxlm.compress import int8

Masks = dict  # nested pure dict: parameter path -> bool array (True = kept)


def prunable(model_or_state: Any) -> dict[tuple, tuple[jax.Array, tuple[int, ...]]]:
  """{path: (value, contracted axes)} of the weights pruning may touch: the blocks' matmuls, [L, ...] each."""
  state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
  out = {}
  for path, variable in nnx.to_flat_state(state):
    contracted = int8.quantizable(path, variable)
    if contracted is not None and path[-1] != "embedding" and int8.is_stacked(variable, variable.get_value()):
      out[path] = (variable.get_value(), contracted)
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


ATTENTION = ("w_q", "w_k", "w_v", "w_o")  # the other prunable matrices are the MLP's


def allocation(model: Any, sparsity: float, attention_ratio: float = 1.0) -> dict[tuple, float]:
  """{path: sparsity} of each prunable matrix, `sparsity` over them all: the attention projections at
  `attention_ratio` x `sparsity`, the MLP matrices at the rate that keeps the total (1.0: every matrix alike)."""
  check_sparsity(sparsity)
  sizes = {path: w.size for path, (w, _) in prunable(model).items()}
  attention = sum(n for path, n in sizes.items() if path[-1] in ATTENTION)
  attention_sparsity = attention_ratio * sparsity
  mlp_sparsity = (sparsity * sum(sizes.values()) - attention_sparsity * attention) / (sum(sizes.values()) - attention)
  if not (0.0 <= attention_sparsity < 1.0 and 0.0 <= mlp_sparsity < 1.0):
    raise ValueError(f"attention ratio {attention_ratio} at sparsity {sparsity} gives attention "
                     f"{attention_sparsity:.3f} and MLP {mlp_sparsity:.3f}: both must be in [0, 1); pick a ratio "
                     "nearer 1")
  return {path: attention_sparsity if path[-1] in ATTENTION else mlp_sparsity for path in sizes}


def magnitude_masks(model: Any, sparsity: float, per_layer: bool = False, attention_ratio: float = 1.0) -> Masks:
  """Masks zeroing the smallest-|w| fraction `sparsity`: over all prunable weights at once (global), or within
  each weight matrix of each layer (`per_layer`, at `allocation`'s rate per matrix)."""
  check_sparsity(sparsity)
  weights = prunable(model)
  flat_masks = {}
  if per_layer:
    rates = allocation(model, sparsity, attention_ratio)
    for path, (w, _) in weights.items():
      per_layer_pruned = round(rates[path] * w[0].size)
      flat_masks[path] = jax.vmap(lambda s: _keep_largest(jnp.abs(s), per_layer_pruned))(w)
  else:
    magnitudes = jnp.concatenate([jnp.abs(w.astype(jnp.float32)).reshape(-1) for w, _ in weights.values()])
    keep = _keep_largest(magnitudes, round(sparsity * magnitudes.size))
    start = 0
    for path, (w, _) in weights.items():
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
                                       for path, (w, contracted) in prunable(model).items()})


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


def wanda_scores(w: Any, input_norm: Any, contracted: tuple[int, ...]) -> np.ndarray:
  """|W| * ||X_j|| of a stacked weight [L, ...]: `input_norm` [L, *C] is the L2 norm of each layer's input channel
  (the weight's contracted axes)."""
  w = np.asarray(w, np.float32)
  shape = [w.shape[0]] + [1] * (w.ndim - 1)
  for axis in contracted:
    shape[axis] = w.shape[axis]
  return np.abs(w) * np.asarray(input_norm, np.float32).reshape(shape)


def wanda_masks(model: Any, sparsity: float, calibration: Iterable[Any],
                forward: Callable[[nnx.Module, Any], Any], pattern: str = "unstructured",
                attention_ratio: float = 1.0) -> Masks:
  """Wanda masks: in each output row of each layer's matrix, the `sparsity` fraction of inputs with the lowest
  |W| * ||X_j|| go ("unstructured"), or the 2 lowest of every 4 consecutive inputs ("2:4", along the innermost
  contracted axis as `two_four_masks`; `sparsity` must then be 0.5). `forward(model, batch)` runs the model on a
  calibration batch (training data) as the task does. `attention_ratio`: as `allocation` (unstructured only)."""
  _check_pattern(sparsity, pattern, attention_ratio)
  rates = allocation(model, sparsity, attention_ratio)
  batches = list(calibration)
  statistics = calibration_lib.input_statistics(model, batches, forward)
  flat_masks = {}
  for path, (w, contracted) in prunable(model).items():
    name = "/".join(map(str, path))
    if name not in statistics:
      raise ValueError(f"no calibration batch ran the matmul of {name}: forward(model, batch) must run the whole "
                       "model as the task does")
    scores = wanda_scores(w, np.sqrt(statistics[name].sumsq), contracted)
    if pattern == "2:4":
      flat_masks[path] = n_m_mask(jnp.asarray(scores), max(contracted))
    else:
      per_row = int(np.prod([w.shape[a] for a in contracted]))
      flat_masks[path] = jnp.asarray(row_mask(scores, contracted, round(rates[path] * per_row)))
  return traverse_util.unflatten_dict(flat_masks)


def _check_pattern(sparsity: float, pattern: str, attention_ratio: float = 1.0) -> None:
  check_sparsity(sparsity)
  if pattern not in PATTERNS:
    raise ValueError(f"pruning pattern {pattern!r} is not one of {', '.join(PATTERNS)}")
  if pattern == "2:4" and sparsity != 0.5:
    raise ValueError(f"2:4 pruning zeroes exactly half of each row, not sparsity {sparsity}; give 0.5")
  if pattern == "2:4" and attention_ratio != 1.0:
    raise ValueError(f"2:4 pruning zeroes half of every matrix: attention ratio {attention_ratio} applies to "
                     "unstructured pruning only; give 1.0")


def sparsegpt_matrix(w: Any, gram: Any, sparsity: float, pattern: str = "unstructured", block_size: int = 128,
                     damping: float = 0.01) -> tuple[np.ndarray, np.ndarray]:
  """SparseGPT on one matrix `w` [n_in, n_out] whose input rows X have Gram matrix `gram` = X^T X [n_in, n_in]:
  (pruned weight, keep mask), both [n_in, n_out] and float64 / bool.

  Inputs are visited in blocks of `block_size`: at a block's start each output keeps its inputs with the largest
  w^2 / [U]_jj^2 (U = the upper Cholesky factor of H^-1, H = gram + damping * mean diag), `round(sparsity * end)`
  pruned up to the block's end (so each output loses exactly round(sparsity * n_in)); with "2:4" the 2 largest of
  every 4 consecutive inputs, chosen as the loop reaches them. Each pruned column's error is then spread over the
  inputs not yet visited through U's row (Optimal Brain Surgeon), which is what lowers ||X w - X w_pruned||."""
  _check_pattern(sparsity, pattern)
  w = np.array(w, np.float64).T  # [out, in]: the paper's rows are outputs
  n_in = w.shape[1]
  if pattern == "2:4" and n_in % 4:
    raise ValueError(f"2:4 pruning needs the contracted axis ({n_in}) to be a multiple of 4")
  h = np.array(gram, np.float64)
  if h.shape != (n_in, n_in):
    raise ValueError(f"the Gram matrix is {h.shape}, the weight has {n_in} inputs")
  dead = np.diag(h) == 0  # inputs that were always zero: pruning them costs nothing
  h[dead, dead] = 1.0
  w[:, dead] = 0.0
  h[np.diag_indices(n_in)] += damping * np.mean(np.diag(h))
  u = np.linalg.cholesky(np.linalg.inv(h)).T  # upper: H^-1 = U^T U
  keep = np.ones(w.shape, bool)
  for start in range(0, n_in, block_size):
    end = min(start + block_size, n_in)
    block, u_block = w[:, start:end].copy(), u[start:end, start:end]
    errors = np.zeros_like(block)
    if pattern == "unstructured":
      num_pruned = round(sparsity * end) - round(sparsity * start)
      scores = block ** 2 / np.diag(u_block)[None] ** 2
      lowest = np.argsort(scores, axis=1, kind="stable")[:, :num_pruned]
      np.put_along_axis(keep[:, start:end], lowest, False, axis=1)
    for i in range(end - start):
      if pattern == "2:4" and i % 4 == 0:
        scores = block[:, i:i + 4] ** 2 / np.diag(u_block)[None, i:i + 4] ** 2
        lowest = np.argsort(scores, axis=1, kind="stable")[:, :2]
        np.put_along_axis(keep[:, start + i:start + i + 4], lowest, False, axis=1)
      column = block[:, i]
      errors[:, i] = np.where(keep[:, start + i], 0.0, column) / u_block[i, i]
      block[:, i:] -= errors[:, i:i + 1] * u_block[i:i + 1, i:]
      block[:, i] = np.where(keep[:, start + i], block[:, i], 0.0)
    w[:, start:end] = block
    w[:, end:] -= errors @ u[start:end, end:]
  return w.T, keep.T


def _flat_matrix(w: np.ndarray, contracted: tuple[int, ...]) -> tuple[np.ndarray, Callable[[np.ndarray], np.ndarray]]:
  """One layer's weight as [inputs, outputs] (contracted axes first, in order, flattened), and the inverse."""
  moved = np.moveaxis(w, contracted, range(len(contracted)))
  n_in = int(np.prod(moved.shape[:len(contracted)]))
  back = lambda m: np.moveaxis(m.reshape(moved.shape), range(len(contracted)), contracted)  # noqa: E731
  return moved.reshape(n_in, -1), back


def sparsegpt(model: nnx.Module, sparsity: float, calibration: Iterable[Any],
              forward: Callable[[nnx.Module, Any], Any], pattern: str = "unstructured",
              sequential: bool = True, attention_ratio: float = 1.0) -> tuple[nnx.Module, Masks]:
  """SparseGPT (Frantar & Alistarh, 2023): prunes each output row of each layer's matrix to `sparsity` (or 2:4) by
  `sparsegpt_matrix`, which also updates the kept weights to reconstruct the layer's output on the calibration
  inputs. Returns (pruned model, masks); the masks feed `finetune` like the others.

  `sequential`: layer l's inputs are measured with layers < l already pruned (one calibration pass per layer), as
  the paper; within a layer every matrix sees the dense layer's inputs. False: one pass, every layer calibrated on
  the dense model. `attention_ratio`: as `allocation` (unstructured only)."""
  _check_pattern(sparsity, pattern, attention_ratio)
  rates = allocation(model, sparsity, attention_ratio)
  batches = list(calibration)
  weights = prunable(model)
  layers = next(iter(weights.values()))[0].shape[0]
  passes = [range(layers)] if not sequential else [[layer] for layer in range(layers)]
  graphdef, state = nnx.split(model)
  values = {path: np.array(w) for path, (w, _) in weights.items()}
  keeps = {path: np.ones(w.shape, bool) for path, w in values.items()}
  current = model
  for stage in passes:
    statistics = calibration_lib.input_statistics(current, batches, forward, gram=True)
    for path, (_, contracted) in weights.items():
      name = "/".join(map(str, path))
      if name not in statistics:
        raise ValueError(f"no calibration batch ran the matmul of {name}: forward(model, batch) must run the whole "
                         "model as the task does")
      for layer in stage:
        matrix, back = _flat_matrix(values[path][layer], tuple(a - 1 for a in contracted))
        pruned, keep = sparsegpt_matrix(matrix, statistics[name].gram[layer], rates[path], pattern)
        values[path][layer], keeps[path][layer] = back(pruned).astype(values[path].dtype), back(keep)
    pure = traverse_util.flatten_dict(state.to_pure_dict())
    pure.update({p: jnp.asarray(v) for p, v in values.items()})
    new_state = jax.tree.map(lambda x: x, state)
    nnx.replace_by_pure_dict(new_state, traverse_util.unflatten_dict(pure))
    current = nnx.merge(graphdef, new_state)
  return current, traverse_util.unflatten_dict({p: jnp.asarray(k) for p, k in keeps.items()})


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
  values = [np.asarray(w) for w, _ in prunable(model_or_state).values()]
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
             learning_rate: float = 1e-4, weight_decay: float = 0.0,
             optimizer: optax.GradientTransformation | None = None) -> Any:
  """A short AdamW fine-tune of pruned `params` (a pure dict) that keeps the masks; returns the new params.
  `optimizer` replaces the plain AdamW(learning_rate, weight_decay), e.g. with the run's own settings.

  `loss_fn(params, batch) -> (loss sum, (count, aux))` as `jaxlm.training.steps.make_loss_fn` builds; the loss is the
  sum divided by the count."""
  return finetune_soup(graphdef, params, masks, loss_fn, [batches], learning_rate=learning_rate,
                       weight_decay=weight_decay, optimizer=optimizer)


def finetune_soup(graphdef: nnx.GraphDef, params: Any, masks: Masks,
                  loss_fn: Callable[[Any, Any], tuple[jax.Array, Any]], orders: list[Iterable[Any]], *,
                  learning_rate: float = 1e-4, weight_decay: float = 0.0,
                  optimizer: optax.GradientTransformation | None = None) -> Any:
  """`finetune` once per batch order in `orders`, each from `params` with a fresh optimizer state, and their `soup`;
  one compiled step serves every order."""
  del graphdef  # the loss function closes over it; kept in the signature so calls read like the train step
  params = apply_masks(params, masks)
  mask_tree = full_masks(params, masks)
  optimizer = optax.chain(optimizer or optax.adamw(learning_rate, weight_decay=weight_decay), keep_masks(mask_tree))

  @jax.jit
  def step(params, opt_state, batch):
    def mean_loss(p):
      total, (count, _) = loss_fn(p, batch)
      return total / jnp.maximum(count, 1.0)

    loss, grads = jax.value_and_grad(mean_loss)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  members = []
  for batches in orders:
    tuned, opt_state = params, optimizer.init(params)
    for batch in batches:
      tuned, opt_state, loss = step(tuned, opt_state, batch)
      # One step in flight: on simulated CPU devices, queued multi-device steps can starve each other's collectives
      # (XLA aborts after a 40 s rendezvous timeout), as jaxlm.training.loop notes.
      jax.block_until_ready(loss)
    members.append(tuned)
  return members[0] if len(members) == 1 else soup(members)


def soup(members: list[Any]) -> Any:
  """The mean of several masked fine-tunes of one pruned model (a sparse model soup, Zimmer et al., 2024): they share
  one mask, so the pruned weights stay exactly zero, and fine-tunes that differ only in batch order average into a
  model better than most of them alone."""
  if not members:
    raise ValueError("a soup needs at least one fine-tuned parameter tree")
  return jax.tree.map(lambda *leaves: sum(leaves[1:], leaves[0]) / len(leaves), *members)


def count_nonzero(tree: Any) -> int:
  return int(sum(np.count_nonzero(np.asarray(x)) for x in jax.tree.leaves(tree)))
