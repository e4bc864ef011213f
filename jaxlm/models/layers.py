"""Transformer layers shared by every model: embeddings, norms, rotary positions, attention (with a KV cache), MLPs.
The masks are in masks.py; the computations behind every op are jaxlm.kernels'.

Dimension alphabet used in names and comments:
  B batch   T query positions   S key positions (cache slots)   D d_model   H query heads   G key/value heads
  R query heads per key/value head (H = G * R)   K head dim   k half the head dim (rotary pairs)   F MLP width
  V vocab   L layers

We write these few layers ourselves instead of using `nnx.Linear` & co. because each parameter must carry its
logical axis names (`axes=` metadata, read by `jaxlm.parallel.sharding`), each matmul must follow the precision policy
(f32 params cast to the compute dtype; softmax, norms and logits in f32), and every op goes through the kernel
registry (`kernels`, a resolved `jaxlm.kernels.Kernels`). Parameters are read with `p[...]`.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.kernels import Kernels, weights
from jaxlm.kernels.registry import REMAT_POLICIES
from jaxlm.models.precision import Policy
from jaxlm.parallel.sharding import constrain, gather_fsdp


def _lead(v: jax.Array, ndim: int) -> jax.Array:
  """Adds leading unit axes so `v` broadcasts against an array of rank `ndim` without implicit rank promotion."""
  return v.reshape((1,) * (ndim - v.ndim) + v.shape)


def _normal(rngs: nnx.Rngs, shape: tuple[int, ...], std: float, dtype) -> jax.Array:
  # Drawn flat and reshaped: the same values (threefry is partitionable, so bits follow the linear index), but XLA
  # on the CPU compiles a 3-D normal sampler much more slowly than a 1-D one.
  return std * jax.random.normal(rngs.params(), (math.prod(shape),), dtype).reshape(shape)


class Embed(nnx.Module):
  """A lookup table [N, D]; `attend` reuses it as the output projection (tied embeddings)."""

  def __init__(self, num: int, dim: int, axes: tuple[str | None, str], policy: Policy, kernels: Kernels,
               std: float, *, rngs: nnx.Rngs):
    self.policy = policy
    self.kernels = kernels
    self.embedding = nnx.Param(_normal(rngs, (num, dim), std, policy.param_dtype), axes=axes)

  def __call__(self, ids_BT: jax.Array) -> jax.Array:
    table_ND = gather_fsdp(self.embedding)[...]  # FSDP: gather the table rather than reshard the activations
    return self.policy.cast_to_compute(self.kernels.lookup(table_ND, ids_BT))  # [B, T, D]

  def attend(self, x_BTD: jax.Array) -> jax.Array:
    table_VD = self.policy.cast_to_compute(gather_fsdp(self.embedding)[...])
    # f32 accumulation and output: the logits feed a softmax over the whole vocabulary.
    return self.kernels.einsum("btd,vd->btv", self.policy.cast_to_compute(x_BTD), table_VD,
                               preferred_element_type=jnp.float32)  # [B, T, V]


class Dense(nnx.Module):
  """y = x @ w (+ b) over the last axis; `axes` names [in, out] (heads and poolers of BERT)."""

  def __init__(self, d_in: int, d_out: int, axes: tuple[str | None, str | None], policy: Policy, kernels: Kernels,
               std: float, *, use_bias: bool = True, rngs: nnx.Rngs):
    self.policy = policy
    self.kernels = kernels
    self.w = nnx.Param(_normal(rngs, (d_in, d_out), std, policy.param_dtype), axes=axes)
    self.b = nnx.Param(jnp.zeros((d_out,), policy.param_dtype), axes=axes[1:]) if use_bias else None

  def __call__(self, x: jax.Array) -> jax.Array:
    c = self.policy.cast_to_compute
    y = self.kernels.einsum("...i,io->...o", c(x), c(self.w[...]))
    return y if self.b is None else y + _lead(c(self.b[...]), x.ndim)


class LayerNorm(nnx.Module):
  """LayerNorm with statistics in f32, output in the compute dtype; `use_bias=False`: no bias (ModernBERT)."""

  def __init__(self, dim: int, eps: float, policy: Policy, kernels: Kernels, *, use_bias: bool = True):
    self.policy = policy
    self.kernels = kernels
    self.eps = eps
    self.scale = nnx.Param(jnp.ones((dim,), policy.param_dtype), axes=("embed",))
    self.bias = nnx.Param(jnp.zeros((dim,), policy.param_dtype), axes=("embed",)) if use_bias else None

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    bias = jnp.zeros_like(self.scale[...]) if self.bias is None else self.bias[...]
    return self.policy.cast_to_compute(self.kernels.layer_norm(x_BTD, self.scale[...], bias, self.eps))


class RMSNorm(nnx.Module):
  """RMSNorm (Llama): no mean subtraction and no bias; statistics in f32. `plus_one` (Gemma): the weight w is
  stored as HF stores it and scales by (1 + w), so it starts at zero."""

  def __init__(self, dim: int, eps: float, policy: Policy, kernels: Kernels, plus_one: bool = False):
    self.policy = policy
    self.kernels = kernels
    self.eps = eps
    self.plus_one = plus_one
    self.scale = nnx.Param((jnp.zeros if plus_one else jnp.ones)((dim,), policy.param_dtype), axes=("embed",))

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    return self.policy.cast_to_compute(self.kernels.rms_norm(x_BTD, norm_scale(self.scale[...], self.plus_one),
                                                             self.eps))


def norm_scale(w: jax.Array, plus_one: bool) -> jax.Array:
  """What an RMSNorm multiplies by: its weight, or (1 + weight) in f32 for Gemma's norms."""
  return 1.0 + w.astype(jnp.float32) if plus_one else w


# ----------------------------------------------------------------------------------------------- positions


class Rotary(NamedTuple):
  """cos and sin of every rotary angle, [B, T, K/2] in f32: computed once per forward pass and shared by every layer
  (as HF does), so XLA does not fuse their evaluation into each layer's rotation, per head and element."""
  cos_BTk: jax.Array
  sin_BTk: jax.Array


def rotary_frequencies(head_dim: int, theta: float, scaling: str = "", factor: float = 1.0,
                       low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
                       original_max_positions: int = 8192, beta_fast: float = 32.0,
                       beta_slow: float = 1.0) -> np.ndarray:
  """The K/2 rotary frequencies (f32), stretched for longer contexts as `scaling` says: `linear` divides them all
  by `factor`; `llama3` (Llama 3.1) divides those whose wavelength exceeds original_max_positions /
  low_freq_factor, keeps those below original_max_positions / high_freq_factor, and blends linearly between; `yarn`
  keeps the dimensions that turn more than beta_fast times over original_max_positions, divides those that turn
  fewer than beta_slow times, and ramps linearly between (HF's truncated correction range). `dynamic` depends on
  the positions (`dynamic_frequencies`): here it gives the unscaled ones."""
  half = head_dim // 2
  inv_freq = 1.0 / theta ** (np.arange(0, 2 * half, 2, dtype=np.float64) / (2 * half))
  if scaling == "linear":
    inv_freq = inv_freq / factor
  elif scaling == "llama3":
    wavelength = 2 * np.pi / inv_freq
    blend = (original_max_positions / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - blend) * inv_freq / factor + blend * inv_freq
    low = wavelength > original_max_positions / low_freq_factor
    high = wavelength < original_max_positions / high_freq_factor
    inv_freq = np.where(low, inv_freq / factor, np.where(high, inv_freq, blended))
  elif scaling == "yarn":
    def dimension(rotations):  # the dimension that turns `rotations` times over the original context
      return head_dim * math.log(original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = max(math.floor(dimension(beta_fast)), 0), min(math.ceil(dimension(beta_slow)), head_dim - 1)
    ramp = np.clip((np.arange(half) - low) / ((high - low) or 0.001), 0, 1)
    inv_freq = inv_freq / factor * ramp + inv_freq * (1 - ramp)
  return inv_freq.astype(np.float32)


def yarn_attention_factor(factor: float, attention_factor: float = 0.0) -> float:
  """YaRN's scale of cos and sin: the given one, else 0.1 ln(factor) + 1 (1 when factor <= 1)."""
  return attention_factor or (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)


def dynamic_frequencies(positions_BT: jax.Array, head_dim: int, theta: float, factor: float,
                        max_positions: int) -> jax.Array:
  """Dynamic NTK scaling (HF's `dynamic`): past max_positions, the base grows with the longest position seen,
  theta * (factor * n / max_positions - (factor - 1)) ** (K / (K - 2)) for n = max(positions) + 1; below it the
  frequencies are the unscaled ones."""
  n = jnp.maximum(jnp.max(positions_BT) + 1, max_positions).astype(jnp.float32)
  base = theta * (factor * n / max_positions - (factor - 1)) ** (head_dim / (head_dim - 2))
  return 1.0 / base ** (jnp.arange(0, head_dim - 1, 2, dtype=jnp.float32) / head_dim)


def rotary_tables(positions_BT: jax.Array, head_dim: int, theta: float, inv_freq=None,
                  scale: float = 1.0) -> Rotary:
  """The Rotary tables of `positions` (each row its own, e.g. restarting at every packed document's start);
  `inv_freq` (`rotary_frequencies`) defaults to the unscaled frequencies of `theta`; `scale` multiplies cos and sin
  (YaRN)."""
  if inv_freq is None:
    inv_freq = rotary_frequencies(head_dim, theta)
  angles_BTk = positions_BT.astype(jnp.float32)[:, :, None] * _lead(jnp.asarray(inv_freq), 3)
  if scale != 1.0:
    return Rotary(jnp.cos(angles_BTk) * scale, jnp.sin(angles_BTk) * scale)
  return Rotary(jnp.cos(angles_BTk), jnp.sin(angles_BTk))


def apply_rope(x_BTHK: jax.Array, rotary: Rotary) -> jax.Array:
  """Rotary position embedding, HF's rotate_half convention: dims i and i + K/2 form one rotated pair."""
  half = x_BTHK.shape[-1] // 2
  cos, sin = rotary.cos_BTk[:, :, None, :], rotary.sin_BTk[:, :, None, :]  # [B, T, 1, K/2]
  x = x_BTHK.astype(jnp.float32)
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTHK.dtype)


# ----------------------------------------------------------------------------------------------- attention


class LayerKV(NamedTuple):
  """One layer's slice of a KVCache (what `Attention.decode` reads and writes); the scales are None in a float
  cache."""
  k_BSGK: jax.Array
  v_BSGK: jax.Array
  k_scale_BSG: jax.Array | None = None
  v_scale_BSG: jax.Array | None = None


class KVCache(NamedTuple):
  """Keys and values of every layer for S slots; `end` slots are filled. A pytree, so it passes through jit/scan.

  An int8 cache (`zeros(..., quantized=True)`) stores each key and value vector as int8 with one f32 absmax scale
  per (layer, row, slot, KV head): a token is quantized once, when it is written, without calibration, and a later
  outlier never forces earlier slots to be re-scaled (as one scale shared over slots or heads would)."""
  k_LBSGK: jax.Array
  v_LBSGK: jax.Array
  segment_ids_BS: jax.Array  # document of each slot (0 = padding or empty): keeps packed documents apart
  end: jax.Array  # int32 []: slots filled so far (the same for every row: prompts are left-padded)
  k_scale_LBSG: jax.Array | None = None  # int8 cache only: the dequantized key is k * scale
  v_scale_LBSG: jax.Array | None = None

  @classmethod
  def zeros(cls, num_layers: int, batch: int, slots: int, kv_heads: int, head_dim: int, dtype,
            quantized: bool = False) -> "KVCache":
    kv = jnp.zeros((num_layers, batch, slots, kv_heads, head_dim), jnp.int8 if quantized else dtype)
    kv = constrain(kv, (None, "act_batch", None, "act_kv_heads", None))
    scale = None
    if quantized:
      scale = constrain(jnp.ones((num_layers, batch, slots, kv_heads), jnp.float32),
                        (None, "act_batch", None, "act_kv_heads"))
    return cls(kv, kv, jnp.zeros((batch, slots), jnp.int32), jnp.zeros((), jnp.int32), scale, scale)

  def layers(self) -> LayerKV:
    """Every layer's keys and values, stacked along a leading [L] axis (the `xs` of the layer scan)."""
    return LayerKV(self.k_LBSGK, self.v_LBSGK, self.k_scale_LBSG, self.v_scale_LBSG)


def quantize_kv(x_BTGK: jax.Array) -> tuple[jax.Array, jax.Array]:
  """Symmetric int8 per (row, position, head) over the head dim: (int8 values, f32 scale [B, T, G])."""
  x = x_BTGK.astype(jnp.float32)
  absmax_BTG = jnp.max(jnp.abs(x), axis=-1)
  scale_BTG = jnp.where(absmax_BTG > 0, absmax_BTG / 127.0, 1.0)
  return jnp.clip(jnp.round(x / scale_BTG[..., None]), -127, 127).astype(jnp.int8), scale_BTG


def _write_kv(kv: LayerKV, k_BTGK: jax.Array, v_BTGK: jax.Array, end: jax.Array) -> LayerKV:
  def put(cache, new):  # at slot `end` of every row, all heads
    zero = jnp.zeros((), jnp.int32)
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), (zero, end) + (zero,) * (cache.ndim - 2))

  if kv.k_scale_BSG is None:
    return LayerKV(put(kv.k_BSGK, k_BTGK), put(kv.v_BSGK, v_BTGK))
  (k_q, k_scale), (v_q, v_scale) = quantize_kv(k_BTGK), quantize_kv(v_BTGK)
  return LayerKV(put(kv.k_BSGK, k_q), put(kv.v_BSGK, v_q), put(kv.k_scale_BSG, k_scale),
                 put(kv.v_scale_BSG, v_scale))


def rolling_slots(end: jax.Array, t: int, s: int) -> tuple[int, jax.Array]:
  """For T tokens written from time `end` into a rolling cache of S slots: (how many of the last ones are kept,
  their slots)."""
  kept = min(t, s)
  return kept, (end + t - kept + jnp.arange(kept)) % s


def _write_rolling(kv: LayerKV, k_BTGK: jax.Array, v_BTGK: jax.Array, end: jax.Array) -> LayerKV:
  kept, slots = rolling_slots(end, k_BTGK.shape[1], kv.k_BSGK.shape[1])
  put = lambda cache, new: cache.at[:, slots].set(new[:, -kept:].astype(cache.dtype))
  if kv.k_scale_BSG is None:
    return LayerKV(put(kv.k_BSGK, k_BTGK), put(kv.v_BSGK, v_BTGK))
  (k_q, k_scale), (v_q, v_scale) = quantize_kv(k_BTGK), quantize_kv(v_BTGK)
  return LayerKV(put(kv.k_BSGK, k_q), put(kv.v_BSGK, v_q), put(kv.k_scale_BSG, k_scale),
                 put(kv.v_scale_BSG, v_scale))


def _read_kv(kv: LayerKV, dtype) -> tuple[jax.Array, jax.Array]:
  if kv.k_scale_BSG is None:
    return kv.k_BSGK, kv.v_BSGK
  dequantize = lambda q, scale: (q.astype(jnp.float32) * scale[..., None]).astype(dtype)
  return dequantize(kv.k_BSGK, kv.k_scale_BSG), dequantize(kv.v_BSGK, kv.v_scale_BSG)


class Attention(nnx.Module):
  """Self-attention with H query heads and G key/value heads (grouped-query when G < H); heads are the
  tensor-parallel dimension. Optional biases (GPT-2, BERT) and rotary positions (Llama); the mask decides causal
  or bidirectional. `kernels` picks the attention implementation and whether q, k, v come from one matmul."""

  def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, policy: Policy, kernels: Kernels, std: float,
               out_std: float, *, use_bias: bool = True, causal: bool = False, document_mask: bool = True,
               head_dim: int = 0, qk_norm: str = "", norm_eps: float = 1e-6, qkv_bias: bool | None = None,
               norm_plus_one: bool = False, softcap: float = 0.0, query_pre_attn_scalar: float = 0.0,
               rngs: nnx.Rngs):
    if num_heads % num_kv_heads:
      raise ValueError(f"num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads}")
    self.policy = policy
    self.kernels = kernels
    self.causal = causal  # the caller's mask hides every later key (decoders); enables causal-only kernels
    self.document_mask = document_mask  # False (decoders): the mask is plain causal, library kernels get none
    h, g, k, dt = num_heads, num_kv_heads, head_dim or d_model // num_heads, policy.param_dtype
    self.softcap = softcap  # scores squashed to softcap * tanh(s / softcap) (Gemma 2)
    # The kernels scale scores by K^-1/2; Gemma scales by query_pre_attn_scalar^-1/2: q takes the ratio.
    self.query_scale = math.sqrt(k / query_pre_attn_scalar) if query_pre_attn_scalar else 1.0
    self.w_q = nnx.Param(_normal(rngs, (d_model, h, k), std, dt), axes=("embed", "heads", "head_dim"))
    self.w_k = nnx.Param(_normal(rngs, (d_model, g, k), std, dt), axes=("embed", "kv_heads", "head_dim"))
    self.w_v = nnx.Param(_normal(rngs, (d_model, g, k), std, dt), axes=("embed", "kv_heads", "head_dim"))
    self.w_o = nnx.Param(_normal(rngs, (h, k, d_model), out_std, dt), axes=("heads", "head_dim", "embed"))
    # Biases on q, k and v follow `use_bias` unless `qkv_bias` says otherwise (Qwen2: on q, k, v, none on the output).
    if use_bias if qkv_bias is None else qkv_bias:
      self.b_q = nnx.Param(jnp.zeros((h, k), dt), axes=("heads", "head_dim"))
      self.b_k = nnx.Param(jnp.zeros((g, k), dt), axes=("kv_heads", "head_dim"))
      self.b_v = nnx.Param(jnp.zeros((g, k), dt), axes=("kv_heads", "head_dim"))
    else:
      self.b_q = self.b_k = self.b_v = None
    self.b_o = nnx.Param(jnp.zeros((d_model,), dt), axes=("embed",)) if use_bias else None
    # Query/key RMSNorm after the projections: one scale per head dimension shared by the heads (`head`), or one per
    # element of all heads together (`full`).
    self.norm_eps = norm_eps
    self.norm_plus_one = norm_plus_one
    init = jnp.zeros if norm_plus_one else jnp.ones
    if qk_norm == "head":
      self.q_norm = nnx.Param(init((k,), dt), axes=("head_dim",))
      self.k_norm = nnx.Param(init((k,), dt), axes=("head_dim",))
    elif qk_norm == "full":
      self.q_norm = nnx.Param(init((h, k), dt), axes=("heads", "head_dim"))
      self.k_norm = nnx.Param(init((g, k), dt), axes=("kv_heads", "head_dim"))
    else:
      self.q_norm = self.k_norm = None

  def _normed(self, x_BTNK: jax.Array, scale: nnx.Param) -> jax.Array:
    b, t, n, k = x_BTNK.shape
    w = norm_scale(scale[...], self.norm_plus_one)
    if scale.ndim == 1:
      return self.policy.cast_to_compute(self.kernels.rms_norm(x_BTNK, w, self.norm_eps))
    normed = self.kernels.rms_norm(x_BTNK.reshape(b, t, n * k), w.reshape(n * k), self.norm_eps)
    return self.policy.cast_to_compute(normed.reshape(b, t, n, k))

  def _project(self, x_BTD: jax.Array, w: nnx.Param, b: nnx.Param | None, heads_axis: str) -> jax.Array:
    c = self.policy.cast_to_compute
    y = self.kernels.einsum("btd,dhk->bthk", x_BTD, c(w[...]))
    if b is not None:
      y = y + _lead(c(b[...]), 4)
    return constrain(y, ("act_batch", "act_seq", heads_axis, None))  # [B, T, H or G, K]

  def _qkv(self, x_BTD: jax.Array, rotary: Rotary | None):
    fused = None
    if self.kernels.fuse_qkv == "fused":
      c = self.policy.cast_to_compute
      fused = weights.concatenate([c(self.w_q[...]), c(self.w_k[...]), c(self.w_v[...])], axis=1)  # N = H + 2G
    if fused is not None:
      q, k, v = self._fused_project(x_BTD, fused)
    else:  # kernels.fuse_qkv=separate, or weights whose kind cannot be joined (int8)
      q = self._project(x_BTD, self.w_q, self.b_q, "act_heads")
      k = self._project(x_BTD, self.w_k, self.b_k, "act_kv_heads")
      v = self._project(x_BTD, self.w_v, self.b_v, "act_kv_heads")
    if self.q_norm is not None:
      q, k = self._normed(q, self.q_norm), self._normed(k, self.k_norm)
    if rotary is not None:
      q, k = apply_rope(q, rotary), apply_rope(k, rotary)
    if self.query_scale != 1.0:
      q = q * jnp.asarray(self.query_scale, q.dtype)
    return q, k, v

  def _fused_project(self, x_BTD: jax.Array, w_DNK) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v from ONE matmul with the three weights concatenated along heads (the parameters stay separate): one
    large matmul runs nearer the machine's peak than three narrow ones, and the backward pass gets one dX and one dW
    matmul instead of three each."""
    c = self.policy.cast_to_compute
    h, g = self.w_q.shape[1], self.w_k.shape[1]
    y_BTNK = self.kernels.einsum("btd,dnk->btnk", x_BTD, w_DNK)
    if self.b_q is not None:
      y_BTNK = y_BTNK + _lead(jnp.concatenate([c(self.b_q[...]), c(self.b_k[...]), c(self.b_v[...])]), 4)
    q, k, v = y_BTNK[:, :, :h], y_BTNK[:, :, h:h + g], y_BTNK[:, :, h + g:]
    return (constrain(q, ("act_batch", "act_seq", "act_heads", None)),
            constrain(k, ("act_batch", "act_seq", "act_kv_heads", None)),
            constrain(v, ("act_batch", "act_seq", "act_kv_heads", None)))

  def _out(self, out_BTHK: jax.Array) -> jax.Array:
    c = self.policy.cast_to_compute
    y = self.kernels.einsum("bthk,hkd->btd", out_BTHK, c(self.w_o[...]))
    return y if self.b_o is None else y + _lead(c(self.b_o[...]), 3)

  def __call__(self, x_BTD: jax.Array, mask_BTS: jax.Array, rotary: Rotary | None = None) -> jax.Array:
    q, k, v = self._qkv(x_BTD, rotary)
    return self._out(self.kernels.attend(q, k, v, mask_BTS, causal=self.causal, document_mask=self.document_mask,
                                         softcap=self.softcap))

  def decode(self, x_BTD: jax.Array, mask_BTS: jax.Array, rotary: Rotary | None, kv: LayerKV,
             end: jax.Array) -> tuple[jax.Array, LayerKV]:
    """Writes the T new keys/values at cache slots end..end+T-1 (quantized first in an int8 cache), attends over the
    whole cache (the mask hides the empty slots), and returns (output, updated layer cache)."""
    q, k, v = self._qkv(x_BTD, rotary)
    kv = _write_kv(kv, k, v, end)
    k_BSGK, v_BSGK = _read_kv(kv, q.dtype)
    # The reference kernel: the cache has more slots than queries, which the causal-block kernels do not take.
    return self._out(self.kernels.attend_reference(q, k_BSGK, v_BSGK, mask_BTS, self.softcap)), kv

  def decode_rolling(self, x_BTD: jax.Array, mask_BTU: jax.Array, rotary: Rotary | None, kv: LayerKV,
                     end: jax.Array) -> tuple[jax.Array, LayerKV]:
    """`decode` against a rolling cache of S slots (a sliding window): the T new tokens attend over the S cached
    ones and themselves (U = S + T keys; the mask keeps the window), then the last min(T, S) of them overwrite the
    slots of the oldest, slot (time mod S)."""
    q, k, v = self._qkv(x_BTD, rotary)
    cached_k, cached_v = _read_kv(kv, q.dtype)
    out = self.kernels.attend_reference(q, jnp.concatenate([cached_k, k.astype(q.dtype)], axis=1),
                                        jnp.concatenate([cached_v, v.astype(q.dtype)], axis=1), mask_BTU, self.softcap)
    return self._out(out), _write_rolling(kv, k, v, end)


# ----------------------------------------------------------------------------------------------- MLPs


class MLP(nnx.Module):
  """Two-layer GELU MLP with biases (GPT-2: tanh-approximate GELU; BERT: exact); F is tensor-parallel."""

  def __init__(self, d_model: int, d_ff: int, policy: Policy, kernels: Kernels, std: float, out_std: float, *,
               approximate_gelu: bool = True, rngs: nnx.Rngs):
    self.policy = policy
    self.kernels = kernels
    self.approximate_gelu = approximate_gelu
    dt = policy.param_dtype
    self.w_in = nnx.Param(_normal(rngs, (d_model, d_ff), std, dt), axes=("embed", "mlp"))
    self.b_in = nnx.Param(jnp.zeros((d_ff,), dt), axes=("mlp",))
    self.w_out = nnx.Param(_normal(rngs, (d_ff, d_model), out_std, dt), axes=("mlp", "embed"))
    self.b_out = nnx.Param(jnp.zeros((d_model,), dt), axes=("embed",))

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    c = self.policy.cast_to_compute
    h_BTF = self.kernels.einsum("btd,df->btf", x_BTD, c(self.w_in[...])) + _lead(c(self.b_in[...]), 3)
    h_BTF = constrain(jax.nn.gelu(h_BTF, approximate=self.approximate_gelu), ("act_batch", "act_seq", "act_mlp"))
    return self.kernels.einsum("btf,fd->btd", h_BTF, c(self.w_out[...])) + _lead(c(self.b_out[...]), 3)


class GatedMLP(nnx.Module):
  """Gated MLP: down(act(gate(x)) * up(x)), no biases; act is silu (SwiGLU: Llama) or tanh-GELU (GeGLU: Gemma); F
  is tensor-parallel."""

  def __init__(self, d_model: int, d_ff: int, policy: Policy, kernels: Kernels, std: float, out_std: float, *,
               activation: str = "silu", rngs: nnx.Rngs):
    self.policy = policy
    self.kernels = kernels
    self.activation = activation
    dt = policy.param_dtype
    self.w_gate = nnx.Param(_normal(rngs, (d_model, d_ff), std, dt), axes=("embed", "mlp"))
    self.w_up = nnx.Param(_normal(rngs, (d_model, d_ff), std, dt), axes=("embed", "mlp"))
    self.w_down = nnx.Param(_normal(rngs, (d_ff, d_model), out_std, dt), axes=("mlp", "embed"))

  def __call__(self, x_BTD: jax.Array) -> jax.Array:
    c = self.policy.cast_to_compute
    h_BTF = self.kernels.gated_linear_unit(x_BTD, c(self.w_gate[...]), c(self.w_up[...]), self.activation)
    h_BTF = constrain(h_BTF, ("act_batch", "act_seq", "act_mlp"))
    return self.kernels.einsum("btf,fd->btd", h_BTF, c(self.w_down[...]))


# ----------------------------------------------------------------------------------------------- layer stacks


def stacked(num_layers: int, make_block: Callable[[nnx.Rngs], nnx.Module], rngs: nnx.Rngs) -> nnx.Module:
  """`num_layers` blocks created at once: every parameter gets a leading [L] axis (sharding adds `layers`)."""

  @nnx.split_rngs(splits=num_layers)
  @nnx.vmap(in_axes=(0,), out_axes=0)
  def make(rngs: nnx.Rngs) -> nnx.Module:
    return make_block(rngs)

  return make(rngs)


def scan_blocks(blocks: nnx.Module, body: Callable, carry, kernels: Kernels, xs=None, remat: bool = True):
  """Runs `body(block, carry, xs_l) -> (carry, ys_l)` over the stacked blocks; `xs` (e.g. one KV cache per layer)
  is sliced along its leading [L] axis. `kernels.layers=scan`: one `jax.lax.scan` (compile time flat in depth;
  `scan_unroll` blocks per iteration). `loop`: a Python loop, where each layer's saved activations are buffers of
  their own instead of slices of stacked [L, ...] loop buffers. `kernels.remat` applies per block unless `remat`
  is False (decoding has no backward pass)."""
  block_def, block_params = nnx.split(blocks)

  def step(carry, params_and_xs):
    params, xs_l = params_and_xs
    return body(nnx.merge(block_def, gather_fsdp(params)), carry, xs_l)

  if remat and kernels.remat != "none":
    step = jax.checkpoint(step, policy=REMAT_POLICIES[kernels.remat], prevent_cse=False)
  if kernels.layers == "scan":
    return jax.lax.scan(step, carry, (block_params, xs), unroll=kernels.scan_unroll)
  num_layers = jax.tree.leaves(block_params)[0].shape[0]
  # One split per stacked array (its transpose is one concatenate of the layer gradients, not L padded adds).
  per_layer = jax.tree.map(lambda a: jnp.split(a, num_layers), (block_params, xs))
  ys = []
  for i in range(num_layers):
    carry, y = step(carry, jax.tree.map(lambda parts: parts[i][0], per_layer, is_leaf=lambda x: isinstance(x, list)))
    ys.append(y)
  return carry, jax.tree.map(lambda *layers: jnp.stack(layers), *ys)
