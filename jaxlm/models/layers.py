"""Transformer layers shared by every model: embeddings, LayerNorm, attention, MLP.

Dimension alphabet used in names and comments:
  B batch   T query positions   S key positions   D d_model   H heads   K head dim   F MLP width   V vocab
  L layers

We write these few layers ourselves instead of using `nnx.Linear` & co. because each parameter must carry its
logical axis names (`axes=` metadata, read by `jaxlm.sharding`) and each matmul must follow the precision policy
(f32 params cast to the compute dtype; softmax, norms and logits in f32). Parameters are read with `p[...]`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.precision import Policy
from jaxlm.sharding import constrain

# A large finite negative instead of -inf: a fully masked row then gives a uniform softmax rather than NaNs.
MASK_VALUE = -1e30


def _lead(v: jax.Array, ndim: int) -> jax.Array:
  """Adds leading unit axes so `v` broadcasts against an array of rank `ndim` without implicit rank promotion."""
  return v.reshape((1,) * (ndim - v.ndim) + v.shape)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype) -> jax.Array:
  return std * jax.random.normal(rngs.params(), shape, dtype)


class Embed(nnx.Module):
  """A lookup table [N, D]; `attend` reuses it as the output projection (tied embeddings)."""

  def __init__(self, num: int, dim: int, axes: tuple[str, str], policy: Policy, std: float, *, rngs: nnx.Rngs):
    self.policy = policy
    self.embedding = nnx.Param(_normal(rngs, (num, dim), std, policy.param_dtype), axes=axes)

  def __call__(self, ids_BT: jax.Array) -> jax.Array:
    return self.policy.cast_to_compute(jnp.take(self.embedding[...], ids_BT, axis=0))  # [B, T, D]

  def attend(self, x_BTD: jax.Array) -> jax.Array:
    table_VD = self.policy.cast_to_compute(self.embedding[...])
    # f32 accumulation and output: the logits feed a softmax over the whole vocabulary.
    return jnp.einsum("btd,vd->btv", self.policy.cast_to_compute(x_BTD), table_VD,
                      preferred_element_type=jnp.float32)  # [B, T, V]


class LayerNorm(nnx.Module):
  """LayerNorm with statistics in f32, output in the compute dtype."""

  def __init__(self, dim: int, eps: float, policy: Policy):
    self.policy = policy
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), policy.param_dtype), axes=("embed",))
    self.bias = nnx.Param(jnp.zeros((dim,), policy.param_dtype), axes=("embed",))

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    x = x_BTD.astype(jnp.float32)
    mean = x.mean(axis=-1, keepdims=True)
    var = jnp.square(x - mean).mean(axis=-1, keepdims=True)
    y = (x - mean) * jax.lax.rsqrt(var + self.eps)
    y = y * _lead(self.scale[...].astype(jnp.float32), y.ndim) + _lead(self.bias[...].astype(jnp.float32), y.ndim)
    return self.policy.cast_to_compute(y)


def attention_mask(segment_ids_BT: jax.Array) -> jax.Array:
  """[B, 1, T, S] bool: causal, and only within the same packed document (segment 0 is padding)."""
  t = segment_ids_BT.shape[1]
  causal_TS = jnp.tril(jnp.ones((t, t), dtype=bool))
  same_doc_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
  return (causal_TS[None] & same_doc_BTS)[:, None]


class Attention(nnx.Module):
  """Multi-head causal self-attention; heads are the tensor-parallel dimension."""

  def __init__(self, d_model: int, num_heads: int, policy: Policy, std: float, out_std: float, *,
               rngs: nnx.Rngs):
    self.policy = policy
    head_dim = d_model // num_heads
    dt = policy.param_dtype
    qkv_axes = ("embed", "heads", "head_dim")
    self.w_q = nnx.Param(_normal(rngs, (d_model, num_heads, head_dim), std, dt), axes=qkv_axes)
    self.w_k = nnx.Param(_normal(rngs, (d_model, num_heads, head_dim), std, dt), axes=qkv_axes)
    self.w_v = nnx.Param(_normal(rngs, (d_model, num_heads, head_dim), std, dt), axes=qkv_axes)
    self.b_q = nnx.Param(jnp.zeros((num_heads, head_dim), dt), axes=("heads", "head_dim"))
    self.b_k = nnx.Param(jnp.zeros((num_heads, head_dim), dt), axes=("heads", "head_dim"))
    self.b_v = nnx.Param(jnp.zeros((num_heads, head_dim), dt), axes=("heads", "head_dim"))
    self.w_o = nnx.Param(_normal(rngs, (num_heads, head_dim, d_model), out_std, dt),
                         axes=("heads", "head_dim", "embed"))
    self.b_o = nnx.Param(jnp.zeros((d_model,), dt), axes=("embed",))

  def _project(self, x_BTD: jax.Array, w: nnx.Param, b: nnx.Param) -> jax.Array:
    c = self.policy.cast_to_compute
    y = jnp.einsum("btd,dhk->bthk", x_BTD, c(w[...])) + _lead(c(b[...]), 4)
    return constrain(y, ("act_batch", "act_seq", "act_heads", None))  # [B, T, H, K]

  def __call__(self, x_BTD: jax.Array, mask_B1TS: jax.Array) -> jax.Array:
    c = self.policy.cast_to_compute
    q = self._project(x_BTD, self.w_q, self.b_q)
    k = self._project(x_BTD, self.w_k, self.b_k)
    v = self._project(x_BTD, self.w_v, self.b_v)
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores_BHTS = jnp.einsum("bthk,bshk->bhts", q, k, preferred_element_type=jnp.float32) * scale
    scores_BHTS = jnp.where(mask_B1TS, scores_BHTS, MASK_VALUE)
    probs_BHTS = c(jax.nn.softmax(scores_BHTS, axis=-1))  # softmax in f32, then back to compute dtype
    out_BTHK = jnp.einsum("bhts,bshk->bthk", probs_BHTS, v)
    return jnp.einsum("bthk,hkd->btd", out_BTHK, c(self.w_o[...])) + _lead(c(self.b_o[...]), 3)


class MLP(nnx.Module):
  """Two-layer GELU MLP; the hidden width F is the tensor-parallel dimension."""

  def __init__(self, d_model: int, d_ff: int, policy: Policy, std: float, out_std: float, *, rngs: nnx.Rngs):
    self.policy = policy
    dt = policy.param_dtype
    self.w_in = nnx.Param(_normal(rngs, (d_model, d_ff), std, dt), axes=("embed", "mlp"))
    self.b_in = nnx.Param(jnp.zeros((d_ff,), dt), axes=("mlp",))
    self.w_out = nnx.Param(_normal(rngs, (d_ff, d_model), out_std, dt), axes=("mlp", "embed"))
    self.b_out = nnx.Param(jnp.zeros((d_model,), dt), axes=("embed",))

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    c = self.policy.cast_to_compute
    h_BTF = jnp.einsum("btd,df->btf", x_BTD, c(self.w_in[...])) + _lead(c(self.b_in[...]), 3)
    h_BTF = constrain(jax.nn.gelu(h_BTF, approximate=True), ("act_batch", "act_seq", "act_mlp"))
    return jnp.einsum("btf,fd->btd", h_BTF, c(self.w_out[...])) + _lead(c(self.b_out[...]), 3)
