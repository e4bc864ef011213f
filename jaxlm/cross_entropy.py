"""Fused, chunked cross-entropy over the vocabulary: the loss and its gradient without [B, T, V] logits in memory.

The reference path (`model(...)` -> logits [B, T, V] f32 -> optax) writes the logits, reads them for the softmax,
keeps them for the backward pass, writes d(logits), transposes it and reads it twice more: six passes over an
array of B*T*V f32 (64 MB for 8 x 256 tokens and V = 8192). Here the tokens are cut into chunks of `chunk` rows;
for each chunk the forward pass computes the logits, the loss, the accuracy AND the gradient with respect to the
hidden states and the output table (softmax - one-hot, two matmuls) while the chunk's logits are still in cache, and
keeps only those gradients ([N, D] and [V, D]) for the backward pass. This works because the loss is a weighted SUM
of token losses (DESIGN.md: token-weighted sum, then divide by the global count): its cotangent is one scalar, so
the backward pass only scales the saved gradients (the trick of Liger-Kernel's fused linear cross-entropy).

Chunks run over tokens, never over the vocabulary, so every chunk sees whole rows of logits: the log-sum-exp and
argmax are computed exactly as on the full array (tested equal to the reference in tests/test_perf_options.py).
Dimension letters: N tokens (B*T), C tokens in a chunk, D model width, V vocabulary.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def _chunk_stats(x_CD, table_VD, targets_C, weights_C):
  """Logits of one chunk in f32 -> (weighted loss sum, weighted correct sum, probs - one-hot weighted [C, V])."""
  logits_CV = jnp.einsum("cd,vd->cv", x_CD, table_VD, preferred_element_type=jnp.float32)
  # The same formulas as optax.softmax_cross_entropy_with_integer_labels (max-shifted log-sum-exp).
  shift_C = jax.lax.stop_gradient(logits_CV.max(axis=-1))
  shifted_CV = logits_CV - shift_C[:, None]
  lse_C = jnp.log(jnp.exp(shifted_CV).sum(axis=-1))
  target_C = jnp.take_along_axis(shifted_CV, targets_C[:, None], axis=-1)[:, 0]
  loss = jnp.sum((lse_C - target_C) * weights_C)
  correct = jnp.sum((jnp.argmax(logits_CV, axis=-1) == targets_C).astype(jnp.float32) * weights_C)
  return loss, correct, shifted_CV, lse_C


def _split(x, chunk: int):
  return x.reshape(x.shape[0] // chunk, chunk, *x.shape[1:])


def _pad_rows(x_ND, targets_N, weights_N, chunk: int):
  """Pads N up to a multiple of `chunk` with zero-weight rows (they add nothing to the loss or the gradients)."""
  pad = -x_ND.shape[0] % chunk
  if pad:
    x_ND = jnp.pad(x_ND, ((0, pad), (0, 0)))
    targets_N = jnp.pad(targets_N, (0, pad))
    weights_N = jnp.pad(weights_N, (0, pad))
  return x_ND, targets_N, weights_N


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def fused_cross_entropy(x_ND: jax.Array, table_VD: jax.Array, targets_N: jax.Array, weights_N: jax.Array,
                        chunk: int) -> tuple[jax.Array, jax.Array]:
  """(sum_n w_n * CE(x_n @ table^T, target_n), sum_n w_n * [argmax == target]) with f32 logits, `chunk` tokens at
  a time. x and table are in the compute dtype; gradients flow to x and table (the second output has none)."""
  x_ND, targets_N, weights_N = _pad_rows(x_ND, targets_N, weights_N, chunk)

  def body(totals, xs):
    x_CD, targets_C, weights_C = xs
    loss, correct, _, _ = _chunk_stats(x_CD, table_VD, targets_C, weights_C)
    return (totals[0] + loss, totals[1] + correct), None

  zero = jnp.zeros((), jnp.float32)
  (loss, correct), _ = jax.lax.scan(body, (zero, zero), (_split(x_ND, chunk), _split(targets_N, chunk),
                                                        _split(weights_N, chunk)))
  return loss, correct


def _forward(x_ND, table_VD, targets_N, weights_N, chunk):
  n, compute_dtype = x_ND.shape[0], x_ND.dtype
  x_ND, targets_N, weights_N = _pad_rows(x_ND, targets_N, weights_N, chunk)

  def body(carry, xs):
    loss_sum, correct_sum, dtable_VD = carry
    x_CD, targets_C, weights_C = xs
    loss, correct, shifted_CV, lse_C = _chunk_stats(x_CD, table_VD, targets_C, weights_C)
    # d(loss)/d(logits) = w * (softmax - one-hot), in f32, then matmuls in the compute dtype with f32 accumulation.
    dlogits_CV = jnp.exp(shifted_CV - lse_C[:, None])
    dlogits_CV = dlogits_CV - jax.nn.one_hot(targets_C, dlogits_CV.shape[-1], dtype=jnp.float32)
    dlogits_CV = (dlogits_CV * weights_C[:, None]).astype(compute_dtype)
    dx_CD = jnp.einsum("cv,vd->cd", dlogits_CV, table_VD, preferred_element_type=jnp.float32)
    dtable_VD = dtable_VD + jnp.einsum("cv,cd->vd", dlogits_CV, x_CD, preferred_element_type=jnp.float32)
    return (loss_sum + loss, correct_sum + correct, dtable_VD), dx_CD

  zero = jnp.zeros((), jnp.float32)
  init = (zero, zero, jnp.zeros(table_VD.shape, jnp.float32))
  (loss, correct, dtable_VD), dx_KCD = jax.lax.scan(
      body, init, (_split(x_ND, chunk), _split(targets_N, chunk), _split(weights_N, chunk)))
  dx_ND = dx_KCD.reshape(-1, x_ND.shape[1])[:n]
  residuals = (dx_ND.astype(compute_dtype), dtable_VD.astype(table_VD.dtype), targets_N[:n], weights_N[:n])
  return (loss, correct), residuals


def _backward(chunk, residuals, cotangents):
  del chunk
  dx_ND, dtable_VD, targets_N, weights_N = residuals
  g_loss = cotangents[0]  # the accuracy output has no gradient
  dx = (g_loss * dx_ND.astype(jnp.float32)).astype(dx_ND.dtype)
  dtable = (g_loss * dtable_VD.astype(jnp.float32)).astype(dtable_VD.dtype)
  # Integer targets take a float0 cotangent; the weights are data (a mask), not differentiated.
  return dx, dtable, jnp.zeros(targets_N.shape, jax.dtypes.float0), jnp.zeros_like(weights_N)


fused_cross_entropy.defvjp(_forward, _backward)
