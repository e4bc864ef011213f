"""LoRA / QLoRA's load and merged export one parameter at a time: the float model is never whole, on a device or
on the host.

  abstract, source = lora_io.hf_source(folder, compute_dtype, param_dtype)   # a LazyLeaf per parameter
  state, kept_random = lora_io.load_base(state, shardings, config.lora, make_model, mesh, source, where, seed)
  lora_io.save_merged(graphdef, params, folder)     # hf_weights.save_pretrained of the model:
                                                    # W + alpha/r A B per weight

Load: a stacked target weight is read, placed with its sharding and quantized one layer at a time into the state's
base storage (updated in place); any other parameter is read whole (one HF tensor at a time into its host array)
and placed. So the device holds the quantized base plus one float parameter that is no target weight (e.g. the
embedding), or one layer of a target weight; the host likewise. The train state's base starts empty for it
(`lora.LoRASplit(..., empty_base=True)`); parameters the checkpoint lacks get the seeded random init, each
from its own compiled init (XLA drops the rest of the model's). Export is `jaxlm.hf.save_pretrained`, which writes
one HF tensor (one layer of one weight) at a time, dequantized and merged on the device. The load gives the whole-tree
path's state (`lora.load_base`: the float model merged into the dequantized state, quantized again) bit for bit; the
export its weights (`lora.merge` of the whole tree) up to float32 rounding of the adapters' product (one ulp: the
batched A B rounds some weights otherwise).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxlm.interop import hf_weights
from jaxlm.adapters import lora
from jaxlm.parallel import sharding
from jaxlm.config import LoRAConfig

_flat, _nested = lora._flat, lora._nested


def _place(host, dtype, target_sharding) -> jax.Array:
  """The checkpoint's value in the parameter's dtype (as the whole-tree path placed it) on its sharding."""
  if isinstance(host, np.ndarray):
    return hf_weights._place(host.astype(dtype, copy=False), target_sharding)
  return jax.device_put(host.astype(dtype), target_sharding)


@dataclasses.dataclass(frozen=True)
class LazyLeaf:
  """A checkpoint parameter not read yet: its shape and `read(layer=None) -> host array` (whole, or one layer)."""
  shape: tuple[int, ...]
  read: Callable[..., np.ndarray]


def hf_source(folder: str, compute_dtype: str = "float32", param_dtype: str = "float32") -> tuple[nnx.Module, dict]:
  """(abstract model, nested {parameter: LazyLeaf}) of an HF folder: nothing read until `load_base` asks."""
  abstract, readers, _ = hf_weights.lazy_pretrained(folder, compute_dtype, param_dtype)
  shapes = _flat(nnx.split(abstract)[1].to_pure_dict())
  return abstract, _nested({p: LazyLeaf(tuple(shapes[p].shape), read) for p, read in readers.items()})


# ----------------------------------------------------------------------------------------------- load


def _quantizer(plan: lora.Plan, path: str, out_sharding) -> Callable[[jax.Array], Any]:
  """One unstacked target weight into the plan's base storage, from f32 (as the whole-tree path: lora.merge's)."""
  return jax.jit(lambda w: lora._quantize_base(plan, path, w.astype(jnp.float32)), out_shardings=out_sharding)


def _layer_setter(plan: lora.Plan, path: str, out_sharding) -> Callable[[Any, jax.Array, jax.Array], Any]:
  """(stacked base storage, one layer's float weight, i) -> the storage with layer i quantized (updated in place)."""
  one = dataclasses.replace(plan, stacked=frozenset())

  def set_layer(stacked, w, i):
    quantized = lora._quantize_base(one, path, w.astype(jnp.float32))
    return jax.tree.map(lambda s, x: s.at[i].set(x), stacked, quantized)
  return jax.jit(set_layer, out_shardings=out_sharding, donate_argnums=0)


def _random_leaf(make_model, seed: int, plan: lora.Plan, path: str, out_sharding) -> Any:
  """The seeded random init of one parameter (frozen as the plan says), as `lora.LoRASplit.init` draws it."""
  def init():
    w = _flat(nnx.split(make_model(nnx.Rngs(seed)))[1].to_pure_dict())[path]
    return lora._quantize_base(plan, path, w) if path in plan.targets else w
  return jax.jit(init, out_shardings=out_sharding)()


def load_base(state: dict, shardings: dict, lora_config: LoRAConfig, make_model, mesh, source: dict, where: str,
              seed: int = 0, strict: bool = True) -> tuple[dict, list[str]]:
  """A fresh LoRA state with `source` (nested {parameter: LazyLeaf or array}) as its frozen base and head, loaded
  and quantized one parameter at a time; the adapters are kept. A parameter missing from `source` (or of another
  shape) is an error when `strict`, else it keeps (the base: gets) the seeded random init. The state's frozen
  buffers are donated (reused). Returns (state, the parameter paths kept random)."""
  abstract = nnx.split(nnx.eval_shape(lambda: make_model(nnx.Rngs(0))))[1]
  plan = lora.make_plan(abstract, lora_config)
  targets, float_shardings = _flat(abstract.to_pure_dict()), _flat(sharding.param_shardings(abstract, mesh))
  found_all, frozen, trainable = _flat(source), _flat(state["frozen"]), _flat(state["params"])
  frozen_shardings, trainable_shardings = _flat(shardings["frozen"]), _flat(shardings["params"])
  kept_random = []
  for path, target in targets.items():
    found = found_all.get(path)
    head = path.startswith(lora.HEAD_PREFIXES)
    key = path + "/lora_base" if path in plan.targets else path
    if found is None or tuple(found.shape) != tuple(target.shape):
      if strict:
        raise ValueError(f"init_from={where!r} has {'no' if found is None else f'a {tuple(found.shape)}'} parameter "
                         f"{path} for the model's {tuple(target.shape)}; is it a decoder checkpoint?")
      kept_random.append(path)
      if not head:
        frozen[key] = _random_leaf(make_model, seed, plan, path, frozen_shardings[key])
      continue
    if path in plan.stacked and plan.base != "float":  # one layer's float weight at a time
      setter, spec = _layer_setter(plan, path, frozen_shardings[key]), tuple(float_shardings[path].spec)
      layer_sharding = NamedSharding(mesh, P(*spec[1:]))
      for i in range(target.shape[0]):
        layer = _place(found.read(layer=i) if isinstance(found, LazyLeaf) else found[i], target.dtype, layer_sharding)
        frozen[key] = setter(frozen[key], layer, jnp.int32(i))
        del layer
      continue
    if not head and (path not in plan.targets or plan.base == "float"):  # its placeholder goes first
      dtype = frozen[key].dtype
      frozen.pop(key).delete()
    value = _place(found.read() if isinstance(found, LazyLeaf) else found, target.dtype, float_shardings[path])
    if head:
      trainable[path] = jax.device_put(value, trainable_shardings[path])
    elif path in plan.targets and plan.base != "float":
      frozen[key] = _quantizer(plan, path, frozen_shardings[key])(value)
    else:
      frozen[key] = jax.device_put(value.astype(dtype), frozen_shardings[key])
    del value  # the float copy goes before the next parameter is read
  if all(p in kept_random or p.startswith(lora.HEAD_PREFIXES) for p in targets):
    raise ValueError(f"init_from={where!r}: no parameter of the base fits this model; is it this architecture?")
  return {**state, "frozen": _nested(frozen), "params": _nested(trainable)}, kept_random


# ----------------------------------------------------------------------------------------------- export


def save_merged(graphdef: nnx.GraphDef, params: dict, folder: str) -> None:
  """The model of `params` (LoRAWeights or plain arrays, e.g. `Features.model_params(state)`) as an HF folder, each
  weight merged on its own: never the whole merged float model at once."""
  hf_weights.save_pretrained(nnx.merge(graphdef, params), folder)
