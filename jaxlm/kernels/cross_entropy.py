"""Fused, chunked cross-entropy over the vocabulary: the loss and its gradient without [B, T, V] logits in memory.

The reference path (`model(...)` -> logits [B, T, V] f32 -> optax) writes the logits, reads them for the softmax,
keeps them for the backward pass, writes d(logits), transposes it and reads it twice more: six passes over an
array of B*T*V f32 (64 MB for 8 x 256 tokens and V = 8192). Here the tokens are cut into chunks of `chunk` rows;
for each chunk the forward pass computes the logits, the loss, the accuracy AND the gradient with respect to the
hidden states and the output table (softmax - one-hot, two matmuls) while the chunk's logits are still in cache, and
keeps only those gradients ([N, D] and [V, D]) for the backward pass. This works because the loss is a weighted SUM
of token losses (divided by the global token count afterwards): its cotangent is one scalar, so the backward pass
only scales the saved gradients (the trick of Liger-Kernel's fused linear cross-entropy).

Chunks run over tokens, never over the vocabulary, so every chunk sees whole rows of logits: the log-sum-exp and
argmax are computed exactly as on the full array (tested equal to the reference in tests/test_kernels.py).
Dimension letters: N tokens (B*T), P devices splitting the tokens (the batch axes of the mesh; 1 off a mesh),
K chunks, C tokens per device in a chunk, D model width, V vocabulary.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxlm.parallel import sharding

_F32 = {"preferred_element_type": jnp.float32}  # f32 results from compute-dtype operands


def token_stats(logits_PCV, targets_PC):
  """Per token of one chunk's f32 logits: (cross-entropy [P, C], 1 where argmax == target [P, C], row max,
  exp(logits - max), its row sums): what the loss, the accuracy and `_dlogits` take."""
  # The same formulas as optax.softmax_cross_entropy_with_integer_labels (max-shifted log-sum-exp).
  shift_PC = jax.lax.stop_gradient(logits_PCV.max(axis=-1))
  exp_PCV = jnp.exp(logits_PCV - shift_PC[..., None])
  sum_PC = exp_PCV.sum(axis=-1)
  target_PC = jnp.take_along_axis(logits_PCV, targets_PC[..., None], axis=-1)[..., 0] - shift_PC
  # argmax, not "target logit == max": on a tie (e.g. a zero head) that would count every tied token correct.
  correct_PC = (jnp.argmax(logits_PCV, axis=-1) == targets_PC).astype(jnp.float32)
  return jnp.log(sum_PC) - target_PC, correct_PC, shift_PC, exp_PCV, sum_PC


def _chunk_stats(x_PCD, table_VD, targets_PC, weights_PC, einsum):
  """Logits of one chunk in f32 -> (weighted loss sum, weighted correct sum, logits, row max, exp(logits - max),
  its row sums)."""
  logits_PCV = einsum("pcd,vd->pcv", x_PCD, table_VD, **_F32)
  loss_PC, correct_PC, shift_PC, exp_PCV, sum_PC = token_stats(logits_PCV, targets_PC)
  return jnp.sum(loss_PC * weights_PC), jnp.sum(correct_PC * weights_PC), logits_PCV, shift_PC, exp_PCV, sum_PC


def _use_scatter_gradient() -> bool:
  """Which form of d(loss)/d(logits) to trace: the scatter form when the default backend is XLA:CPU, the one-hot
  form otherwise (a CPU mesh on a GPU host gets the one-hot form: correct, slower)."""
  return jax.default_backend() == "cpu"


def _dlogits(logits_PCV, shift_PC, exp_PCV, sum_PC, targets_PC, weights_PC):
  """d(loss)/d(logits) = w * (softmax - one-hot) in f32, in the form that is fastest on each compiler.

  Off the CPU: `(exp(logits - max - log(sum)) - one_hot) * w`, one pass XLA:GPU fuses from logits to gradient. On
  XLA:CPU the one-hot's iota compare fused into a slow pass, so there the gradient reuses exp(logits - max) with one
  scale per row, then scatters -w at each row's target (vmapped over P so that a P split over devices stays split).
  docs/performance.md has the measurements of both forms."""
  if _use_scatter_gradient():
    dlogits_PCV = exp_PCV * (weights_PC / sum_PC)[..., None]
    subtract_at_targets = lambda d_CV, t_C, w_C: d_CV.at[jnp.arange(t_C.shape[0]), t_C].add(-w_C)
    return jax.vmap(subtract_at_targets)(dlogits_PCV, targets_PC, weights_PC)
  softmax_PCV = jnp.exp((logits_PCV - shift_PC[..., None]) - jnp.log(sum_PC)[..., None])
  one_hot_PCV = jax.nn.one_hot(targets_PC, logits_PCV.shape[-1], dtype=jnp.float32)
  return (softmax_PCV - one_hot_PCV) * weights_PC[..., None]


def _batch_shards(num_tokens: int) -> int:
  """P: how many devices split the token axis (the mesh's batch axes while a step is traced; 1 off a mesh or
  inside shard_map, where each device already sees only its own tokens)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or jax.sharding.AxisType.Manual in mesh.axis_types:
    return 1
  axes = sharding.rule("act_batch")
  shards = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes or ()))
  return shards if num_tokens % shards == 0 else 1


def _blocks(x, shards: int, chunk: int):
  """[N, ...] -> [K, P, C, ...]: each device's contiguous block of N / P tokens (the batch sharding), cut into K
  chunks of C = `chunk`, zero-padded (padding rows have weight 0). Scanning over K keeps the P axis sharded, so every
  device runs its own tokens of each chunk; with chunks of the flat token axis, the sharding lands on the scanned
  axis and GSPMD all-gathers the hidden states, and every device computes every chunk."""
  per_shard = x.shape[0] // shards
  x = x.reshape(shards, per_shard, *x.shape[1:])
  pad = -per_shard % chunk
  if pad:
    x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
  x = x.reshape(shards, x.shape[1] // chunk, chunk, *x.shape[2:])
  x = jnp.moveaxis(x, 1, 0)
  return sharding.constrain(x, (None, "act_batch") + (None,) * (x.ndim - 2))


def _unblocks(x_KPC, num_tokens: int):
  """The inverse of `_blocks`: [K, P, C, ...] -> [N, ...] without the padding."""
  k, p, c = x_KPC.shape[:3]
  x = jnp.moveaxis(x_KPC, 0, 1).reshape(p, k * c, *x_KPC.shape[3:])[:, :num_tokens // p]
  return x.reshape(num_tokens, *x.shape[2:])


def fused_cross_entropy(x_ND: jax.Array, table_VD: jax.Array, targets_N: jax.Array, weights_N: jax.Array,
                        chunk: int, einsum=jnp.einsum) -> tuple[jax.Array, jax.Array]:
  """(sum_n w_n * CE(x_n @ table^T, target_n), sum_n w_n * [argmax == target]) with f32 logits, `chunk` tokens per
  device at a time. x and table are in the compute dtype; gradients flow to x and table (the second output has
  none). `einsum` runs the matmuls (the registry's weight einsum)."""
  shards = _batch_shards(x_ND.shape[0])
  chunk = min(chunk, x_ND.shape[0] // shards)  # fewer tokens than a chunk: one chunk of them, no padding
  return _fused(x_ND, table_VD, targets_N, weights_N, chunk, shards, einsum, (x_ND.dtype, table_VD.dtype))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _fused(x_ND, table_VD, targets_N, weights_N, chunk, shards, einsum, dtypes):
  del dtypes  # the dtypes of the gradients the backward pass returns
  def body(totals, xs):
    x_PCD, targets_PC, weights_PC = xs
    loss, correct, *_ = _chunk_stats(x_PCD, table_VD, targets_PC, weights_PC, einsum)
    return (totals[0] + loss, totals[1] + correct), None

  zero = jnp.zeros((), jnp.float32)
  xs = tuple(_blocks(a, shards, chunk) for a in (x_ND, targets_N, weights_N))
  (loss, correct), _ = jax.lax.scan(body, (zero, zero), xs)
  return loss, correct


def _forward(x_ND, table_VD, targets_N, weights_N, chunk, shards, einsum, dtypes):
  n, compute_dtype = x_ND.shape[0], x_ND.dtype

  def body(carry, xs):
    loss_sum, correct_sum, dtable_PVD = carry
    x_PCD, targets_PC, weights_PC = xs
    loss, correct, *stats = _chunk_stats(x_PCD, table_VD, targets_PC, weights_PC, einsum)
    # The gradient in f32, then matmuls in the compute dtype with f32 accumulation.
    dlogits_PCV = _dlogits(*stats, targets_PC, weights_PC).astype(compute_dtype)
    dx_PCD = einsum("pcv,vd->pcd", dlogits_PCV, table_VD, **_F32)
    # Each device accumulates its own partial table gradient; they are summed once, after the scan.
    dtable_PVD = dtable_PVD + einsum("pcv,pcd->pvd", dlogits_PCV, x_PCD, **_F32)
    return (loss_sum + loss, correct_sum + correct, dtable_PVD), dx_PCD

  zero = jnp.zeros((), jnp.float32)
  dtable_PVD = sharding.constrain(jnp.zeros((shards,) + table_VD.shape, jnp.float32), ("act_batch", None, None))
  xs = tuple(_blocks(a, shards, chunk) for a in (x_ND, targets_N, weights_N))
  (loss, correct, dtable_PVD), dx_KPCD = jax.lax.scan(body, (zero, zero, dtable_PVD), xs)
  dx_ND = _unblocks(dx_KPCD, n)
  # float16: the saved gradients stay f32. They are computed at loss scale 1; rounded to float16 before the
  # backward pass multiplies them by the loss scale (jaxlm/training/loss_scale.py), their small values would flush to
  # zero.
  saved = jnp.float32 if compute_dtype == jnp.float16 else None
  residuals = (dx_ND.astype(saved or compute_dtype), dtable_PVD.sum(axis=0).astype(saved or table_VD.dtype),
               targets_N, weights_N)
  return (loss, correct), residuals


def _backward(chunk, shards, einsum, dtypes, residuals, cotangents):
  del chunk, shards, einsum
  dx_ND, dtable_VD, targets_N, weights_N = residuals
  g_loss = cotangents[0]  # the accuracy output has no gradient
  dx = (g_loss * dx_ND.astype(jnp.float32)).astype(dtypes[0])
  dtable = (g_loss * dtable_VD.astype(jnp.float32)).astype(dtypes[1])
  # Integer targets take a float0 cotangent; the weights are data (a mask), not differentiated.
  return dx, dtable, jnp.zeros(targets_N.shape, jax.dtypes.float0), jnp.zeros_like(weights_N)


_fused.defvjp(_forward, _backward)


def _per_token(x_ND: jax.Array, table_VD: jax.Array, targets_N: jax.Array, chunk: int, einsum, softcap, of_chunk):
  """of_chunk(logits [P, C, V] f32, targets [P, C]) -> a tree of [P, C] values, mapped over the tokens `chunk` per
  device at a time (no [N, V] logits in memory) and returned as [N] leaves."""
  n = x_ND.shape[0]
  shards = _batch_shards(n)
  chunk = min(chunk, n // shards)

  def one_chunk(xs):
    x_PCD, targets_PC = xs
    return of_chunk(softcap(einsum("pcd,vd->pcv", x_PCD, table_VD, **_F32)), targets_PC)

  out = jax.lax.map(one_chunk, (_blocks(x_ND, shards, chunk), _blocks(targets_N, shards, chunk)))
  return jax.tree.map(lambda a: _unblocks(a, n), out)


def _log_probs(logits_PCV, targets_PC, lse_PC):
  return jnp.take_along_axis(logits_PCV, targets_PC[..., None], axis=-1)[..., 0] - lse_PC


def _entropy(logits_PCV, lse_PC):  # H = logsumexp - E_p[logits]
  return lse_PC - jnp.sum(jax.nn.softmax(logits_PCV, axis=-1) * logits_PCV, axis=-1)


def token_log_probs(x_ND: jax.Array, table_VD: jax.Array, targets_N: jax.Array, chunk: int, einsum=jnp.einsum,
                    softcap=lambda logits: logits, with_entropy: bool = False):
  """log softmax(softcap(x_n @ table^T))[target_n] for every token, [N] in f32, `chunk` tokens per device at a time
  (no [N, V] logits in memory). Forward only: preference and policy losses take their gradient through
  `fused_cross_entropy` with per-token weights (jaxlm/training/preference_loss.py, policy_loss.py).
  `with_entropy`: also each token's predictive entropy [N], from the same pass over the vocabulary."""

  def of_chunk(logits_PCV, targets_PC):
    lse_PC = jax.nn.logsumexp(logits_PCV, axis=-1)
    log_probs_PC = _log_probs(logits_PCV, targets_PC, lse_PC)
    return (log_probs_PC, _entropy(logits_PCV, lse_PC)) if with_entropy else log_probs_PC

  return _per_token(x_ND, table_VD, targets_N, chunk, einsum, softcap, of_chunk)


def token_statistics(x_ND: jax.Array, table_VD: jax.Array, targets_N: jax.Array, chunk: int, einsum=jnp.einsum,
                     softcap=lambda logits: logits) -> dict[str, jax.Array]:
  """Per token, [N] in f32, from one forward pass over the vocabulary `chunk` tokens at a time (evaluation's
  diagnostics, as TRL logs them): `log_probs` of the target, predictive `entropy`, `mean_logit` (the logits' mean
  over the vocabulary) and `top1` (1 where the target is the first largest logit, as argmax picks)."""

  def of_chunk(logits_PCV, targets_PC):
    lse_PC = jax.nn.logsumexp(logits_PCV, axis=-1)
    return {"log_probs": _log_probs(logits_PCV, targets_PC, lse_PC), "entropy": _entropy(logits_PCV, lse_PC),
            "mean_logit": jnp.mean(logits_PCV, axis=-1),
            "top1": (jnp.argmax(logits_PCV, axis=-1) == targets_PC).astype(jnp.float32)}

  return _per_token(x_ND, table_VD, targets_N, chunk, einsum, softcap, of_chunk)
