"""4-bit NormalFloat (NF4) weights: QLoRA's storage of a frozen base (`lora.base=nf4`, jaxlm/adapters/lora.py).

Ours: qwix 0.1.8 has no NF4 type. The format is the QLoRA paper's (Dettmers et al., 2023) without its double
quantization of the scales: per block of 64 inputs, w / absmax rounded to the nearest of 16 levels (quantiles of a
standard normal scaled to [-1, 1]), two 4-bit codes per byte; dequantized on the fly in each matmul.
"""

from __future__ import annotations

import flax
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

NF4_BLOCK = 64  # weights per NF4 absmax scale, along a weight's input axis (as bitsandbytes)
# The 16 NF4 levels: quantiles of a standard normal, scaled to [-1, 1] (Dettmers et al., 2023; bitsandbytes' table).
NF4_LEVELS = np.array([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                       -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                       0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                       0.7229568362236023, 1.0], np.float32)


@flax.struct.dataclass
class NF4Weight:
  """4-bit NormalFloat weight: two codes per byte along the flattened input axis, one f32 absmax per 64 inputs.

  codes uint8 [lead..., in/2, out...], absmax f32 [lead..., in/64, out...]; `lead` is the stacked [L] axis (if any),
  which scan slices like any parameter."""
  codes: jax.Array
  absmax: jax.Array
  in_shape: tuple[int, ...] = flax.struct.field(pytree_node=False)
  num_out: int = flax.struct.field(pytree_node=False)

  @property
  def shape(self) -> tuple[int, ...]:
    lead = self.codes.shape[:self.codes.ndim - 1 - self.num_out]
    return lead + self.in_shape + self.codes.shape[self.codes.ndim - self.num_out:]

  ndim = property(lambda self: len(self.shape))
  dtype = property(lambda self: jnp.dtype(jnp.float32))

  def dequantize(self) -> jax.Array:
    c, n_out = self.codes, self.num_out
    axis = c.ndim - 1 - n_out  # the packed input axis
    pairs = jnp.stack([c & 0xF, c >> 4], axis=axis + 1)  # [lead, in/2, 2, out]
    codes = pairs.reshape(c.shape[:axis] + (c.shape[axis] * 2,) + c.shape[axis + 1:])
    values = jnp.asarray(NF4_LEVELS)[codes.astype(jnp.int32)]
    blocks = values.reshape(codes.shape[:axis] + (-1, NF4_BLOCK) + codes.shape[axis + 1:])
    w = blocks * jnp.expand_dims(self.absmax, axis + 1)
    return w.reshape(self.shape)


def nf4_quantize(w: jax.Array, num_in: int, num_lead: int) -> NF4Weight:
  """NF4 of `w` [lead..., in..., out...]: per block of 64 inputs, w / absmax rounded to the nearest NF4 level."""
  in_shape = w.shape[num_lead:num_lead + num_in]
  out_shape = w.shape[num_lead + num_in:]
  lead = w.shape[:num_lead]
  flat = w.astype(jnp.float32).reshape(lead + (-1, NF4_BLOCK) + out_shape)
  absmax = jnp.max(jnp.abs(flat), axis=num_lead + 1)
  normalized = flat / jnp.expand_dims(jnp.where(absmax > 0, absmax, 1.0), num_lead + 1)
  midpoints = (NF4_LEVELS[1:] + NF4_LEVELS[:-1]) / 2
  # searchsorted's codes (the midpoints below each value) as fused compares: it needs weight-sized temporaries.
  codes = sum((normalized > m).astype(jnp.uint8) for m in midpoints.astype(np.float32))
  codes = codes.reshape(lead + (-1, 2) + out_shape)
  packed = jnp.take(codes, 0, axis=num_lead + 1) | (jnp.take(codes, 1, axis=num_lead + 1) << 4)
  return NF4Weight(packed, absmax, tuple(in_shape), len(out_shape))


nnx.register_data_type(NF4Weight)
