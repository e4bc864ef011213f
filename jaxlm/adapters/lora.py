"""Low-rank adapters (LoRA) and QLoRA for every jaxlm model (GPT-2, Llama, BERT), on any mesh.

  W x  becomes  W x + (alpha / r) * B(A(x))     A: [in..., r] (random), B: [r, out...] (zeros): the base model at step 0

`lora.rank > 0` turns a run into LoRA training: the train state is
  {"step", "params": the TRAINABLE tree (adapters {"lora_a", "lora_b"} at each target weight, plus a new
   classifier head), "frozen": everything else, "opt_state": the optimizer state of "params" only}
In "frozen" a target weight's entry is {"lora_base": W (float, or int8/NF4 with `lora.base`), "lora_scale":
alpha / r ([L] for stacked blocks)}. `combine(params, frozen)` gives the model's parameter tree, where each target
weight's value is a `LoRAWeight`, a stand-in (jaxlm.kernels.weights) whose `contract` is the base matmul
(dequantized on the fly) plus the low-rank update. Adapters are sharded like their base weight: A's input axes as
W's, B's output axes as W's; the factor without W's FSDP axis (`embed`) shards its rank axis over fsdp instead, so
FSDP shards both factors.

We do not use qwix's LoRA provider: it creates the adapters inside the module during a first call, and our blocks
run under `jax.lax.scan` on modules rebuilt by `nnx.merge`, so they would be lost (as for quantization, int8.py).
qwix serves the int8 base (its per-channel `quantize`, via jaxlm.compress.int8); NF4 is jaxlm/adapters/nf4.py.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax
import jax
import jax.numpy as jnp
from flax import nnx, traverse_util
from jax.sharding import Mesh, NamedSharding

from jaxlm.compress import int8
from jaxlm.parallel import sharding
from jaxlm.config import LORA_MATMUL_WEIGHTS, LORA_TARGET_GROUPS, LoRAConfig
from jaxlm.adapters.nf4 import NF4_BLOCK, NF4Weight, nf4_quantize

TARGET_GROUPS, MATMUL_WEIGHTS = LORA_TARGET_GROUPS, LORA_MATMUL_WEIGHTS
# New task heads, trained whole beside the adapters (peft's modules_to_save: the modules named *classifier).
HEAD_PREFIXES = ("classifier/", "pre_classifier/")


# ----------------------------------------------------------------------------------------------- weight values


def dense(base: Any) -> jax.Array:
  """A base weight as a float array (int8 and NF4 dequantized)."""
  return base.dequantize() if isinstance(base, (int8.Int8Weight, NF4Weight)) else base


@flax.struct.dataclass
class LoRAWeight:
  """A target weight inside the model: the frozen base plus its adapters. It stands in for the array in the unchanged
  model code (`param[...]`, `.astype(compute dtype)`, `.shape`), and `Kernels.einsum` calls `contract`."""
  base: Any  # jax.Array [lead..., in..., out...] | int8.Int8Weight | NF4Weight
  a: jax.Array  # [lead..., in..., r]
  b: jax.Array  # [lead..., r, out...]
  scale: jax.Array  # alpha / r: [lead...]

  shape = property(lambda self: self.base.shape)
  ndim = property(lambda self: len(self.base.shape))
  dtype = property(lambda self: self.a.dtype)

  def __getitem__(self, index):
    if index is not Ellipsis:
      raise TypeError(f"a LoRA weight is read whole (param[...]), not indexed with {index!r}")
    return self

  def astype(self, dtype) -> "LoRAWeight":
    quantized = isinstance(self.base, (int8.Int8Weight, NF4Weight))
    base = self.base if quantized else self.base.astype(dtype)  # a quantized base is dequantized at the matmul
    return self.replace(base=base, a=self.a.astype(dtype), b=self.b.astype(dtype))

  def laid_out(self, axes: tuple, place) -> "LoRAWeight":
    """The weight with `place(array, logical axes)` applied to a float base and both factors (the rank axis
    unnamed), e.g. sharding.gather_fsdp's all-gather of one layer; `axes` are the base weight's."""
    if len(axes) != self.ndim or self.scale.ndim:  # only one layer's weight (inside the layer scan)
      return self
    n_in = self.a.ndim - 1
    base = self.base if isinstance(self.base, (int8.Int8Weight, NF4Weight)) else place(self.base, tuple(axes))
    return self.replace(base=base, a=place(self.a, tuple(axes[:n_in]) + (None,)),
                        b=place(self.b, (None,) + tuple(axes[n_in:])))

  def contract(self, subscripts: str, x: jax.Array, matmul, **kwargs) -> jax.Array:
    """`matmul(subscripts, x, W)` + scale * (x A) B, with W dequantized to x's dtype when it is quantized."""
    y = matmul(subscripts, x, dense(self.base).astype(x.dtype), **kwargs)
    dims = int8._dot_dims(subscripts, x.ndim, self.ndim)
    num_in = self.a.ndim - 1
    if dims is None or dims != (tuple(range(x.ndim - num_in, x.ndim)), tuple(range(num_in))):
      raise ValueError(f"LoRA needs a weight matmul contracting x's trailing and the weight's leading {num_in} axes, "
                       f"got {subscripts}")
    rank = self.a.shape[-1]
    x_NI = x.reshape(-1, math.prod(self.a.shape[:-1]))
    b_RO = (self.b * self.scale.astype(self.b.dtype)).reshape(rank, -1)  # the scale folded into the small factor
    delta_NO = low_rank_product(x_NI, self.a.reshape(-1, rank).astype(x.dtype), b_RO.astype(x.dtype))
    return y + delta_NO.reshape(y.shape).astype(y.dtype)

  def lookup(self, ids: jax.Array) -> jax.Array:
    raise ValueError("LoRA adapts matmul weights; a lookup table has no adapters (remove it from lora.targets)")

  @classmethod
  def concatenate(cls, weights: list["LoRAWeight"], axis: int) -> "LoRAWeight | None":
    """One weight for one matmul (fused q/k/v): the bases joined along output `axis`, the A factors side by side
    along the rank, the B factors (each times its scale) block-diagonal. One layer's weights only (inside the
    layer scan); None for stacked ones."""
    num_in = weights[0].a.ndim - 1
    if axis < num_in or any(w.scale.ndim for w in weights):
      return None
    b_axis = axis - num_in + 1
    sizes = [w.b.shape[b_axis] for w in weights]
    blocks = []
    for i, w in enumerate(weights):
      pad = [(0, 0)] * w.b.ndim
      pad[b_axis] = (sum(sizes[:i]), sum(sizes[i + 1:]))
      blocks.append(jnp.pad(w.b * w.scale.astype(w.b.dtype), pad))
    return cls(jnp.concatenate([dense(w.base).astype(w.a.dtype) for w in weights], axis=axis),
               jnp.concatenate([w.a for w in weights], axis=-1), jnp.concatenate(blocks, axis=0),
               jnp.ones((), weights[0].scale.dtype))

@jax.custom_vjp
def low_rank_product(x_NI: jax.Array, a_IR: jax.Array, b_RO: jax.Array) -> jax.Array:
  """(x A) B. Ours rather than autodiff's backward: autodiff forms dA as x^T (g B^T), and XLA:CPU transposes the
  whole activation x for it; here dA is computed as ((g B^T)^T x)^T, so only [N, r] and [r, I] are transposed."""
  return (x_NI @ a_IR) @ b_RO


def _low_rank_forward(x_NI, a_IR, b_RO):
  xa_NR = x_NI @ a_IR
  return xa_NR @ b_RO, (x_NI, a_IR, b_RO, xa_NR)


def _low_rank_backward(residuals, g_NO):
  x_NI, a_IR, b_RO, xa_NR = residuals
  g_xa_NR = g_NO @ b_RO.T
  return g_xa_NR @ a_IR.T, (g_xa_NR.T @ x_NI).T, xa_NR.T @ g_NO


low_rank_product.defvjp(_low_rank_forward, _low_rank_backward)


nnx.register_data_type(LoRAWeight)


# ----------------------------------------------------------------------------------------------- the plan


_flat = lambda tree: traverse_util.flatten_dict(tree, sep="/")  # {"a/b/c": leaf}
_nested = lambda flat: traverse_util.unflatten_dict(flat, sep="/")


def num_inputs(path: str) -> int:
  """Leading (contracted) axes of a target weight, per layer: w_o [H, K, D] has two, the others one."""
  return len(int8.CONTRACTED_AXES[path.rsplit("/", 1)[-1]])


@dataclasses.dataclass(frozen=True)
class Plan:
  """Which weights get adapters and how: resolved against one model's parameter shapes by `make_plan`."""
  targets: tuple[str, ...]  # parameter paths ("blocks/attn/w_q") with adapters
  rank: int
  alpha: float
  base: str  # float | int8 | nf4
  stacked: frozenset[str]  # target paths with a leading [L] axis
  axes: dict  # every parameter path -> its logical axes (with "layers" for stacked ones)

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


def make_plan(abstract_state: nnx.State, lora: LoRAConfig) -> Plan:
  """Resolves `lora.targets` on a model's (abstract) parameters; one-line errors for targets that match nothing and
  ranks larger than a weight's smaller side."""
  axes, shapes, stacked = {}, {}, set()
  for path, variable in nnx.to_flat_state(abstract_state):
    name = "/".join(map(str, path))
    value = variable.get_value()
    names = tuple(variable.get_metadata().get("axes") or (None,) * value.ndim)
    if len(names) == value.ndim - 1:  # stacked blocks: the leading [L] axis
      names = ("layers",) + names
      stacked.add(name)
    axes[name], shapes[name] = names, tuple(value.shape)
  candidates = [p for p in shapes if p.rsplit("/", 1)[-1] in MATMUL_WEIGHTS and "blocks/" in p]
  wanted = [t.strip() for t in lora.targets.split(",") if t.strip()]
  chosen: list[str] = []
  for entry in wanted:
    names = TARGET_GROUPS.get(entry, MATMUL_WEIGHTS if entry == "all" else (entry,))
    hits = [p for p in candidates if p.rsplit("/", 1)[-1] in names or (("/" in entry) and p.endswith(entry))]
    if experts := [p for p in hits if "experts" in axes[p]]:
      raise ValueError(f"lora.targets={lora.targets}: {entry!r} takes the mixture-of-experts weights ({experts[0]}), "
                       "which adapters are not built for; use lora.targets=attention")
    if not hits:
      known = sorted({p.rsplit("/", 1)[-1] for p in candidates})
      raise ValueError(f"lora.targets: {entry!r} matches no weight of this model; use attention, mlp, all or some "
                       f"of {', '.join(known)}")
    chosen += [p for p in hits if p not in chosen]
  for path in chosen:
    lead = 1 if path in stacked else 0
    n_in = num_inputs(path)
    shape = shapes[path][lead:]
    in_size, out_size = math.prod(shape[:n_in]), math.prod(shape[n_in:])
    if lora.rank > min(in_size, out_size):
      raise ValueError(f"lora.rank={lora.rank} exceeds the smaller side of weight {path} ({in_size} x {out_size}); "
                       f"lower lora.rank to at most {min(in_size, out_size)}")
    if lora.base == "nf4" and in_size % (2 * NF4_BLOCK):
      raise ValueError(f"lora.base=nf4 needs each target weight's input size divisible by {2 * NF4_BLOCK}; {path} has "
                       f"{in_size}: use lora.base=int8 or other lora.targets")
  return Plan(tuple(chosen), lora.rank, float(lora.alpha), lora.base, frozenset(p for p in chosen if p in stacked),
              axes)


def _quantize_base(plan: Plan, path: str, w: jax.Array) -> Any:
  lead = 1 if path in plan.stacked else 0
  n_in = num_inputs(path)
  if plan.base == "int8":  # per output channel, as jaxlm.compress.quantization's weight-only int8
    return int8.Int8Weight(int8.quantize_array(w, tuple(range(lead, lead + n_in))))
  if plan.base == "nf4":
    return nf4_quantize(w, n_in, lead)
  return w


def freeze(plan: Plan, params: dict) -> dict:
  """The frozen part of a model's plain parameter tree: every parameter but the head, target weights in the plan's
  base storage with their scale."""
  frozen = {}
  for path, value in _flat(params).items():
    if path.startswith(HEAD_PREFIXES):
      continue
    if path in plan.targets:
      lead = value.shape[:1] if path in plan.stacked else ()
      value = {"lora_base": _quantize_base(plan, path, value),
               "lora_scale": jnp.full(lead, plan.scale, jnp.float32)}
    frozen[path] = value
  return _nested(frozen)


def init_adapters(plan: Plan, params: dict, key: jax.Array, dtype=jnp.float32) -> dict:
  """Fresh trainable tree: A he-uniform (as qwix and peft's kaiming init), B zeros, plus the head's parameters."""
  flat = _flat(params)
  trainable = {p: v for p, v in flat.items() if p.startswith(HEAD_PREFIXES)}
  for i, path in enumerate(plan.targets):
    w = flat[path]
    lead = w.shape[:1] if path in plan.stacked else ()
    n_in = num_inputs(path)
    in_shape, out_shape = w.shape[len(lead):len(lead) + n_in], w.shape[len(lead) + n_in:]
    fan_in = math.prod(in_shape)
    bound = math.sqrt(6.0 / fan_in)
    a = jax.random.uniform(jax.random.fold_in(key, i), lead + in_shape + (plan.rank,), dtype, -bound, bound)
    trainable[path] = {"lora_a": a, "lora_b": jnp.zeros(lead + (plan.rank,) + out_shape, dtype)}
  return _nested(trainable)


def combine(trainable: dict, frozen: dict) -> dict:
  """The model's parameter tree (a pure dict for nnx.merge): target weights as LoRAWeights. Works on trees of
  arrays, abstract arrays or shardings alike."""
  if isinstance(frozen, dict) and "lora_base" in frozen:
    return LoRAWeight(frozen["lora_base"], trainable["lora_a"], trainable["lora_b"], frozen["lora_scale"])
  if not isinstance(frozen, dict):
    return frozen
  trainable = trainable or {}
  out = {k: combine(trainable.get(k), v) for k, v in frozen.items()}
  out.update({k: v for k, v in trainable.items() if k not in frozen})
  return out


@jax.jit
def merge(params: dict) -> dict:
  """A plain float tree with every adapter folded in: W + scale * A B (quantized bases dequantized). One compiled
  program (eagerly, every small op would compile on its own)."""
  def fold(value):
    if not isinstance(value, LoRAWeight):
      return value
    n_in = value.a.ndim - 1 - value.scale.ndim
    lead = value.scale.ndim
    outs = list(range(lead + n_in + 1, value.b.ndim + n_in))
    delta = jnp.einsum(value.a, list(range(lead + n_in + 1)), value.b, list(range(lead)) + [lead + n_in] + outs,
                       list(range(lead + n_in)) + outs)
    scale = value.scale.reshape(value.scale.shape + (1,) * (delta.ndim - lead))
    return dense(value.base).astype(jnp.float32) + scale * delta.astype(jnp.float32)
  return jax.tree.map(fold, params, is_leaf=lambda x: isinstance(x, LoRAWeight))


# ----------------------------------------------------------------------------------------------- shardings, bytes


def _leaf_axes(plan: Plan, key_path: tuple, shape: tuple[int, ...]) -> tuple:
  """Logical axes of one leaf of a trainable or frozen tree, from the parameter it belongs to."""
  names = [getattr(k, "key", getattr(k, "name", None)) for k in key_path]
  cut = next((i for i, n in enumerate(names) if n in ("lora_a", "lora_b", "lora_base", "lora_scale")), len(names))
  path, rest = "/".join(map(str, names[:cut])), names[cut:]
  axes = plan.axes[path]
  if not rest:
    return axes
  lead = ("layers",) if path in plan.stacked else ()
  body = axes[len(lead):]
  n_in = num_inputs(path)
  kind = rest[0]
  # The rank axis of a factor without the base's FSDP axis (`embed`) takes it, so FSDP shards every factor.
  rank_axis = lambda side: None if "embed" in side else "embed"
  if kind == "lora_a":
    return lead + body[:n_in] + (rank_axis(body[:n_in]),)
  if kind == "lora_b":
    return lead + (rank_axis(body[n_in:]),) + body[n_in:]
  if kind == "lora_scale":
    return lead
  if len(shape) == len(axes):  # a float base, int8 values or their per-channel scales
    return axes
  return lead + (body[0],) + body[n_in:]  # NF4 codes / absmax: [lead, in (flattened), out...]


def shardings_of(plan: Plan, abstract_tree: Any, mesh: Mesh) -> Any:
  """NamedShardings for a trainable or frozen (abstract) tree: each leaf laid out like its parameter."""
  return jax.tree_util.tree_map_with_path(
      lambda kp, x: NamedSharding(mesh, sharding.logical_to_spec(_leaf_axes(plan, kp, x.shape), x.shape, mesh)),
      abstract_tree)


def per_device_bytes(tree: Any) -> int:
  """Bytes one device holds of a tree of (abstract) sharded arrays: the largest shard of each leaf."""
  total = 0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
    total += math.prod(shape) * jnp.dtype(x.dtype).itemsize
  return int(total)


def count_params(tree: Any) -> int:
  return int(sum(math.prod(x.shape) for x in jax.tree.leaves(tree)))


def state_bytes(state: dict) -> dict[str, int]:
  """Per-device bytes of a train state (arrays or abstract arrays with shardings), by part, and the trainable
  parameter count. Works for full training too (no "frozen": the whole model is "params")."""
  params = state["params"]
  adapters = {k: v for k, v in _flat(params).items() if "lora_" in k}
  head = {k: v for k, v in _flat(params).items() if "lora_" not in k}
  out = {
      "frozen_base_bytes": per_device_bytes(state.get("frozen", {})),
      "adapter_bytes": per_device_bytes(adapters) if "frozen" in state else 0,
      "trainable_bytes": per_device_bytes(params),
      "optimizer_state_bytes": per_device_bytes(state["opt_state"]),
      "trainable_params": count_params(params),
      "head_params": count_params(head) if "frozen" in state else 0,
  }
  out["state_bytes"] = out["frozen_base_bytes"] + out["trainable_bytes"] + out["optimizer_state_bytes"]
  return out


# ----------------------------------------------------------------------------------------------- the train state


@dataclasses.dataclass(frozen=True)
class LoRASplit:
  """LoRA as the train state's trainable/frozen split (jaxlm.training.state.ParamSplit): the adapters and the head
  train, the rest is frozen (target weights in the plan's base storage). `empty_base`: the frozen weights start as
  zeros, for a checkpoint to fill (streaming.load_base), so that no float copy of the base is ever built (XLA drops
  the unused random init)."""
  plan: Plan
  empty_base: bool = False

  def init(self, params: dict, seed: int) -> tuple[dict, dict]:
    trainable = init_adapters(self.plan, params, jax.random.fold_in(jax.random.key(seed), 0x10A))
    frozen = freeze(self.plan, params)
    if self.empty_base:
      frozen = _nested({p: v if p.endswith("/lora_scale") else jax.tree.map(jnp.zeros_like, v)
                        for p, v in _flat(frozen).items()})
    return trainable, frozen

  def shardings(self, abstract_params: nnx.State, trainable: Any, frozen: Any, mesh: Mesh) -> tuple[Any, Any]:
    return shardings_of(self.plan, trainable, mesh), shardings_of(self.plan, frozen, mesh)

  def combine(self, trainable: Any, frozen: Any) -> Any:
    return combine(trainable, frozen)


def split_for(make_model, lora: LoRAConfig, empty_base: bool = False) -> LoRASplit:
  """The LoRA split of `make_model(rngs)`'s model: `lora.targets` resolved on its parameter shapes."""
  abstract = nnx.split(nnx.eval_shape(lambda: make_model(nnx.Rngs(0))))[1]
  return LoRASplit(make_plan(abstract, lora), empty_base)


def refreeze(plan: Plan, state: dict, shardings: dict, plain: dict) -> dict:
  """`state` with its frozen base (and head) taken from `plain`, a plain float parameter tree (e.g. a pretrained
  checkpoint merged into the random init); the adapters are kept."""
  head = {p: v for p, v in _flat(plain).items() if p.startswith(HEAD_PREFIXES)}
  frozen = jax.jit(lambda p: freeze(plan, p), out_shardings=shardings["frozen"])(plain)
  params = _nested({**_flat(state["params"]), **head})
  params = jax.device_put(params, shardings["params"])
  return {**state, "frozen": frozen, "params": params}


def plain_params(state: dict) -> dict:
  """A plain float tree of the whole model (adapters merged in): what a checkpoint of full training would hold."""
  return merge(combine(state["params"], state["frozen"]))


def load_base(state: dict, shardings: dict, lora_config: LoRAConfig, make_model, mesh: Mesh, merge_into
              ) -> tuple[dict, Any]:
  """A fresh LoRA state with a pretrained checkpoint as its frozen base: `merge_into(plain params, their
  shardings) -> (plain params, extra)` puts the checkpoint into the model's plain tree (e.g.
  pretrained.merge_pretrained); the result is frozen (quantized as lora.base says). Returns (state, extra).
  The whole float model is built on the way: runs load with jaxlm/interop/streaming.py (one leaf at a time, the
  same state); this is the reference its tests and benchmarks/qlora_load_peak.py compare against."""
  abstract = nnx.split(nnx.eval_shape(lambda: make_model(nnx.Rngs(0))))[1]
  plain, extra = merge_into(plain_params(state), sharding.param_shardings(abstract, mesh))
  return refreeze(make_plan(abstract, lora_config), state, shardings, plain), extra
