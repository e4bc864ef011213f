"""Transformer layers shared by every model: embeddings, norms, attention (with a KV cache), MLPs, layer stacks.
Rotary positions are rotary.py's, the KV cache kv_cache.py's, the masks masks.py's; the computations behind every op
are jaxlm.kernels'.

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
from typing import Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.kernels import Kernels, weights
from jaxlm.kernels.registry import REMAT_POLICIES
from jaxlm.models import kv_cache
from jaxlm.models.kv_cache import LayerKV
from jaxlm.models.precision import Policy
from jaxlm.models.rotary import Rotary, apply_rope
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
    else:  # kernels.fuse_qkv=separate, or weights that cannot be joined (int8 with static input scales)
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
    kv = kv_cache.write_kv(kv, k, v, end)
    k_BSGK, v_BSGK = kv_cache.read_kv(kv, q.dtype)
    # The reference kernel: the cache has more slots than queries, which the causal-block kernels do not take.
    return self._out(self.kernels.attend_reference(q, k_BSGK, v_BSGK, mask_BTS, self.softcap)), kv

  def decode_rolling(self, x_BTD: jax.Array, mask_BTU: jax.Array, rotary: Rotary | None, kv: LayerKV,
                     end: jax.Array) -> tuple[jax.Array, LayerKV]:
    """`decode` against a rolling cache of S slots (a sliding window): the T new tokens attend over the S cached
    ones and themselves (U = S + T keys; the mask keeps the window), then the last min(T, S) of them overwrite the
    slots of the oldest, slot (time mod S)."""
    q, k, v = self._qkv(x_BTD, rotary)
    cached_k, cached_v = kv_cache.read_kv(kv, q.dtype)
    out = self.kernels.attend_reference(q, jnp.concatenate([cached_k, k.astype(q.dtype)], axis=1),
                                        jnp.concatenate([cached_v, v.astype(q.dtype)], axis=1), mask_BTU, self.softcap)
    return self._out(out), kv_cache.write_rolling(kv, k, v, end)


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
