"""Per-device memory and step time of the train step, predicted without compiling (jaxlm/planner/plan.py's models).

  memory     `predict_memory`: exact bytes of the sharded train state (params, optimizer state) from the shardings,
             the gradients, and the activations JAX saves for the backward pass, counted by tracing `jax.vjp` of the
             loss on one device's shard (`shard_map`, shapes only, nothing compiled or allocated). Seconds per
             model; affine in the micro-batch, so the largest micro-batch that fits is solved, not searched.
  step time  `predict_step_time`: a roofline of matmul FLOPs at the device's sustained matmul rate, plus the bytes
             the step moves through memory at its bandwidth, plus the collective bytes at the interconnect
             bandwidth (`analytic_collective_bytes`, or the compiled HLO's).
Both plan for the kernels the run will use on its hardware (`planned_kernels`: `auto` resolved for the target
platform, compute dtype and mesh); what cannot run on this host is traced through the registry's stand-ins, which
save and move the same bytes (jaxlm.kernels.runnable_on).
Dimension names as in jaxlm/models/layers.py: B batch, T sequence, D d_model, F MLP width, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.extend
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxlm import kernels as kernels_lib
from jaxlm.training import muon, optim
from jaxlm.parallel import sharding
from jaxlm.training import telemetry
from jaxlm.config import Config, KernelsConfig, ModelConfig, TrainConfig
from jaxlm.planner.hardware import Hardware
from jaxlm.kernels import Kernels
from jaxlm.models.gpt import GPT
from jaxlm.training import state as state_lib
from jaxlm.training import steps as steps_lib


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


# ----------------------------------------------------------------------------------------------- memory model


def _abstract_mesh(sizes: tuple[int, int, int]):
  names = sharding.MESH_AXES
  try:
    return jax.sharding.AbstractMesh(sizes, names)
  except TypeError:  # older signature: a tuple of (name, size) pairs
    return jax.sharding.AbstractMesh(tuple(zip(names, sizes)))


def planned_kernels(config: Config, sizes: tuple[int, int, int], platform: str | None = None) -> Kernels:
  """The kernels a run of `config` on mesh `sizes` (data, fsdp, tensor) of `platform` devices ("gpu", "tpu", "cpu";
  None: this host's) uses: `auto` resolved for that platform, the model's compute dtype and the mesh. An explicit
  choice that cannot run there is the registry's one-line error."""
  needs = config.model.kernel_needs
  return _resolve(config.kernels, config.model.compute_dtype, needs["head_dim"], platform or jax.default_backend(),
                  math.prod(sizes), sizes[2], needs["window"], needs["softcaps"])


@functools.lru_cache(maxsize=None)
def _resolve(kernels: KernelsConfig, compute_dtype: str, head_dim: int, platform: str, devices: int,
             tensor: int, window: bool, softcaps: tuple[str, ...]) -> Kernels:
  return kernels_lib.resolve(kernels, compute_dtype=compute_dtype, causal=True, head_dim=head_dim, platform=platform,
                             devices=devices, tensor=tensor, window=window, softcaps=softcaps)


def abstract_model(model: ModelConfig, kernels: Kernels) -> tuple[nnx.GraphDef, nnx.State]:
  """Graph definition and parameter shapes of the decoder with these kernels, nothing allocated."""
  return state_lib.abstract_model(lambda rngs: GPT(model, kernels=kernels, rngs=rngs))


def saved_activation_bytes(model: ModelConfig, kernels: Kernels, seq_len: int, tensor: int, local_batch: int
                           ) -> int:
  """Bytes one device keeps from the forward pass for the backward pass, for `local_batch` sequences, with `kernels`
  (resolved: `planned_kernels`).

  Traces (never compiles) `jax.vjp` of the training loss on one device's shard: `shard_map` over a `tensor`-way
  mesh hands the model its tensor-parallel parameter shards (heads, MLP width, vocabulary split as in
  jaxlm.parallel.sharding.RULES; FSDP shards arrive gathered, as `sharding.gather_fsdp` lays them out for compute), so
  the residuals have exactly the per-device shapes: [B, T, D] activations whole, [B, T, F/tp] and [B, H/tp, T, T]
  split. Residuals that are the parameters themselves, or slices of them (one layer's weights in a layer loop), cost
  nothing extra and are not counted; copies (a bf16 cast of an f32 weight) are. Remat policies change what is saved,
  and this count follows them. Kernels that cannot run on this host are traced through their stand-ins (the same
  residuals).
  """
  graphdef, abstract_params = abstract_model(model, kernels_lib.runnable_on(kernels, jax.default_backend()))
  mesh = _abstract_mesh((1, 1, tensor))
  shardings = sharding.param_shardings(abstract_params, mesh)
  specs = jax.tree.map(lambda s: s.spec, shardings)
  # The abstract inputs carry the shardings that in_specs name: jax >= 0.11 checks that they agree.
  params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        abstract_params.to_pure_dict(), shardings)
  batch = abstract_batch(local_batch, seq_len)
  loss_fn = steps_lib.make_loss_fn(graphdef)
  counted: list[int] = []

  def residuals(params, batch):
    return jax.tree.leaves(jax.vjp(lambda p: loss_fn(p, batch), params)[1])

  def per_device(params, batch):
    jaxpr = jax.make_jaxpr(residuals)(params, batch).jaxpr
    counted.append(sum(math.prod(r.aval.shape) * r.aval.dtype.itemsize for r in _new_buffers(jaxpr)))
    return jnp.zeros((), jnp.float32)

  traced = jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_vma=False)
  jax.eval_shape(traced, params, batch)
  return counted[0]


# Primitives whose result XLA can leave as a view of their operand (no new buffer): a layer loop's per-layer slices
# of the stacked parameters.
_VIEWS = ("slice", "squeeze", "reshape", "split", "expand_dims")


def _new_buffers(jaxpr) -> list:
  """The outputs of `jaxpr` that are neither its inputs nor views of them, one per output (repeats counted)."""
  producer = {out: eqn for eqn in jaxpr.eqns for out in eqn.outvars}
  inputs = set(jaxpr.invars) | set(jaxpr.constvars)

  def is_view(var) -> bool:
    while var not in inputs:
      eqn = producer.get(var)
      if eqn is None or eqn.primitive.name not in _VIEWS:
        return False
      var = eqn.invars[0]
    return True

  return [v for v in jaxpr.outvars if not isinstance(v, jax.extend.core.Literal) and not is_view(v)]


# Transient bytes while one layer runs its backward pass, as a fraction of that layer's saved activations: the
# activation gradients in flight (without remat), or the recomputed forward of the layer (remat=full). Keyed by the
# resolved kernels.remat; calibrated on XLA's buffer assignment of CPU-compiled train steps, except `dots` (matmul
# outputs kept), which is not calibrated and sits between the two.
BACKWARD_WORKING_FRACTION = {"none": 1 / 3, "dots": 0.5, "full": 0.9}
# Parameter-sized f32 trees alive during the optimizer phase besides the state: the gradient (sum), the gradient
# divided by the token count, the clipped gradient and the Adam update (jaxlm/training/optim.py,
# steps_lib.make_train_step). It
# is the peak when activations are small (many micro-batches of few sequences).
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


def activation_model(config: Config, sizes: tuple[int, int, int], platform: str | None = None) -> ActivationModel:
  """The saved activations of `config` on mesh `sizes` with the kernels planned for `platform` (None: this host)."""
  return _activation_model(config.model, planned_kernels(config, sizes, platform), config.data.seq_len, sizes[2])


@functools.lru_cache(maxsize=None)
def _activation_model(model: ModelConfig, kernels: Kernels, seq_len: int, tensor: int) -> ActivationModel:
  """Four traces (1 and 2 sequences, num_layers and num_layers + 1 layers), cached."""
  unremat = dataclasses.replace(kernels, remat="none")
  deeper = dataclasses.replace(model, num_layers=model.num_layers + 1)
  saved = lambda m, k, b: saved_activation_bytes(m, k, seq_len, tensor, b)
  u1, u2 = (saved(model, unremat, b) for b in (1, 2))
  t1, t2 = (u1, u2) if kernels.remat == "none" else (saved(model, kernels, b) for b in (1, 2))
  # One layer's activations as the backward of that layer sees them: without remat, whatever the kernels say.
  l1, l2 = (saved(deeper, unremat, b) - u for b, u in ((1, u1), (2, u2)))
  return ActivationModel(total_fixed=2 * t1 - t2, total_per_sequence=t2 - t1, layer_fixed=2 * l1 - l2,
                         layer_per_sequence=l2 - l1, unremat_fixed=2 * u1 - u2, unremat_per_sequence=u2 - u1)


@dataclasses.dataclass(frozen=True)
class StateBytes:
  """Per-device bytes of the train state on one mesh, from the shardings (exact)."""
  state: int  # params + optimizer state + step counter
  params_f32: int  # the params (and so each gradient tree) in f32
  layer_params_f32: float  # one layer's params on a device of the tensor axis: what FSDP gathers per layer


def state_bytes(config: Config, sizes: tuple[int, int, int], platform: str | None = None) -> StateBytes:
  return _state_bytes(config.model, planned_kernels(config, sizes, platform),
                      dataclasses.replace(config.train, grad_accum=1, batch_size=1), sizes)


@functools.lru_cache(maxsize=None)
def _state_bytes(model: ModelConfig, kernels: Kernels, train_config: TrainConfig, sizes: tuple[int, int, int]
                 ) -> StateBytes:
  mesh = _abstract_mesh(sizes)
  optimizer = optim.make_optimizer(train_config)
  _, abstract_params = abstract_model(model, kernels_lib.runnable_on(kernels, jax.default_backend()))
  param_shardings = sharding.param_shardings(abstract_params, mesh)
  params = abstract_params.to_pure_dict()
  opt_state = jax.eval_shape(optimizer.init, params)
  opt_shardings = state_lib.optimizer_state_shardings(optimizer, opt_state, param_shardings, sharding.replicated(mesh))
  params_f32 = sum(math.prod(s.shard_shape(x.shape)) * 4
                   for x, s in zip(jax.tree.leaves(params), jax.tree.leaves(param_shardings)))
  stacked = sum(math.prod(v.get_value().shape) * 4 for path, v in nnx.to_flat_state(abstract_params)
                if "blocks" in map(str, path))
  return StateBytes(state=sharded_bytes(params, param_shardings) + sharded_bytes(opt_state, opt_shardings) + 4,
                    params_f32=params_f32, layer_params_f32=stacked / model.num_layers / sizes[2])


def predict_memory(config: Config, sizes: tuple[int, int, int], grad_accum: int, platform: str | None = None
                   ) -> dict[str, float]:
  """Predicted peak bytes per device of the train step on `platform` devices (None: this host's), by part, plus
  `total`. No compilation.

    state           params + optimizer state + step, exact from the shardings (jaxlm.parallel.sharding.RULES)
    batch           the device's rows of the global batch (all micro-batches)
    gradients       f32 gradients in the parameters' layout; with accumulation also the running sum
    activations     what the forward pass saves for the backward pass (`saved_activation_bytes`)
    working         the backward pass's transient: a fraction of one layer's activations, plus under FSDP one
                    gathered layer of parameters and its unreduced gradient
    optimizer_extra what the optimizer phase holds beyond the backward phase, when more: OPTIMIZER_PHASE_TREES f32
                    parameter-sized trees (0 when the backward phase is the peak, as it is for large micro-batches)
  """
  data, fsdp, tensor = sizes
  static = state_bytes(config, sizes, platform)
  activations = activation_model(config, sizes, platform)
  remat = planned_kernels(config, sizes, platform).remat
  local_batch = config.train.batch_size // grad_accum // (data * fsdp)
  parts = {
      "state": float(static.state),
      "batch": float(config.train.batch_size // (data * fsdp) * config.data.seq_len * 5 * 4),
      "gradients": float(static.params_f32 * (2 if grad_accum > 1 else 1)),
      "activations": activations.total(local_batch),
      "working": (BACKWARD_WORKING_FRACTION[remat] * activations.layer(local_batch)
                  + (2 * static.layer_params_f32 if fsdp > 1 else 0.0)),
  }
  backward_phase = parts["gradients"] + parts["activations"] + parts["working"]
  parts["optimizer_extra"] = max(0.0, OPTIMIZER_PHASE_TREES * static.params_f32 - backward_phase)
  parts["total"] = sum(parts.values())
  return parts


def largest_local_micro_batch(config: Config, sizes: tuple[int, int, int], usable_bytes: float,
                              platform: str | None = None) -> int:
  """The most sequences one device can hold per micro-batch within `usable_bytes` (0 if not even one), with
  accumulation on (memory is affine in the micro-batch, so this is solved, not searched)."""
  at_one = predict_memory(config, sizes, config.train.batch_size // (sizes[0] * sizes[1]), platform)
  if at_one["total"] > usable_bytes:
    return 0
  activations = activation_model(config, sizes, platform)
  remat = planned_kernels(config, sizes, platform).remat
  per_sequence = activations.total_per_sequence + BACKWARD_WORKING_FRACTION[remat] * activations.layer_per_sequence
  backward_at_one = at_one["total"] - at_one["optimizer_extra"]  # the part that grows with the micro-batch
  return 1 + int((usable_bytes - backward_at_one) // per_sequence)


# ----------------------------------------------------------------------------------------------- step time


# Bytes the non-matmul work of a step moves per micro-batch: the forward writes the saved activations and the
# backward reads them (SAVED_PASSES x saved), and the elementwise passes (norms, softmax, GELU, their gradients)
# touch the whole activation volume of the forward (what it would save without remat) about once more each way
# (ELEMENTWISE_PASSES x that volume; remat recomputes the forward, half again: REMAT_TRAFFIC, keyed by the resolved
# kernels.remat). Set from that count, not fitted.
SAVED_PASSES = 2.0
ELEMENTWISE_PASSES = 2.0
REMAT_TRAFFIC = {"none": 1.0, "dots": 1.5, "full": 1.5}
# The optimizer step reads gradients, params, both Adam moments and writes three of them back (7), and the
# gradient/update/param norms and the finite-step select read them again (5): in units of the f32 params per device.
OPTIMIZER_PASSES = 12.0
# Muon's leaves (train.optimizer=muon) read the gradient, params and one momentum and write two back (5), plus the
# same 5; each Newton-Schulz iteration reads the matrix twice and writes it once (its [m, m] Gram products are no
# larger).
MUON_PASSES = 10.0
MUON_PASSES_PER_ITERATION = 3.0
# A scan over the layers against the Python loop the GPU calibration runs used (`step_time_factor`): on an H200 the
# scanned GPT-2 and Llama steps were slower than the loop (this is their mean slow-down, docs/performance.md); a GPU
# run that recomputes runs the scan (jaxlm/kernels/registry.py), so its plan pays this.
SCANNED_LAYERS_FACTOR = {"gpu": 1.24}


@functools.lru_cache(maxsize=None)
def _muon_work(model: ModelConfig, ns_steps: int) -> tuple[float, float]:
  """(the share of the decoder's parameters Muon trains, the Newton-Schulz FLOPs of one update)."""
  params = abstract_model(model, Kernels())[1].to_pure_dict()
  sizes = [(muon.is_muon_leaf(path), math.prod(x.shape)) for path, x in jax.tree_util.tree_leaves_with_path(params)]
  share = sum(size for is_muon, size in sizes if is_muon) / sum(size for _, size in sizes)
  return share, muon.newton_schulz_flops(params, ns_steps)


def optimizer_passes(config: Config) -> float:
  """Passes of the optimizer step over the f32 params: OPTIMIZER_PASSES, Muon's share of the params at its own."""
  t = config.train
  if t.optimizer != "muon":
    return OPTIMIZER_PASSES
  share = _muon_work(config.model, t.muon_ns_steps)[0]
  return (1 - share) * OPTIMIZER_PASSES + share * (MUON_PASSES + MUON_PASSES_PER_ITERATION * t.muon_ns_steps)


def optimizer_flops(config: Config, sizes: tuple[int, int, int]) -> float:
  """Matmul FLOPs of the optimizer step per device: Muon's Newton-Schulz iterations (f32), spread over the fsdp x
  tensor devices that shard the matrices and repeated on each data replica; AdamW has none."""
  if config.train.optimizer != "muon":
    return 0.0
  return _muon_work(config.model, config.train.muon_ns_steps)[1] / (sizes[1] * sizes[2])


def analytic_collective_bytes(config: Config, sizes: tuple[int, int, int], grad_accum: int,
                              param_bytes_f32: float) -> float:
  """Bytes each device sends per step with ring collectives, when no compiled HLO is at hand.

  `param_bytes_f32` is the whole model's f32 parameter bytes. DP: an all-reduce of the gradients, in every
  micro-batch under `gspmd` (GSPMD reduces inside the accumulation loop, as the compiled HLO shows) and once with
  `shard_map` (what `auto` picks for pure data parallelism). FSDP: each micro-batch all-gathers the weights for the
  forward and again for the backward, and reduce-scatters the gradients. TP: all-reduces of the [b, T, D]
  activations: per layer two forward (attention and MLP outputs) and four backward (the input gradients of the q,
  k, v projections are reduced separately, plus the MLP's), and one each for the vocabulary-sharded embedding lookup
  and LM head: 6 L + 2 per micro-batch, as GSPMD's HLO shows.
  """
  data, fsdp, tensor = sizes
  m = config.model
  shard = param_bytes_f32 / tensor
  total = 0.0
  if data > 1:
    sync = steps_lib.resolve_gradient_sync(config.mesh.gradient_sync, dict(zip(("data", "fsdp", "tensor"), sizes)),
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
  """Roofline of one optimizer step on one device, by part (seconds), plus `step_time_sec` and `mfu`, with the
  kernels planned for `hardware.platform` (`activations` must be that platform's too: `activation_model`).

    compute   matmul FLOPs (telemetry.flops_per_token; plus the recomputed forward under remat=full) at the
              device's sustained matmul rate for the compute dtype (`Hardware.matmul_rate`), plus Muon's
              Newton-Schulz FLOPs (`optimizer_flops`) at the profile's float32 rate
    memory    the bytes of the non-matmul work (saved activations written and read, elementwise passes over the
              forward's activations, more under remat; `optimizer_passes` x f32 params) at the memory bandwidth
    network   collective bytes per device at the interconnect bandwidth, not overlapped (an upper bound: XLA
              overlaps some of it with compute on GPUs and TPUs)
  The parts run one after another (matmul kernels are compute bound, the rest memory bound), so they add up; the
  step is their sum times the profile's `step_time_factor` (measured step / this roofline on that device type,
  1 where nobody has measured it), kept apart as `roofline_sec`, and times SCANNED_LAYERS_FACTOR where a run that
  platform calibrated with a layer loop scans instead.
  """
  data, fsdp, tensor = sizes
  devices = data * fsdp * tensor
  tokens = config.train.batch_size * config.data.seq_len
  model_flops = telemetry.flops_per_token(config.model, config.data.seq_len) * tokens
  kernels = planned_kernels(config, sizes, hardware.platform or None)
  remat = kernels.remat
  executed_flops = model_flops * (4 / 3 if remat == "full" else 1.0)
  local_batch = config.train.batch_size // grad_accum // (data * fsdp)
  activation_bytes = (SAVED_PASSES * activations.total(local_batch)
                      + ELEMENTWISE_PASSES * REMAT_TRAFFIC[remat] * activations.unremat(local_batch))
  memory_bytes = grad_accum * activation_bytes + optimizer_passes(config) * param_bytes_per_device
  parts = {
      "compute_sec": (executed_flops / devices / hardware.matmul_rate(config.model.compute_dtype)
                      + optimizer_flops(config, sizes) / hardware.matmul_rate("float32")),
      "memory_sec": memory_bytes / hardware.hbm_bytes_per_sec,
      "network_sec": collective_bytes / hardware.interconnect_bytes_per_sec,
  }
  roofline = sum(parts.values())
  step = calibrated_step_time(roofline, hardware, kernels)
  parts.update({"roofline_sec": roofline, "step_time_sec": step, "tokens_per_sec": tokens / step,
                "mfu": model_flops / (step * devices * hardware.peak_flops(config.model.compute_dtype))})
  return parts


def calibrated_step_time(roofline: float, hardware: Hardware, kernels: Kernels) -> float:
  """The roofline times the profile's measured `step_time_factor`, and SCANNED_LAYERS_FACTOR for a scan where the
  platform was calibrated with a layer loop."""
  scanned = SCANNED_LAYERS_FACTOR.get(hardware.platform, 1.0) if kernels.layers == "scan" else 1.0
  return roofline * hardware.step_time_factor * scanned


def as_compiled_on(config: Config, platform: str, sizes: tuple[int, int, int], target: str | None = None) -> Config:
  """The config whose memory the program compiled on `platform` shows, for a run of mesh `sizes` planned for
  `target` devices (None: `platform` itself): the kernels planned for the target, with the stand-ins of those that
  cannot run on `platform`, written out as explicit choices (no `auto` left). XLA's CPU backend has no bf16/f16
  matmuls and carries those activations in f32, so a CPU-compiled figure is checked against the f32 prediction;
  the kernels are fixed before the dtype changes, so they stay the ones compiled. Predict it with
  `predict_memory(..., platform=platform)`."""
  kernels = kernels_lib.runnable_on(planned_kernels(config, sizes, target or platform), platform, target)
  model = dataclasses.replace(config.model, compute_dtype="float32") if platform == "cpu" else config.model
  return dataclasses.replace(config, model=model, kernels=kernels.as_config())
