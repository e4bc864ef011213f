"""The portable reference implementations (XLA on every platform) of the ops without a module of their own: the weight
matmul, the norms, the gated linear unit and the cross-entropy from full logits. Every other implementation in the
registry is tested equal to these."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax


def _lead(v: jax.Array, ndim: int) -> jax.Array:
  """Adds leading unit axes so `v` broadcasts against an array of rank `ndim` without implicit rank promotion."""
  return v.reshape((1,) * (ndim - v.ndim) + v.shape)


def einsum(subscripts: str, x: jax.Array, w: jax.Array, **kwargs) -> jax.Array:
  return jnp.einsum(subscripts, x, w, **kwargs)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
  """(x - mean) / sqrt(var + eps) * scale + bias over the last axis, statistics and result in f32."""
  x = x.astype(jnp.float32)
  mean = x.mean(axis=-1, keepdims=True)
  var = jnp.square(x - mean).mean(axis=-1, keepdims=True)
  y = (x - mean) * jax.lax.rsqrt(var + eps)
  return y * _lead(scale.astype(jnp.float32), y.ndim) + _lead(bias.astype(jnp.float32), y.ndim)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
  """x / sqrt(mean(x^2) + eps) * scale over the last axis (no mean subtraction, no bias), in f32."""
  x = x.astype(jnp.float32)
  y = x * jax.lax.rsqrt(jnp.square(x).mean(axis=-1, keepdims=True) + eps)
  return y * _lead(scale.astype(jnp.float32), y.ndim)


GLU_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
                   "gelu": lambda x: jax.nn.gelu(x, approximate=False)}  # exact GELU: ModernBERT's GeGLU


def glu(x_BTD: jax.Array, w_gate_DF: jax.Array, w_up_DF: jax.Array, matmul=einsum, activation: str = "silu"
        ) -> jax.Array:
  """act(x @ w_gate) * (x @ w_up) in the compute dtype (silu: SwiGLU, gelu_tanh: GeGLU); `matmul` is the registry's
  weight einsum."""
  gate_BTF = matmul("btd,df->btf", x_BTD, w_gate_DF)
  up_BTF = matmul("btd,df->btf", x_BTD, w_up_DF)
  return GLU_ACTIVATIONS[activation](gate_BTF) * up_BTF


def softcap(x: jax.Array, cap: float) -> jax.Array:
  """cap * tanh(x / cap): scores or logits squashed into (-cap, cap) (Gemma 2); cap 0 leaves x as it is."""
  return cap * jnp.tanh(x / cap) if cap else x


def cross_entropy_sums(x_ND: jax.Array, table_VD: jax.Array, targets_N: jax.Array, weights_N: jax.Array,
                       matmul=einsum, logit_softcap: float = 0.0) -> tuple[jax.Array, jax.Array]:
  """The reference: [N, V] f32 logits (soft-capped if `logit_softcap`), then optax's cross-entropy; (weighted loss
  sum, weighted correct count)."""
  logits_NV = softcap(matmul("nd,vd->nv", x_ND, table_VD, preferred_element_type=jnp.float32), logit_softcap)
  losses_N = optax.softmax_cross_entropy_with_integer_labels(logits_NV, targets_N)
  # argmax, not "target logit == max": on a tie (e.g. a zero head) that would count every tied token correct.
  correct_N = (jnp.argmax(logits_NV, axis=-1) == targets_N).astype(jnp.float32)
  return jnp.sum(losses_N * weights_N), jnp.sum(correct_N * weights_N)
