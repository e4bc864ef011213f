"""The KV cache of incremental decoding: every layer's keys and values per slot, in the compute dtype or as int8 with
a scale per token, written at the slots after the filled ones or, for a sliding window, into a rolling cache whose
oldest slots are overwritten.

Dimension letters: L layers, B batch, S slots, T new tokens, G key/value heads, K head dim.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from jaxlm.parallel.sharding import constrain



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


def _write(kv: LayerKV, k_BTGK: jax.Array, v_BTGK: jax.Array, put) -> LayerKV:
  """The new keys and values stored with `put(cache, new)`, quantized first in an int8 cache."""
  if kv.k_scale_BSG is None:
    return LayerKV(put(kv.k_BSGK, k_BTGK), put(kv.v_BSGK, v_BTGK))
  (k_q, k_scale), (v_q, v_scale) = quantize_kv(k_BTGK), quantize_kv(v_BTGK)
  return LayerKV(put(kv.k_BSGK, k_q), put(kv.v_BSGK, v_q), put(kv.k_scale_BSG, k_scale),
                 put(kv.v_scale_BSG, v_scale))


def write_kv(kv: LayerKV, k_BTGK: jax.Array, v_BTGK: jax.Array, end: jax.Array) -> LayerKV:
  """The T new keys and values at slots end..end+T-1 of every row."""
  def put(cache, new):
    zero = jnp.zeros((), jnp.int32)
    return jax.lax.dynamic_update_slice(cache, new.astype(cache.dtype), (zero, end) + (zero,) * (cache.ndim - 2))

  return _write(kv, k_BTGK, v_BTGK, put)


def rolling_slots(end: jax.Array, t: int, s: int) -> tuple[int, jax.Array]:
  """For T tokens written from time `end` into a rolling cache of S slots: (how many of the last ones are kept,
  their slots)."""
  kept = min(t, s)
  return kept, (end + t - kept + jnp.arange(kept)) % s


def write_rolling(kv: LayerKV, k_BTGK: jax.Array, v_BTGK: jax.Array, end: jax.Array) -> LayerKV:
  """The last min(T, S) new keys and values over the oldest slots of a rolling cache (slot = time mod S)."""
  kept, slots = rolling_slots(end, k_BTGK.shape[1], kv.k_BSGK.shape[1])
  return _write(kv, k_BTGK, v_BTGK, lambda cache, new: cache.at[:, slots].set(new[:, -kept:].astype(cache.dtype)))


def read_kv(kv: LayerKV, dtype) -> tuple[jax.Array, jax.Array]:
  if kv.k_scale_BSG is None:
    return kv.k_BSGK, kv.v_BSGK
  dequantize = lambda q, scale: (q.astype(jnp.float32) * scale[..., None]).astype(dtype)
  return dequantize(kv.k_BSGK, kv.k_scale_BSG), dequantize(kv.v_BSGK, kv.v_scale_BSG)
