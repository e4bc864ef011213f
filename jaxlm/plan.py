"""Capacity and cost planner: will a model fit, how fast will it train, and what will the run cost, before renting.

Two ways to get a device's memory, used together:
  predicted  `predict_memory`: exact bytes of the sharded train state (params, Adam moments) from the shardings,
             the gradients, and the activations JAX saves for the backward pass, counted by tracing `jax.vjp` of the
             loss on one device's shard (`shard_map`, shapes only, nothing compiled or allocated). Seconds per
             model; affine in the micro-batch, so the largest micro-batch that fits is solved, not searched.
  compiled   `compile_train_step` + `compiled_memory_bytes`: the real train step compiled by XLA for simulated CPU
             devices (XLA_FLAGS=--xla_force_host_platform_device_count=N), its buffer assignment read from
             `memory_analysis()`, its collective bytes from the HLO (jaxlm/hlo.py). Tens of seconds per program on a
             CPU, so the planner compiles the chosen candidates only and reports both numbers.
Step time comes from a roofline (`predict_step_time`): matmul FLOPs at the device's sustained matmul rate, plus the
bytes the step moves through memory at its bandwidth, plus the collective bytes at the interconnect bandwidth.
Cost (`run_cost`) turns a token budget into steps, wall time and dollars on on-demand and spot devices, with the
time to write checkpoints and the work lost to preemptions.

Hardware profiles live in `jaxlm/hardware.json` (edit it, or pass another file).
Dimension names as in jaxlm/models/layers.py: B batch, T sequence, D d_model, F MLP width, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxlm import hlo, optim, sharding, telemetry, train
from jaxlm.config import Config, ModelConfig, TrainConfig

PROFILES_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware.json")
GIB = 2**30


# ----------------------------------------------------------------------------------------------- hardware profiles


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One device type; the fields are documented in jaxlm/hardware.json."""
  name: str
  memory_gib: float
  bf16_flops: float
  hbm_bytes_per_sec: float
  interconnect_bytes_per_sec: float
  usd_per_hour_on_demand: float
  usd_per_hour_spot: float
  matmul_efficiency: float = 0.7
  usable_memory_fraction: float = 0.9
  max_devices: int = 8
  spot_preemptions_per_hour: float = 0.1
  description: str = ""

  @property
  def usable_bytes(self) -> float:
    return self.memory_gib * GIB * self.usable_memory_fraction

  @property
  def matmul_flops(self) -> float:
    """The sustained matmul rate the roofline uses."""
    return self.bf16_flops * self.matmul_efficiency


def load_hardware(names: Sequence[str] | None = None, path: str = PROFILES_PATH) -> list[Hardware]:
  """The named profiles (all when `names` is empty), in the order given; an unknown name is a one-line error."""
  if not os.path.isfile(path):
    raise ValueError(f"hardware file {path!r} does not exist; fix --hardware_file (default: {PROFILES_PATH})")
  with open(path) as f:
    profiles = json.load(f)["profiles"]
  names = list(names or profiles)
  unknown = [n for n in names if n not in profiles]
  if unknown:
    raise ValueError(f"--hardware={unknown[0]} is not a profile in {path}; known: {', '.join(profiles)}")
  fields = {f.name for f in dataclasses.fields(Hardware)}
  result = []
  for name in names:
    extra = sorted(set(profiles[name]) - fields)
    if extra:
      raise ValueError(f"hardware profile {name!r} in {path} has unknown field {extra[0]!r}; known: {sorted(fields)}")
    result.append(Hardware(name=name, **profiles[name]))
  return result


# ----------------------------------------------------------------------------------------------- candidates


def mesh_shapes(num_devices: int) -> list[tuple[int, int, int]]:
  """Every (data, fsdp, tensor) of powers of two whose product is `num_devices`: DP, FSDP, TP and their mixes."""
  powers = [2**i for i in range(int(math.log2(num_devices)) + 1)]
  return [(d, f, num_devices // (d * f)) for d in powers for f in powers if num_devices % (d * f) == 0]


def mesh_problem(config: Config, sizes: tuple[int, int, int]) -> str | None:
  """Why a mesh cannot run this model and batch (None when it can): the same checks as training."""
  data, fsdp, tensor = sizes
  m = config.model
  if m.num_heads % tensor:
    return f"model.num_heads={m.num_heads} is not divisible by mesh.tensor={tensor}"
  if m.mlp_width % tensor:
    return f"model MLP width {m.mlp_width} is not divisible by mesh.tensor={tensor}"
  if config.train.batch_size % (data * fsdp):
    return f"train.batch_size={config.train.batch_size} is not divisible by mesh.data*mesh.fsdp={data * fsdp}"
  return None


def accumulation_splits(batch_size: int, data_shards: int) -> list[int]:
  """grad_accum values that split the global batch into equal micro-batches, each divisible over the data shards."""
  return [k for k in range(1, batch_size + 1) if batch_size % k == 0 and (batch_size // k) % data_shards == 0]


# ----------------------------------------------------------------------------------------------- abstract train step


def with_mesh(config: Config, sizes: tuple[int, int, int], grad_accum: int | None = None) -> Config:
  """The config on mesh `sizes` (other mesh settings, e.g. gradient_sync, kept), optionally with `grad_accum`."""
  train_config = config.train if grad_accum is None else dataclasses.replace(config.train, grad_accum=grad_accum)
  mesh = dataclasses.replace(config.mesh, data=sizes[0], fsdp=sizes[1], tensor=sizes[2], preset="")
  return dataclasses.replace(config, mesh=mesh, train=train_config)


def abstract_train_state(config: Config, mesh: Mesh, optimizer: optax.GradientTransformation):
  """(graphdef, state of ShapeDtypeStructs, state shardings): what `train.init_train_state` builds, unallocated."""
  graphdef, abstract_params = train.abstract_model(config.model)
  param_shardings = sharding.param_shardings(abstract_params, mesh)
  params = abstract_params.to_pure_dict()
  state = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
           "opt_state": jax.eval_shape(optimizer.init, params)}
  shardings = {
      "step": sharding.replicated(mesh),
      "params": param_shardings,
      "opt_state": optax.tree_map_params(optimizer, lambda _, s: s, state["opt_state"], param_shardings,
                                         transform_non_params=lambda _: sharding.replicated(mesh)),
  }
  state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)
  return graphdef, state, shardings


def abstract_batch(batch_size: int, seq_len: int) -> dict:
  """The shapes `data.make_train_iterator` yields: one global batch of `batch_size` rows."""
  shape = (batch_size, seq_len)
  return {"inputs": jax.ShapeDtypeStruct(shape, jnp.int32), "targets": jax.ShapeDtypeStruct(shape, jnp.int32),
          "segment_ids": jax.ShapeDtypeStruct(shape, jnp.int32), "positions": jax.ShapeDtypeStruct(shape, jnp.int32),
          "loss_mask": jax.ShapeDtypeStruct(shape, jnp.float32)}


def sharded_bytes(tree: Any, shardings: Any) -> int:
  """Bytes one device holds of `tree` laid out by `shardings` (the largest shard, exact for even splits)."""
  total = 0
  for x, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings)):
    total += math.prod(s.shard_shape(x.shape)) * jnp.dtype(x.dtype).itemsize
  return total


def compile_train_step(config: Config, devices: Sequence[jax.Device] | None = None):
  """The train step `train.jit_steps` builds, compiled for `config.mesh` over `devices` (simulated CPU devices are
  fine: nothing is allocated or run). Returns the compiled executable."""
  mesh = sharding.make_mesh(config.mesh, devices)
  train.check_mesh_fits_model(config.model, mesh)
  optimizer = optim.make_optimizer(config.train)
  graphdef, state, shardings = abstract_train_state(config, mesh, optimizer)
  train_step, _ = train.jit_steps(graphdef, optimizer, config, mesh, shardings)
  return train_step.lower(state, abstract_batch(config.train.batch_size, config.data.seq_len)).compile()


def compiled_memory_bytes(compiled) -> int:
  """Peak bytes per device of a compiled program: live arguments and outputs (donated ones counted once) plus the
  temporaries of XLA's buffer assignment."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


def compiled_collective_bytes(compiled, num_devices: int) -> dict[str, float]:
  return hlo.collective_bytes(compiled.as_text(), num_devices)


# ----------------------------------------------------------------------------------------------- memory model


def _abstract_mesh(sizes: tuple[int, int, int]):
  names = sharding.MESH_AXES
  try:
    return jax.sharding.AbstractMesh(sizes, names)
  except TypeError:  # older signature: a tuple of (name, size) pairs
    return jax.sharding.AbstractMesh(tuple(zip(names, sizes)))


def saved_activation_bytes(model: ModelConfig, seq_len: int, tensor: int, local_batch: int) -> int:
  """Bytes one device keeps from the forward pass for the backward pass, for `local_batch` sequences.

  Traces (never compiles) `jax.vjp` of the training loss on one device's shard: `shard_map` over a `tensor`-way
  mesh hands the model its tensor-parallel parameter shards (heads, MLP width, vocabulary split as in
  jaxlm.sharding.RULES; FSDP shards arrive gathered, as `sharding.gather_fsdp` lays them out for compute), so the
  residuals have exactly the per-device shapes: [B, T, D] activations whole, [B, T, F/tp] and [B, H/tp, T, T]
  split. Residuals that are the parameters themselves cost nothing extra and are not counted; copies (a bf16 cast
  of an f32 weight) are. Remat policies change what is saved, and this count follows them.
  """
  graphdef, abstract_params = train.abstract_model(model)
  mesh = _abstract_mesh((1, 1, tensor))
  shardings = sharding.param_shardings(abstract_params, mesh)
  specs = jax.tree.map(lambda s: s.spec, shardings)
  # The abstract inputs carry the shardings that in_specs name: jax >= 0.11 checks that they agree.
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract_params.to_pure_dict(), shardings)
  batch = abstract_batch(local_batch, seq_len)
  loss_fn = train.make_loss_fn(graphdef)
  counted: list[int] = []

  def per_device(params, batch):
    _, vjp_fn = jax.vjp(lambda p: loss_fn(p, batch), params)
    inputs = {id(x) for x in jax.tree.leaves((params, batch))}
    counted.append(sum(math.prod(r.shape) * r.dtype.itemsize for r in jax.tree.leaves(vjp_fn)
                       if id(r) not in inputs))
    return jnp.zeros((), jnp.float32)

  traced = jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_vma=False)
  jax.eval_shape(traced, params, batch)
  return counted[0]


# Transient bytes while one layer runs its backward pass, as a fraction of that layer's saved activations: the
# activation gradients in flight (without remat), or the recomputed forward of the layer (remat=full). Calibrated
# against XLA's buffer assignment on the CPU for 4 programs (configs A, B, D of WORKSPACE.md, 2026-11-29: 0.2-0.43
# without remat, 0.9 with full remat); `dots` (matmul outputs kept) is not measured and sits in between.
BACKWARD_WORKING_FRACTION = {"none": 1 / 3, "dots": 0.5, "full": 0.9}
# Parameter-sized f32 trees alive during the optimizer phase besides the state: the gradient (sum), the gradient
# divided by the token count, the clipped gradient and the Adam update (jaxlm/optim.py, train.make_train_step). It
# is the peak when activations are small: GPT-2 XL with 32 micro-batches of 1 compiled to state + 4.0 x params.
OPTIMIZER_PHASE_TREES = 4


@dataclasses.dataclass(frozen=True)
class ActivationModel:
  """Saved activations per device as an affine function of the local micro-batch b (sequences on one device):
  total(b) = total_fixed + total_per_sequence * b; one layer's share likewise (for the backward working set)."""
  total_fixed: float
  total_per_sequence: float
  layer_fixed: float
  layer_per_sequence: float
  unremat_fixed: float = 0.0  # the same total without remat: the activation volume the forward pass produces
  unremat_per_sequence: float = 0.0

  def total(self, local_batch: int) -> float:
    return self.total_fixed + self.total_per_sequence * local_batch

  def layer(self, local_batch: int) -> float:
    return self.layer_fixed + self.layer_per_sequence * local_batch

  def unremat(self, local_batch: int) -> float:
    return self.unremat_fixed + self.unremat_per_sequence * local_batch


def activation_model(config: Config, tensor: int) -> ActivationModel:
  return _activation_model(config.model, config.data.seq_len, tensor)


@functools.lru_cache(maxsize=None)
def _activation_model(model: ModelConfig, seq_len: int, tensor: int) -> ActivationModel:
  """Four traces (1 and 2 sequences, num_layers and num_layers + 1 layers; about a second each), cached."""
  unremat = dataclasses.replace(model, remat="none")
  deeper = dataclasses.replace(unremat, num_layers=model.num_layers + 1)
  u1, u2 = (saved_activation_bytes(unremat, seq_len, tensor, b) for b in (1, 2))
  t1, t2 = (u1, u2) if model.remat == "none" else (saved_activation_bytes(model, seq_len, tensor, b) for b in (1, 2))
  # One layer's activations as the backward of that layer sees them: without remat, whatever the config says.
  l1, l2 = (saved_activation_bytes(deeper, seq_len, tensor, b) - u for b, u in ((1, u1), (2, u2)))
  return ActivationModel(total_fixed=2 * t1 - t2, total_per_sequence=t2 - t1, layer_fixed=2 * l1 - l2,
                         layer_per_sequence=l2 - l1, unremat_fixed=2 * u1 - u2, unremat_per_sequence=u2 - u1)


@dataclasses.dataclass(frozen=True)
class StateBytes:
  """Per-device bytes of the train state on one mesh, from the shardings (exact)."""
  state: int  # params + optimizer state + step counter
  params_f32: int  # the params (and so each gradient tree) in f32
  layer_params_f32: float  # one layer's params on a device of the tensor axis: what FSDP gathers per layer


def state_bytes(config: Config, sizes: tuple[int, int, int]) -> StateBytes:
  return _state_bytes(config.model, dataclasses.replace(config.train, grad_accum=1, batch_size=1), sizes)


@functools.lru_cache(maxsize=None)
def _state_bytes(model: ModelConfig, train_config: TrainConfig, sizes: tuple[int, int, int]) -> StateBytes:
  mesh = _abstract_mesh(sizes)
  optimizer = optim.make_optimizer(train_config)
  _, abstract_params = train.abstract_model(model)
  param_shardings = sharding.param_shardings(abstract_params, mesh)
  params = abstract_params.to_pure_dict()
  opt_state = jax.eval_shape(optimizer.init, params)
  opt_shardings = optax.tree_map_params(optimizer, lambda _, s: s, opt_state, param_shardings,
                                        transform_non_params=lambda _: sharding.replicated(mesh))
  params_f32 = sum(math.prod(s.shard_shape(x.shape)) * 4
                   for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(param_shardings)))
  stacked = sum(math.prod(v.get_value().shape) * 4 for path, v in nnx.to_flat_state(abstract_params)
                if "blocks" in map(str, path))
  return StateBytes(state=sharded_bytes(params, param_shardings) + sharded_bytes(opt_state, opt_shardings) + 4,
                    params_f32=params_f32, layer_params_f32=stacked / model.num_layers / sizes[2])


def predict_memory(config: Config, sizes: tuple[int, int, int], grad_accum: int) -> dict[str, float]:
  """Predicted peak bytes per device of the train step, by part, plus `total`. No compilation.

    state           params + Adam moments + step, exact from the shardings (jaxlm.sharding.RULES)
    batch           the device's rows of the global batch (all micro-batches)
    gradients       f32 gradients in the parameters' layout; with accumulation also the running sum
    activations     what the forward pass saves for the backward pass (`saved_activation_bytes`)
    working         the backward pass's transient: a fraction of one layer's activations, plus under FSDP one
                    gathered layer of parameters and its unreduced gradient
    optimizer_extra what the optimizer phase holds beyond the backward phase, when more: OPTIMIZER_PHASE_TREES f32
                    parameter-sized trees (0 when the backward phase is the peak, as it is for large micro-batches)
  """
  data, fsdp, tensor = sizes
  static = state_bytes(config, sizes)
  activations = activation_model(config, tensor)
  local_batch = config.train.batch_size // grad_accum // (data * fsdp)
  parts = {
      "state": float(static.state),
      "batch": float(config.train.batch_size // (data * fsdp) * config.data.seq_len * 5 * 4),
      "gradients": float(static.params_f32 * (2 if grad_accum > 1 else 1)),
      "activations": activations.total(local_batch),
      "working": (BACKWARD_WORKING_FRACTION[config.model.remat] * activations.layer(local_batch)
                  + (2 * static.layer_params_f32 if fsdp > 1 else 0.0)),
  }
  backward_phase = parts["gradients"] + parts["activations"] + parts["working"]
  parts["optimizer_extra"] = max(0.0, OPTIMIZER_PHASE_TREES * static.params_f32 - backward_phase)
  parts["total"] = sum(parts.values())
  return parts


def largest_local_micro_batch(config: Config, sizes: tuple[int, int, int], usable_bytes: float) -> int:
  """The most sequences one device can hold per micro-batch within `usable_bytes` (0 if not even one), with
  accumulation on (memory is affine in the micro-batch, so this is solved, not searched)."""
  at_one = predict_memory(config, sizes, grad_accum=config.train.batch_size // (sizes[0] * sizes[1]))
  if at_one["total"] > usable_bytes:
    return 0
  activations = activation_model(config, sizes[2])
  per_sequence = (activations.total_per_sequence
                  + BACKWARD_WORKING_FRACTION[config.model.remat] * activations.layer_per_sequence)
  backward_at_one = at_one["total"] - at_one["optimizer_extra"]  # the part that grows with the micro-batch
  return 1 + int((usable_bytes - backward_at_one) // per_sequence)


# ----------------------------------------------------------------------------------------------- step time


# Bytes the non-matmul work of a step moves per micro-batch: the forward writes the saved activations and the
# backward reads them (SAVED_PASSES x saved), and the elementwise passes (norms, softmax, GELU, their gradients)
# touch the whole activation volume of the forward (what it would save without remat) about once more each way
# (ELEMENTWISE_PASSES x that volume; remat recomputes the forward, half again). Set from that count, not fitted;
# WORKSPACE.md (2026-11-29) has the CPU errors it gives.
SAVED_PASSES = 2.0
ELEMENTWISE_PASSES = 2.0
REMAT_TRAFFIC = {"none": 1.0, "dots": 1.5, "full": 1.5}
# The optimizer step reads gradients, params, both Adam moments and writes three of them back (7), and the
# gradient/update/param norms and the finite-step select read them again (5): in units of the f32 params per device.
OPTIMIZER_PASSES = 12.0


def analytic_collective_bytes(config: Config, sizes: tuple[int, int, int], grad_accum: int,
                              param_bytes_f32: float) -> float:
  """Bytes each device sends per step with ring collectives, when no compiled HLO is at hand.

  `param_bytes_f32` is the whole model's f32 parameter bytes. DP: an all-reduce of the gradients, in every
  micro-batch under `gspmd` (GSPMD reduces inside the accumulation loop: measured 2x the bytes for 2
  micro-batches) and once with `shard_map` (what `auto` picks for pure data parallelism). FSDP: each
  micro-batch all-gathers the weights for the forward and again for the backward, and reduce-scatters the
  gradients. TP: all-reduces of the [b, T, D] activations: per layer two forward (attention and MLP outputs) and
  four backward (the input gradients of the q, k, v projections are reduced separately, plus the MLP's), and one
  each for the vocabulary-sharded embedding lookup and LM head: 6 L + 2 per micro-batch, as GSPMD's HLO shows.
  """
  data, fsdp, tensor = sizes
  m = config.model
  shard = param_bytes_f32 / tensor
  total = 0.0
  if data > 1:
    sync = train.resolve_gradient_sync(config.mesh.gradient_sync, dict(zip(("data", "fsdp", "tensor"), sizes)),
                                       grad_accum)
    reductions = grad_accum if sync == "gspmd" else 1
    total += reductions * 2 * (data - 1) / data * shard / fsdp
  if fsdp > 1:
    total += grad_accum * 3 * (fsdp - 1) / fsdp * shard
  if tensor > 1:
    itemsize = jnp.dtype(m.compute_dtype).itemsize
    local_batch = config.train.batch_size // grad_accum // (data * fsdp)
    activation = local_batch * config.data.seq_len * m.d_model * itemsize
    total += grad_accum * (6 * m.num_layers + 2) * 2 * (tensor - 1) / tensor * activation
  return total


def predict_step_time(config: Config, sizes: tuple[int, int, int], grad_accum: int, hardware: Hardware,
                      activations: ActivationModel, param_bytes_per_device: float, collective_bytes: float
                      ) -> dict[str, float]:
  """Roofline of one optimizer step on one device, by part (seconds), plus `step_time_sec` and `mfu`.

    compute   matmul FLOPs (telemetry.flops_per_token; plus the recomputed forward under remat=full) at the
              device's sustained matmul rate
    memory    the bytes of the non-matmul work (saved activations written and read, elementwise passes over the
              forward's activations, more under remat; OPTIMIZER_PASSES x f32 params) at the memory bandwidth
    network   collective bytes per device at the interconnect bandwidth, not overlapped (an upper bound: XLA
              overlaps some of it with compute on GPUs and TPUs)
  The parts run one after another (matmul kernels are compute bound, the rest memory bound), so they add up.
  """
  data, fsdp, tensor = sizes
  devices = data * fsdp * tensor
  tokens = config.train.batch_size * config.data.seq_len
  model_flops = telemetry.flops_per_token(config.model, config.data.seq_len) * tokens
  executed_flops = model_flops * (4 / 3 if config.model.remat == "full" else 1.0)
  local_batch = config.train.batch_size // grad_accum // (data * fsdp)
  activation_bytes = (SAVED_PASSES * activations.total(local_batch)
                      + ELEMENTWISE_PASSES * REMAT_TRAFFIC[config.model.remat] * activations.unremat(local_batch))
  memory_bytes = grad_accum * activation_bytes + OPTIMIZER_PASSES * param_bytes_per_device
  parts = {
      "compute_sec": executed_flops / devices / hardware.matmul_flops,
      "memory_sec": memory_bytes / hardware.hbm_bytes_per_sec,
      "network_sec": collective_bytes / hardware.interconnect_bytes_per_sec,
  }
  step = sum(parts.values())
  parts.update({"step_time_sec": step, "mfu": model_flops / (step * devices * hardware.bf16_flops),
                "tokens_per_sec": tokens / step})
  return parts


def as_compiled_on(config: Config, platform: str) -> Config:
  """The config whose memory the compiled program on `platform` shows. XLA's CPU backend has no bf16/f16 matmuls
  and carries those activations in f32 (measured: a bf16 llama step takes 186 MB there, its f32 twin 183 MB), so a
  CPU-compiled figure is checked against the f32 prediction; accelerators run the config as it is."""
  if platform != "cpu" or config.model.compute_dtype == "float32":
    return config
  return dataclasses.replace(config, model=dataclasses.replace(config.model, compute_dtype="float32"))


# ----------------------------------------------------------------------------------------------- cost


@dataclasses.dataclass(frozen=True)
class RunAssumptions:
  """What a run's wall time and cost depend on besides the step time; flags of experiments/plan.py."""
  tokens: float  # the token budget of the run
  checkpoint_every_steps: int  # as config.checkpoint.every_steps
  checkpoint_bytes_per_sec: float = 1e9  # per device, to local disk or a bucket (state bytes / this = save time)
  restart_sec: float = 600.0  # after a preemption: a new VM, start-up, compile, restore


def run_cost(step_time_sec: float, hardware: Hardware, devices: int, tokens_per_step: int, state_bytes: float,
             assumptions: RunAssumptions) -> dict[str, float]:
  """Steps, hours and dollars for the token budget on on-demand and on spot devices.

  On-demand: the steps plus one checkpoint save every `checkpoint_every_steps`. Spot: each preemption loses on
  average half a checkpoint interval of work plus a restart; at `spot_preemptions_per_hour` (per node) the expected
  wall time W solves W = W_on_demand + rate * W * loss, i.e. W = W_on_demand / (1 - rate * loss).
  """
  steps = math.ceil(assumptions.tokens / tokens_per_step)
  save_sec = state_bytes / assumptions.checkpoint_bytes_per_sec
  saves = math.ceil(steps / assumptions.checkpoint_every_steps)
  on_demand_hours = (steps * step_time_sec + saves * save_sec) / 3600
  interval_hours = (assumptions.checkpoint_every_steps * step_time_sec + save_sec) / 3600
  loss_hours = interval_hours / 2 + assumptions.restart_sec / 3600
  lost_fraction = hardware.spot_preemptions_per_hour * loss_hours
  spot_hours = on_demand_hours / (1 - lost_fraction) if lost_fraction < 1 else math.inf
  return {"steps": steps, "on_demand_hours": on_demand_hours, "spot_hours": spot_hours,
          "on_demand_usd": on_demand_hours * devices * hardware.usd_per_hour_on_demand,
          "spot_usd": spot_hours * devices * hardware.usd_per_hour_spot,
          "checkpoint_save_sec": save_sec, "spot_expected_preemptions": spot_hours * hardware.spot_preemptions_per_hour}


# ----------------------------------------------------------------------------------------------- the plan


def plan_mesh(config: Config, sizes: tuple[int, int, int], hardware: Hardware, assumptions: RunAssumptions
              ) -> dict[str, Any]:
  """One row of the plan: the fewest micro-batches (largest micro-batch) that fit `hardware` on this mesh, with its
  memory, step time, MFU and cost; when none fits, the row says so and what the smallest split needs."""
  data, fsdp, tensor = sizes
  usable = hardware.usable_bytes
  row: dict[str, Any] = {"hardware": hardware.name, "devices": data * fsdp * tensor, "mesh": "x".join(map(str, sizes)),
                         "data": data, "fsdp": fsdp, "tensor": tensor, "usable_memory_gib": usable / GIB}
  splits = accumulation_splits(config.train.batch_size, data * fsdp)
  chosen = None
  for grad_accum in splits:  # fewest micro-batches first: the fastest step that fits
    memory = predict_memory(config, sizes, grad_accum)
    if memory["total"] <= usable:
      chosen = grad_accum, memory
      break
  grad_accum, memory = chosen or (splits[-1], predict_memory(config, sizes, splits[-1]))
  static = state_bytes(config, sizes)
  collective = analytic_collective_bytes(config, sizes, grad_accum, state_bytes(config, (1, 1, 1)).params_f32)
  timing = predict_step_time(config, sizes, grad_accum, hardware, activation_model(config, tensor),
                             static.params_f32, collective)
  tokens_per_step = config.train.batch_size * config.data.seq_len
  row.update({
      "fits": chosen is not None, "grad_accum": grad_accum, "micro_batch": config.train.batch_size // grad_accum,
      "largest_local_micro_batch": largest_local_micro_batch(config, sizes, usable),
      "predicted_memory_gib": memory["total"] / GIB, "headroom_gib": (usable - memory["total"]) / GIB,
      "memory_parts_gib": {k: v / GIB for k, v in memory.items() if k != "total"},
      "collective_bytes": collective, "collective_source": "analytic",
      **timing,
      **run_cost(timing["step_time_sec"], hardware, data * fsdp * tensor, tokens_per_step, static.state, assumptions),
  })
  return row


def plan(config: Config, hardware: Sequence[Hardware], device_counts: Iterable[int] = (1, 2, 4, 8),
         assumptions: RunAssumptions | None = None) -> list[dict[str, Any]]:
  """Every valid mesh of every device count on every hardware profile, one row each (see `plan_mesh`); meshes that
  cannot run the model (heads or batch not divisible) are left out, and so are device counts over a profile's
  `max_devices`."""
  assumptions = assumptions or RunAssumptions(
      tokens=config.train.steps * config.train.batch_size * config.data.seq_len,
      checkpoint_every_steps=config.checkpoint.every_steps)
  rows = []
  for profile in hardware:
    for n in device_counts:
      if n > profile.max_devices:
        continue
      for sizes in mesh_shapes(n):
        if mesh_problem(config, sizes) is None:
          rows.append(plan_mesh(config, sizes, profile, assumptions))
  return rows


def recommend(rows: Sequence[dict[str, Any]], hardware: str) -> dict[str, Any] | None:
  """The cheapest fitting row of one hardware profile on on-demand devices (ties: fewer devices), or None."""
  fitting = [r for r in rows if r["hardware"] == hardware and r["fits"]]
  return min(fitting, key=lambda r: (r["on_demand_usd"], r["devices"])) if fitting else None


def does_not_fit_message(rows: Sequence[dict[str, Any]], hardware: str) -> str | None:
  """Plain words for a profile on which one device cannot hold the run: what it needs, and what would fit."""
  single = [r for r in rows if r["hardware"] == hardware and r["devices"] == 1]
  if not single or single[0]["fits"]:
    return None
  r = single[0]
  needed = r["predicted_memory_gib"]
  text = (f"does not fit on one {hardware}: even {r['grad_accum']} micro-batches of {r['micro_batch']} sequences "
          f"need {needed:.1f} GiB per device, {r['usable_memory_gib']:.1f} GiB usable")
  best = recommend(rows, hardware)
  if best is None:
    return text + f"; no mesh of up to {max(x['devices'] for x in rows if x['hardware'] == hardware)} devices fits"
  return (text + f"; fits on {best['devices']} devices with mesh data x fsdp x tensor = {best['mesh']} and "
          f"train.grad_accum={best['grad_accum']} ({best['predicted_memory_gib']:.1f} GiB per device)")
