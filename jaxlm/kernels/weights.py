"""Weights that are not plain arrays, and the one way they reach the kernels.

A parameter's value inside a model is a plain array or a *stand-in* carrying more than one float weight: LoRA's
frozen base with its adapters (jaxlm.adapters.lora.LoRAWeight, whose base may be int8 or NF4), int8 values with
their scales, a float weight with SmoothQuant factors still to apply, a calibration probe (jaxlm.compress.int8). The
model code reads a stand-in as it reads the array (`param[...]`, `.astype(dtype)`, `.shape`, `.ndim`, `.dtype`);
what the kernels need of it, it computes itself:

  contract(subscripts, x, matmul, **kwargs)   x contracted with the weight (`matmul`: the registry's einsum, for
                                              the plain arrays the stand-in holds)
  lookup(ids)                                 rows of a table (an embedding), along axis 0
  concatenate(weights, axis) (classmethod)    several stand-ins of one kind read by one matmul (fused q/k/v);
                                              None, or no such method, keeps them apart

`Kernels.einsum` and `Kernels.lookup` hand every stand-in to these methods; nothing else in the models or kernels
asks what kind of weight it holds. (Layout is the one other concern: a stand-in with `laid_out(axes, place)` lays out
its arrays for FSDP's per-layer all-gather, jaxlm.parallel.sharding.gather_fsdp; one without is left to GSPMD.)
"""

from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

import jax
import jax.numpy as jnp


@runtime_checkable
class StandIn(Protocol):
  shape: tuple[int, ...]
  ndim: int
  dtype: Any

  def contract(self, subscripts: str, x: jax.Array, matmul, **kwargs) -> jax.Array: ...

  def lookup(self, ids: jax.Array) -> jax.Array: ...


def is_stand_in(w: Any) -> bool:
  return isinstance(w, StandIn)


def concatenate(weights: Sequence[Any], axis: int) -> Any | None:
  """The weights joined along `axis` as one weight for one matmul, or None where their kind cannot be joined."""
  if not any(is_stand_in(w) for w in weights):
    return jnp.concatenate(weights, axis=axis)
  kind = type(weights[0])
  if any(type(w) is not kind for w in weights) or not hasattr(kind, "concatenate"):
    return None
  return kind.concatenate(weights, axis)
