"""The XLA attention implementations (every platform): the einsum reference, query blocks that skip the causal upper
triangle, a flash-style backward that recomputes the probabilities, and jax.nn.dot_product_attention's XLA path.

Shapes: B batch, T queries, S keys, H query heads, G key/value heads, R = H / G, K head dim. Every function takes
q [B, T, H, K] and k, v [B, S, G, K] in the compute dtype and a bool mask [B, T, S], and returns [B, T, H, K]; the
softmax is in f32 everywhere.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxlm.kernels import xla


# A large finite negative instead of -inf: a fully masked row then gives a uniform softmax rather than NaNs.
MASK_VALUE = -1e30


def dot_product_attention(q_BTHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, mask_BTS: jax.Array,
                          softcap: float = 0.0) -> jax.Array:
  """Softmax attention in f32 where R = H / G query heads share each key/value head (G = H: multi-head,
  G = 1: multi-query). Query head h uses key/value head h // R, as HF's repeat_kv does. `softcap` > 0 squashes the
  scaled scores to softcap * tanh(s / softcap) before the mask (Gemma 2)."""
  b, t, h, k = q_BTHK.shape
  g = k_BSGK.shape[2]
  q_BTGRK = q_BTHK.reshape(b, t, g, h // g, k)
  scores_BGRTS = jnp.einsum("btgrk,bsgk->bgrts", q_BTGRK, k_BSGK, preferred_element_type=jnp.float32)
  scores_BGRTS = scores_BGRTS / math.sqrt(k)
  scores_BGRTS = xla.softcap(scores_BGRTS, softcap)
  scores_BGRTS = jnp.where(mask_BTS[:, None, None], scores_BGRTS, MASK_VALUE)
  probs_BGRTS = jax.nn.softmax(scores_BGRTS, axis=-1).astype(v_BSGK.dtype)  # softmax in f32
  return jnp.einsum("bgrts,bsgk->btgrk", probs_BGRTS, v_BSGK).reshape(b, t, h, k)


def causal_block_attention(q_BTHK: jax.Array, k_BTGK: jax.Array, v_BTGK: jax.Array, mask_BTT: jax.Array,
                           block: int, einsum=jnp.einsum) -> jax.Array:
  """`dot_product_attention` for self-attention under a causal mask, computed in query blocks of `block` rows:
  block i only meets the keys of blocks 0..i, so the masked upper triangle is neither multiplied nor
  soft-maxed (T=256, block 64: 10/16 of the work). Heads lead the layout ([B, G, R, T, K]), which XLA:CPU runs
  faster than the reference's [B, T, ...] einsums. The backward pass is written by hand (`_causal_blocks_bwd`).
  `einsum` runs the matmuls (the registry's weight einsum: XLA's dots, or batched BLAS calls on the CPU).
  The mask must hide every key after its query and show each query its own key (jaxlm's causal mask, with or
  without document boundaries): the skipped blocks must not matter, and no row may be fully masked."""
  b, t, h, k = q_BTHK.shape
  g = k_BTGK.shape[2]
  if k_BTGK.shape[1] != t:
    raise ValueError(f"causal block attention needs as many keys as queries, got {k_BTGK.shape[1]} and {t}")
  # Scaling q (B*T*H*K values) instead of the scores (up to B*H*T*T) saves a pass over every score block.
  q_BGRTK = (q_BTHK * (1 / math.sqrt(k))).reshape(b, t, g, h // g, k).transpose(0, 2, 3, 1, 4)  # keeps q's dtype
  out_BGRTK = _causal_blocks(q_BGRTK, k_BTGK.transpose(0, 2, 1, 3), v_BTGK.transpose(0, 2, 1, 3), mask_BTT,
                             block, einsum)
  return out_BGRTK.transpose(0, 3, 1, 2, 4).reshape(b, t, h, k)


def _query_blocks(t: int, block: int) -> list[tuple[int, int]]:
  return [(start, min(start + block, t)) for start in range(0, t, block)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _causal_blocks(q_BGRTK, k_BGTK, v_BGTK, mask_BTT, block, einsum):
  return _causal_blocks_fwd(q_BGRTK, k_BGTK, v_BGTK, mask_BTT, block, einsum)[0]


def _causal_blocks_fwd(q_BGRTK, k_BGTK, v_BGTK, mask_BTT, block, einsum):
  outs, probs = [], []
  for start, end in _query_blocks(q_BGRTK.shape[3], block):  # unrolled: each block has its own static key length
    scores_BGRQS = einsum("bgrqk,bgsk->bgrqs", q_BGRTK[:, :, :, start:end], k_BGTK[:, :, :end],
                                 preferred_element_type=jnp.float32)
    scores_BGRQS = jnp.where(mask_BTT[:, None, None, start:end, :end], scores_BGRQS, MASK_VALUE)
    probs_BGRQS = jnp.exp(scores_BGRQS - jnp.max(scores_BGRQS, axis=-1, keepdims=True))
    probs_BGRQS = (probs_BGRQS / jnp.sum(probs_BGRQS, axis=-1, keepdims=True)).astype(q_BGRTK.dtype)
    probs.append(probs_BGRQS)
    outs.append(einsum("bgrqs,bgsk->bgrqk", probs_BGRQS, v_BGTK[:, :, :end]))
  out_BGRTK = jnp.concatenate(outs, axis=3)
  return out_BGRTK, (q_BGRTK, k_BGTK, v_BGTK, out_BGRTK, probs)


def _causal_blocks_bwd(block, einsum, residuals, dout_BGRTK):
  """The softmax backward in the form flash kernels use: dS = P * (dP - rowsum(dO * O)), a sum over the K head
  dimensions per query instead of autodiff's rowsum(dP * P) over every key. Masked keys have P = 0 (no row is
  fully masked), so their scores get no gradient without a second pass over the mask."""
  q_BGRTK, k_BGTK, v_BGTK, out_BGRTK, probs = residuals
  row_BGRT1 = jnp.sum(dout_BGRTK.astype(jnp.float32) * out_BGRTK.astype(jnp.float32), axis=-1, keepdims=True)
  dk_BGTK = jnp.zeros(k_BGTK.shape, jnp.float32)
  dv_BGTK = jnp.zeros(v_BGTK.shape, jnp.float32)
  dqs = []
  for (start, end), probs_BGRQS in zip(_query_blocks(q_BGRTK.shape[3], block), probs):
    dout_BGRQK = dout_BGRTK[:, :, :, start:end]
    dv_BGTK = dv_BGTK.at[:, :, :end].add(
        einsum("bgrqs,bgrqk->bgsk", probs_BGRQS, dout_BGRQK, preferred_element_type=jnp.float32))
    dprobs_BGRQS = einsum("bgrqk,bgsk->bgrqs", dout_BGRQK, v_BGTK[:, :, :end],
                                 preferred_element_type=jnp.float32)
    dscores_BGRQS = (probs_BGRQS * (dprobs_BGRQS - row_BGRT1[:, :, :, start:end])).astype(q_BGRTK.dtype)
    dqs.append(einsum("bgrqs,bgsk->bgrqk", dscores_BGRQS, k_BGTK[:, :, :end]))
    dk_BGTK = dk_BGTK.at[:, :, :end].add(einsum("bgrqs,bgrqk->bgsk", dscores_BGRQS,
                                                       q_BGRTK[:, :, :, start:end], preferred_element_type=jnp.float32))
  dq_BGRTK = jnp.concatenate(dqs, axis=3).astype(q_BGRTK.dtype)
  return dq_BGRTK, dk_BGTK.astype(k_BGTK.dtype), dv_BGTK.astype(v_BGTK.dtype), None


_causal_blocks.defvjp(_causal_blocks_fwd, _causal_blocks_bwd)


def _attention_scores(q_BGRTK, k_BGSK, mask_BTS):
  scale = 1 / math.sqrt(q_BGRTK.shape[-1])
  scores = jnp.einsum("bgrtk,bgsk->bgrts", q_BGRTK, k_BGSK, preferred_element_type=jnp.float32) * scale
  return jnp.where(mask_BTS[:, None, None], scores, MASK_VALUE)


@jax.custom_vjp
def _recompute_attention(q_BGRTK, k_BGSK, v_BGSK, mask_BTS):
  return _recompute_attention_fwd(q_BGRTK, k_BGSK, v_BGSK, mask_BTS)[0]


def _probabilities(scores, max_BGRT, log_sum_BGRT):
  # exp(s - max - log_sum), not exp(s - logsumexp): a fully masked row has max = MASK_VALUE, where adding the
  # log-sum to it would round away and the row would no longer sum to one.
  return jnp.exp(scores - max_BGRT[..., None] - log_sum_BGRT[..., None])


def _recompute_attention_fwd(q_BGRTK, k_BGSK, v_BGSK, mask_BTS):
  scores = _attention_scores(q_BGRTK, k_BGSK, mask_BTS)
  max_BGRT = jnp.max(scores, axis=-1)
  log_sum_BGRT = jnp.log(jnp.sum(jnp.exp(scores - max_BGRT[..., None]), axis=-1))
  probs = _probabilities(scores, max_BGRT, log_sum_BGRT).astype(v_BGSK.dtype)
  out_BGRTK = jnp.einsum("bgrts,bgsk->bgrtk", probs, v_BGSK)
  return out_BGRTK, (q_BGRTK, k_BGSK, v_BGSK, mask_BTS, out_BGRTK, max_BGRT, log_sum_BGRT)


def _recompute_attention_bwd(residuals, dout_BGRTK):
  q, k, v, mask_BTS, out, max_BGRT, log_sum_BGRT = residuals
  probs = _probabilities(_attention_scores(q, k, mask_BTS), max_BGRT, log_sum_BGRT)  # f32, rebuilt
  dv = jnp.einsum("bgrts,bgrtk->bgsk", probs.astype(v.dtype), dout_BGRTK)
  dprobs = jnp.einsum("bgrtk,bgsk->bgrts", dout_BGRTK, v, preferred_element_type=jnp.float32)
  row = jnp.sum(dout_BGRTK.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)
  dscores = probs * (dprobs - row) / math.sqrt(q.shape[-1])
  dscores = jnp.where(mask_BTS[:, None, None], dscores, 0.0).astype(q.dtype)  # masked scores were constants
  dq = jnp.einsum("bgrts,bgsk->bgrtk", dscores, k)
  dk = jnp.einsum("bgrts,bgrtk->bgsk", dscores, q)
  return dq, dk, dv, None


_recompute_attention.defvjp(_recompute_attention_fwd, _recompute_attention_bwd)


def recompute_attention(q_BTHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, mask_BTS: jax.Array) -> jax.Array:
  """`dot_product_attention` that keeps for the backward pass only q, k, v, the output and the softmax's row max
  and log-sum per query (2 x [B, H, T] f32), and rebuilds the probabilities from them there: what cuDNN's flash
  kernel saves (its log-sum-exp), instead of the [B, H, T, S] probabilities per layer. Written here because
  jax.nn.dot_product_attention's XLA path saves the probabilities and its cuDNN path needs a GPU: this runs
  everywhere, and it is what the planner traces for `cudnn` where there is no cuDNN. Costs one more [T, S] matmul
  per layer in the backward pass; the forward still forms the whole [T, S] block, so it saves memory across
  layers, not within one."""
  b, t, h, kd = q_BTHK.shape
  g = k_BSGK.shape[2]
  q_BGRTK = q_BTHK.reshape(b, t, g, h // g, kd).transpose(0, 2, 3, 1, 4)
  out_BGRTK = _recompute_attention(q_BGRTK, k_BSGK.transpose(0, 2, 1, 3), v_BSGK.transpose(0, 2, 1, 3), mask_BTS)
  return out_BGRTK.transpose(0, 3, 1, 2, 4).reshape(b, t, h, kd)


def library_attention(q_BTHK: jax.Array, k_BSGK: jax.Array, v_BSGK: jax.Array, mask_BTS: jax.Array | None,
                      causal: bool = False, implementation: str = "xla") -> jax.Array:
  """`dot_product_attention` through jax.nn.dot_product_attention (`implementation`: its XLA path, or cuDNN's flash
  kernel on GPUs). The full [B, T, S] mask (causal and document boundaries) is passed unless it is None, so packed
  documents stay apart on every path (cuDNN takes it as an additive bias). `causal` (the mask already hides every
  later key) also tells the kernel, which then skips the blocks above the diagonal. `mask_BTS=None` with `causal`:
  plain causal attention with no mask tensor (cuDNN would otherwise compute the gradient of the bias it makes)."""
  mask = None if mask_BTS is None else mask_BTS[:, None]
  return jax.nn.dot_product_attention(q_BTHK, k_BSGK, v_BSGK, mask=mask, is_causal=causal,
                                      implementation=implementation)
