"""fp8 weight matmuls for training on Ada and Hopper GPUs (kernels.matmul=fp8), with the `xla` einsum's contract:
`einsum(subscripts, x, w)`, the result in the operands' dtype, computed from 8-bit operands.

Forward: the activation and the weight are each quantized to float8_e4m3fn with one scale per tensor, taken from
that tensor's current absolute maximum, and the dot reads them upcast, `dot(convert(x_f8) * s_x, convert(w_f8) *
s_w)`: the pattern XLA:GPU's GEMM rewriter turns into one cuBLASLt fp8 GEMM (`__cublas$lt$matmul$f8`, f32
accumulation, bf16 output), the pattern flax's Fp8DotGeneralOp relies on. Backward: the output gradient is quantized
the same way to float8_e5m2 (more range, less precision: gradients span more decades than activations) for the two
gradient dots, dx = g . w and dw = x . g, e5m2 x e4m3 GEMMs; the saved residuals are the fp8 operands, half the
bytes of bf16 ones. Another backend runs the same HLO as ordinary dots on the same rounded values, which is how the
CPU tests check it.

Why dynamic ("tensorwise") scaling, torchtitan's float8 default, rather than flax's delayed scaling (a scale from an
amax history of past steps): it keeps no state, so the train state, checkpoints and optimizer stay as they are and a
run can switch kernels.matmul on resume; and a scale taken from the tensor itself cannot overflow after a sudden
jump in activations. Its cost is one max-reduction per operand per matmul (an all-reduce of a scalar on a mesh).

Scales are powers of two: dividing by a power of two is exact in bf16, so the dequantized operands are exactly the
fp8 values times the scale and quantizing loses only the 8-bit rounding (at the price of up to one bit of unused
range).

Only plain float weights take this path: `Kernels.einsum` keeps stand-ins (int8, LoRA: jaxlm/kernels/weights.py),
the f32 logits of the output head and attention's activation products on the reference (torchtitan too keeps the
output layer out of float8).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxlm.kernels import gpu

FORWARD = jnp.float8_e4m3fn  # activations and weights: 3 mantissa bits, max 448
BACKWARD = jnp.float8_e5m2  # output gradients: 2 mantissa bits, max 57344


def unavailable() -> str | None:
  """Why this machine cannot run fp8 GEMMs, or None (the registry adds what to use instead)."""
  return gpu.nvidia_missing("fp8 tensor cores, compute capability >= 8.9 (Ada, Hopper)", 8.9)


def scale(x: jax.Array, dtype) -> jax.Array:
  """The power of two s, a scalar of x's dtype, with max|x| / s within `dtype`'s largest finite value."""
  ratio = jnp.max(jnp.abs(x)).astype(jnp.float32) / float(jnp.finfo(dtype).max)
  # The smallest power of two >= ratio, read off its f32 bits (exp2 is not exact on every backend): the exponent,
  # plus one unless the mantissa is zero.
  bits = jax.lax.bitcast_convert_type(ratio, jnp.int32)
  exponent = (bits >> 23) - 127 + jnp.where(bits & 0x7FFFFF, 1, 0)
  # A normal number of x's dtype: an all-zero tensor gets the smallest, not zero; an overflowed one stays finite.
  info = jnp.finfo(x.dtype)
  exponent = jnp.clip(exponent, info.minexp, info.maxexp - 1)
  return jax.lax.bitcast_convert_type((exponent + 127) << 23, jnp.float32).astype(x.dtype)


def quantize(x: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
  """(x / s rounded to `dtype`, s): per-tensor, from x's current absolute maximum."""
  s = scale(x, dtype)
  limit = float(jnp.finfo(dtype).max)
  return jnp.clip(x / s, -limit, limit).astype(dtype), s


def dequantize(q: jax.Array, s: jax.Array) -> jax.Array:
  """q upcast to its scale's dtype times the scale: the convert-and-multiply the GEMM rewriter folds into the fp8
  GEMM."""
  return q.astype(s.dtype) * s


def einsum(subscripts: str, x: jax.Array, w: jax.Array, *, preferred_element_type=None) -> jax.Array:
  """jnp.einsum(subscripts, x, w) from per-tensor e4m3 operands, its gradients from an e5m2 output gradient."""
  return _einsum(subscripts, preferred_element_type, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _einsum(subscripts, preferred_element_type, x, w):
  return _forward(subscripts, preferred_element_type, x, w)[0]


def _forward(subscripts, preferred_element_type, x, w):
  x_f8, s_x = quantize(x, FORWARD)
  w_f8, s_w = quantize(w, FORWARD)
  y = jnp.einsum(subscripts, dequantize(x_f8, s_x), dequantize(w_f8, s_w),
                 preferred_element_type=preferred_element_type)
  return y, (x_f8, s_x, w_f8, s_w)  # each scale has its operand's dtype


def _backward(subscripts, preferred_element_type, residuals, g):
  x_f8, s_x, w_f8, s_w = residuals
  g_f8, s_g = quantize(g, BACKWARD)
  # The einsum's own transpose rule gives the two gradient dots (and any transposes), now on fp8 operands.
  _, transpose = jax.vjp(functools.partial(jnp.einsum, subscripts, preferred_element_type=preferred_element_type),
                         dequantize(x_f8, s_x), dequantize(w_f8, s_w))
  dx, dw = transpose(dequantize(g_f8, s_g))
  return dx.astype(s_x.dtype), dw.astype(s_w.dtype)


_einsum.defvjp(_forward, _backward)
