"""Device mesh, the one table of logical-axis rules, and activation constraints.

Every parameter names its dimensions with logical axes (`vocab`, `embed`, `heads`, ...); activations name theirs
with `act_*` axes. `RULES` maps each logical axis to mesh axes, so switching between data parallel, FSDP and tensor
parallel is a change of mesh sizes only, never of model code.

Mesh axes:
  data    replicas that each hold a full copy of params and see a slice of the batch
  fsdp    devices that shard params, grads and optimizer state along `embed`, and also slice the batch
  tensor  devices that split heads, MLP width and vocabulary (Megatron-style column/row parallelism)
  pipeline  stages that each hold consecutive layers of the stacked blocks (jaxlm/training/pipeline.py); outermost
  expert  devices that each hold a share of every mixture-of-experts layer's experts; tokens travel to their experts'
          devices and back (jaxlm/models/moe.py). For everything else they are data-parallel replicas.
  context devices that each hold a part of every row's sequence through the whole model; attention passes the keys
          and values round them (jaxlm/kernels/ring_attention.py)
"""

from __future__ import annotations

import contextvars
import functools
import math
from typing import Any, Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxlm.config import MeshConfig, mesh_sizes

MESH_AXES = ("data", "fsdp", "tensor")
PIPELINE_AXIS = "pipeline"  # a mesh axis beside MESH_AXES, so mesh_shape keeps returning (data, fsdp, tensor)
EXPERT_AXIS = "expert"  # likewise
CONTEXT_AXIS = "context"  # likewise

# Logical axis -> mesh axis (or tuple of mesh axes, or None = replicated). The only sharding table in jaxlm.
RULES: dict[str, Any] = {
    # parameters
    "vocab": "tensor",
    "embed": "fsdp",
    "heads": "tensor",
    "kv_heads": "tensor",  # grouped-query key/value heads; replicated when the tensor axis does not divide them
    "head_dim": None,
    "mlp": "tensor",
    "experts": EXPERT_AXIS,  # a mixture-of-experts layer's expert axis
    "expert_mlp": "tensor",  # each expert's MLP width
    "positions": None,
    "layers": PIPELINE_AXIS,  # the stacked blocks' leading axis: stage s holds layers [s * L/S, (s + 1) * L/S)
    # activations
    "act_batch": ("data", "fsdp", EXPERT_AXIS),
    "act_seq": CONTEXT_AXIS,  # a no-op unless mesh.context > 1
    # The residual stream between sublayers: sharded over `tensor` with `mesh.sequence_parallel` (Megatron-SP), so
    # norms and the saved residuals cost 1/tensor of the memory; attention and MLPs still see whole sequences.
    "act_residual_seq": CONTEXT_AXIS,
    "act_embed": None,
    "act_heads": "tensor",
    "act_kv_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
}


# Per-run changes to RULES, applied while a step is traced (see `traced_on`).
_overrides: contextvars.ContextVar[dict[str, Any]] = contextvars.ContextVar("jaxlm_rule_overrides", default={})


def rule(name: str) -> Any:
  """The mesh axes of a logical axis: RULES, unless the step being traced overrides it."""
  overrides = _overrides.get()
  return overrides[name] if name in overrides else RULES.get(name)


def rule_overrides(config: MeshConfig) -> dict[str, Any]:
  """RULES changes a mesh config asks for: `sequence_parallel` shards the residual stream's sequence over tensor."""
  return {"act_residual_seq": "tensor"} if config.sequence_parallel else {}


def mesh_shape(config: MeshConfig, num_devices: int) -> tuple[int, int, int]:
  """Resolves -1 entries (at most one) so that data * fsdp * tensor == num_devices / (mesh.pipeline * mesh.expert *
  mesh.context), or raises a one-line error."""
  for name, size in (("pipeline", config.pipeline), ("expert", config.expert), ("context", config.context)):
    if size < 1 or num_devices % size:
      raise ValueError(f"mesh.{name}={size} does not divide the {num_devices} devices; choose a mesh.{name} that "
                       "divides the device count")
    num_devices //= size
  sizes = list(mesh_sizes(config))
  wildcards = [i for i, s in enumerate(sizes) if s == -1]
  if len(wildcards) > 1:
    raise ValueError(f"at most one of mesh.data/fsdp/tensor may be -1, got {tuple(sizes)}")
  if any(s == 0 or s < -1 for s in sizes):
    raise ValueError(f"mesh sizes must be positive or -1, got data={sizes[0]} fsdp={sizes[1]} tensor={sizes[2]}")
  fixed = math.prod(s for s in sizes if s != -1)
  if wildcards:
    if num_devices % fixed:
      raise ValueError(
          f"mesh fsdp*tensor*data={fixed} (without the -1 axis) does not divide the {num_devices} devices; "
          "choose sizes whose product divides the device count")
    sizes[wildcards[0]] = num_devices // fixed
  elif fixed != num_devices:
    raise ValueError(
        f"mesh data*fsdp*tensor = {sizes[0]}*{sizes[1]}*{sizes[2]} = {fixed} but there are {num_devices} devices; "
        "set one axis to -1 or make the product equal the device count")
  return tuple(sizes)  # type: ignore[return-value]


def make_mesh(config: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Mesh:
  devices = list(devices) if devices is not None else jax.devices()
  data, fsdp, tensor = mesh_shape(config, len(devices))
  shape = (config.pipeline, data, fsdp, config.expert, config.context, tensor)
  auto = (jax.sharding.AxisType.Auto,) * len(shape)
  return jax.make_mesh(shape, (PIPELINE_AXIS, "data", "fsdp", EXPERT_AXIS, CONTEXT_AXIS, "tensor"), axis_types=auto,
                       devices=devices)


def logical_to_spec(logical_axes: Sequence[str | None], shape: Sequence[int] | None = None,
                    mesh: Mesh | None = None) -> P:
  """PartitionSpec for logical axes. With `shape` and `mesh`, a dimension the mesh axes do not divide is replicated
  (e.g. a 50257-token vocabulary over 2 tensor devices) instead of failing at compile time."""
  spec = []
  for i, name in enumerate(logical_axes):
    target = rule(name) if name is not None else None
    if target is not None and shape is not None and mesh is not None:
      axes = (target,) if isinstance(target, str) else tuple(target)
      if any(a not in mesh.shape for a in axes):  # e.g. `pipeline` on a mesh built without it: replicated
        axes = tuple(a for a in axes if a in mesh.shape)
        target = (axes if len(axes) > 1 else axes[0]) if axes else None
      if shape[i] % math.prod(mesh.shape[a] for a in axes):
        target = None
    spec.append(target)
  return P(*spec)


def constrain(x: jax.Array, logical_axes: Sequence[str | None]) -> jax.Array:
  """Pins an activation's layout at a block boundary; a no-op outside a mesh context (e.g. single-device use)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or jax.sharding.AxisType.Manual in mesh.axis_types:  # no mesh, or inside shard_map
    return x
  return jax.lax.with_sharding_constraint(x, logical_to_spec(logical_axes, x.shape, mesh))


def gather_fsdp(params: Any) -> Any:
  """Lays out parameters (an nnx State) for compute: the `fsdp` shards are all-gathered, tensor-parallel shards kept.

  Called on one layer's parameters inside the layer scan, so a device holds one gathered layer at a time. Without
  it, GSPMD follows the weights' `embed` sharding into the activations and shards the matmuls along D, all-reducing
  [B, T, ...] activations and gathering the batch (many times the FSDP minimum in collective bytes); with it the
  forward all-gathers weights and the backward reduce-scatters their gradients, as FSDP should.
  """
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or jax.sharding.AxisType.Manual in mesh.axis_types or mesh.shape.get("fsdp", 1) == 1:
    return params
  from flax import nnx

  def gather(variable):
    if not isinstance(variable, nnx.Variable) or not variable.get_metadata().get("axes"):
      return variable
    value = variable.get_value()
    if hasattr(value, "laid_out"):  # a jaxlm.adapters.lora.LoRAWeight: the base and each adapter factor by its own axes
      return variable.replace(value.laid_out(variable.get_metadata()["axes"], unsharded_fsdp))
    if not isinstance(value, jax.Array):  # e.g. jaxlm.compress.quantization's int8 weight + scales: left to GSPMD
      return variable
    return variable.replace(unsharded_fsdp(value, variable.get_metadata()["axes"]))

  def unsharded_fsdp(value, axes):
    spec = logical_to_spec(axes, value.shape, mesh)
    return jax.lax.with_sharding_constraint(value, P(*(_drop_axis(entry, "fsdp") for entry in spec)))

  return jax.tree.map(gather, params, is_leaf=lambda x: isinstance(x, nnx.Variable))


def _drop_axis(entry: Any, axis: str) -> Any:
  if entry == axis:
    return None
  if isinstance(entry, tuple):
    kept = tuple(a for a in entry if a != axis)
    return kept if len(kept) > 1 else (kept[0] if kept else None)
  return entry


def traced_on(mesh: Mesh, fn, overrides: dict[str, Any] | None = None):
  """`fn` traced with `mesh` as the abstract mesh (and `overrides` of RULES), so the models' `constrain` calls take
  effect under `jax.jit`: a jitted function is traced where it is first called, usually outside `jax.set_mesh`."""

  def wrapped(*args, **kwargs):
    token = _overrides.set(dict(overrides or {}))
    try:
      with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        return fn(*args, **kwargs)
    finally:
      _overrides.reset(token)

  return functools.wraps(fn)(wrapped)


def axis_size(name: str) -> int:
  """The size of mesh axis `name` in the mesh being traced under (1 outside one, or inside shard_map)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or jax.sharding.AxisType.Manual in mesh.axis_types:
    return 1
  return mesh.shape.get(name, 1)


def batch_axes(mesh) -> tuple[str, ...]:
  """The mesh axes that split the batch (`act_batch`'s, those this mesh has)."""
  return tuple(a for a in RULES["act_batch"] if a in mesh.shape)


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
  """Inputs are [B, T, ...] with the batch split over the data, fsdp and expert axes."""
  return NamedSharding(mesh, P(batch_axes(mesh), *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, P())


def param_shardings(abstract_state: Any, mesh: Mesh) -> Any:
  """NamedShardings for an nnx.State of Params carrying `axes` metadata, as a pure dict matching `to_pure_dict()`.

  Parameters of scanned blocks have one leading dimension more than their names: that is the `layers` axis.
  """
  from flax import nnx  # local import keeps this module usable without building a model

  shardings: dict = {}
  for path, variable in nnx.to_flat_state(abstract_state):
    value = variable.get_value() if hasattr(variable, "get_value") else variable.value
    axes = tuple(variable.get_metadata().get("axes") or (None,) * value.ndim)
    if len(axes) == value.ndim - 1:
      axes = ("layers",) + axes
    if len(axes) != value.ndim:
      raise ValueError(f"parameter {'/'.join(map(str, path))} of shape {value.shape} has logical axes {axes}")
    node = shardings
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = NamedSharding(mesh, logical_to_spec(axes, value.shape, mesh))
  return shardings


def check_divisible(name: str, size: int, mesh: Mesh, axis: str, hint: str) -> None:
  if size % mesh.shape[axis]:
    raise ValueError(f"{name}={size} is not divisible by mesh.{axis}={mesh.shape[axis]}; {hint}")
