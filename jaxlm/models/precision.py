"""The mixed-precision policy: which dtype each kind of value is kept in.

  params   kept in `param_dtype` (f32): optimizer updates of size 1e-4 * |w| would vanish in bf16.
  compute  matmul inputs cast to `compute_dtype` (bf16 on accelerators): twice the math rate, half the bytes.
  output   softmax, normalisation statistics, logits and the loss in f32: these sums lose digits in bf16.

float16 compute (GPUs without bf16) has too few exponent bits for small gradients: its train step scales the loss
(jaxlm/training/loss_scale.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxlm.config import ModelConfig

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@dataclasses.dataclass(frozen=True)
class Policy:
  param_dtype: jnp.dtype = jnp.float32
  compute_dtype: jnp.dtype = jnp.bfloat16
  output_dtype: jnp.dtype = jnp.float32

  @classmethod
  def from_model_config(cls, config: ModelConfig) -> "Policy":
    return cls(param_dtype=DTYPES[config.param_dtype], compute_dtype=DTYPES[config.compute_dtype])

  def cast_to_compute(self, x: jax.Array) -> jax.Array:
    return x.astype(self.compute_dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

  def cast_to_output(self, x: jax.Array) -> jax.Array:
    return x.astype(self.output_dtype)
