"""int8 (and float) model checkpoints written by orbax, and the shardings of quantized parameters on a mesh.

  quant_io.save(qmodel, "out/int8")                                 # params/ (orbax) + quant.json (mode, class)
  qmodel = quant_io.load("out/int8", make_float_model, mesh=mesh)   # each array read onto its sharding
  qmodel = quant_io.place(qmodel, mesh)                             # an in-memory model onto a mesh

A checkpoint stores each `int8.Int8Weight` as plain arrays ({"int8", "scale"[, "act_scale"][, "smooth"]}) so orbax
needs no custom type handler and nothing is pickled; `quantized_like` builds the abstract model it restores into.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Iterable

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import qwix
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxlm.training import atomic_files
from jaxlm.compress import int8
from jaxlm.parallel import sharding
from jaxlm.compress.int8 import Int8Weight
from jaxlm.compress.quantization import mode_of


def shardings(abstract_state: nnx.State, mesh: Mesh) -> Any:
  """NamedShardings for a (possibly quantized) model state, as a pure dict like `state.to_pure_dict()`.

  int8 values shard exactly like the float parameter (same logical axes); a scale shards along the same axes where
  its size allows (it is 1 on contracted axes, so those are replicated); calibrated input scales are replicated."""
  out: dict = {}
  for path, variable in nnx.to_flat_state(abstract_state):
    value = variable.get_value()
    axes = tuple(variable.get_metadata().get("axes") or (None,) * value.ndim)
    if len(axes) == value.ndim - 1:
      axes = ("layers",) + axes

    def one(leaf, axes=axes):
      if leaf.ndim != len(axes):
        return sharding.replicated(mesh)
      return NamedSharding(mesh, sharding.logical_to_spec(axes, leaf.shape, mesh))

    node = out
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = jax.tree.map(one, value)
  return out


def place(model: nnx.Module, mesh: Mesh) -> nnx.Module:
  """The model with every parameter (int8 values and scales too) on its NamedSharding of `mesh`."""
  graphdef, state = nnx.split(model)
  placed = jax.device_put(state.to_pure_dict(), shardings(state, mesh))
  nnx.replace_by_pure_dict(state, placed)
  return nnx.merge(graphdef, state)


# ----------------------------------------------------------------------------------------------- int8 checkpoints


def quantized_like(make_float_model: Callable[[], nnx.Module], mode: str, calibrated: Iterable[str] = (),
                   smoothed: Iterable[str] = ()) -> nnx.Module:
  """The model `quantize(make_float_model(), mode)` would give, built from shapes alone (`nnx.eval_shape`): what an
  int8 checkpoint restores into. `calibrated`: the '/'-joined paths of the weights with calibrated input scales;
  `smoothed`: those whose input is divided by smoothing factors when they run."""
  calibrated, smoothed = set(calibrated), set(smoothed)

  def build():
    model = make_float_model()
    if mode == "float":
      return model
    _, state = nnx.split(model)
    placeholder = None
    if mode == "w8a8":  # scale shapes only; the values come from the checkpoint
      placeholder = {"/".join(map(str, p)): jnp.ones(v.get_value().shape[:1] if int8.is_stacked(v, v.get_value())
                                                     else (), jnp.float32)
                     for p, v in nnx.to_flat_state(state) if "/".join(map(str, p)) in calibrated}
    for path, variable in nnx.to_flat_state(state):
      if "/".join(map(str, path)) in smoothed:
        value = variable.get_value()
        channels = [value.shape[a] for a in sorted(int8.quantizable(path, variable))]
        layers = value.shape[:1] if int8.is_stacked(variable, value) else ()
        variable.set_value(int8.SmoothedWeight(value, jnp.ones((*layers, *channels), jnp.float32)))
    int8.quantize_state(state, mode, placeholder)
    return model

  return nnx.eval_shape(build)


def _to_plain(pure: Any) -> Any:
  """Int8Weight -> {"int8", "scale"[, "act_scale"][, "smooth"]}: plain dicts and arrays that orbax stores as is."""
  if isinstance(pure, Int8Weight):
    plain = {"int8": pure.q.qvalue, "scale": pure.q.scale}
    if pure.act_scale is not None:
      plain["act_scale"] = pure.act_scale
    if pure.smooth is not None:
      plain["smooth"] = pure.smooth
    return plain
  if isinstance(pure, dict):
    return {k: _to_plain(v) for k, v in pure.items()}
  return pure


def _from_plain(plain: Any, like: Any) -> Any:
  if isinstance(like, Int8Weight):
    q = qwix.QArray(qvalue=plain["int8"], scale=plain["scale"], qtype=like.q.qtype)
    return Int8Weight(q, plain.get("act_scale"), like.mode, plain.get("smooth"))
  if isinstance(like, dict):
    return {k: _from_plain(plain[k], v) for k, v in like.items()}
  return plain


def save(model: nnx.Module, directory: str) -> None:
  """Writes the parameters (int8 values and scales, or float) with orbax into `directory`/params, and
  `directory`/quant.json naming the mode and the model class. Nothing is pickled."""
  directory = os.path.abspath(directory)
  state = nnx.state(model)
  tree = _to_plain(state.to_pure_dict())
  if jax.process_count() == 1:
    # One host copy per array: orbax wrote device arrays replicated over a mesh with ~4% more (and varying) bytes;
    # `load` places each array onto the mesh it is given anyway.
    tree = jax.device_get(tree)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(os.path.join(directory, "params"), tree, force=True)
  if jax.process_index() == 0:  # quant.json is written whole or not at all: `load` needs it
    atomic_files.write_json(os.path.join(directory, "quant.json"), {
        "mode": mode_of(state), "model_class": type(model).__name__,
        "calibrated": sorted("/".join(map(str, p)) for p, v in nnx.to_flat_state(state)
                             if isinstance(v.get_value(), Int8Weight) and v.get_value().act_scale is not None),
        "smoothed": sorted("/".join(map(str, p)) for p, v in nnx.to_flat_state(state)
                           if isinstance(v.get_value(), Int8Weight) and v.get_value().smooth is not None)})


def load(directory: str, make_float_model: Callable[[], nnx.Module], mesh: Mesh | None = None) -> nnx.Module:
  """Restores a model written by `save`. `make_float_model()` builds the float model of the same config (only its
  shapes are used); with `mesh`, each array is read straight onto its sharding of that mesh."""
  directory = os.path.abspath(directory)
  meta_path = os.path.join(directory, "quant.json")
  if not os.path.exists(meta_path):
    raise FileNotFoundError(f"{meta_path} does not exist; give a folder written by "
                            "jaxlm.compress.checkpoint_files.save")
  with open(meta_path) as f:
    meta = json.load(f)
  abstract_model = quantized_like(make_float_model, meta["mode"], meta.get("calibrated", ()),
                                  meta.get("smoothed", ()))
  graphdef, abstract_state = nnx.split(abstract_model)
  like = abstract_state.to_pure_dict()
  target = _to_plain(like)
  if mesh is not None:
    target = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), target,
                          _to_plain(shardings(abstract_state, mesh)))
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(os.path.join(directory, "params"), target)
  nnx.replace_by_pure_dict(abstract_state, _from_plain(restored, like))
  return nnx.merge(graphdef, abstract_state)


def directory_bytes(directory: str) -> int:
  return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(directory) for name in names)
