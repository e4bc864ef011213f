"""The mixed-precision policy: where each dtype is used (and which library runs the weight matmuls).

  params   kept in `param_dtype` (f32): optimizer updates of size 1e-4 * |w| would vanish in bf16.
  compute  matmul inputs cast to `compute_dtype` (bf16 on accelerators): twice the math rate, half the bytes.
  output   softmax, normalisation statistics, logits and the loss in f32: these sums lose digits in bf16.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxlm import blas
from jaxlm.config import ModelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Policy:
  param_dtype: jnp.dtype = jnp.float32
  compute_dtype: jnp.dtype = jnp.bfloat16
  output_dtype: jnp.dtype = jnp.float32
  matmul: str = "xla"  # ModelConfig.matmul: xla | blas

  @classmethod
  def from_model_config(cls, config: ModelConfig) -> "Policy":
    return cls(param_dtype=DTYPES[config.param_dtype], compute_dtype=DTYPES[config.compute_dtype],
               matmul=config.matmul)

  def einsum(self, subscripts: str, x: jax.Array, w: jax.Array, **kwargs) -> jax.Array:
    """An activation x weight contraction: `jnp.einsum`, or one BLAS sgemm when matmul=blas (f32 in and out,
    so `preferred_element_type` has nothing to change there)."""
    if self.matmul == "blas":
      return blas.einsum(subscripts, x, w)
    return jnp.einsum(subscripts, x, w, **kwargs)  # looked up per call: jaxlm.quant intercepts jnp.einsum

  def cast_to_compute(self, x: jax.Array) -> jax.Array:
    return x.astype(self.compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

  def cast_to_output(self, x: jax.Array) -> jax.Array:
    return x.astype(self.output_dtype)
