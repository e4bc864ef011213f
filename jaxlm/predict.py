"""Per-device memory and step time of the train step, predicted without compiling (jaxlm/plan.py's models).

  memory     `predict_memory`: exact bytes of the sharded train state (params, Adam moments) from the shardings,
             the gradients, and the activations JAX saves for the backward pass, counted by tracing `jax.vjp` of the
             loss on one device's shard (`shard_map`, shapes only, nothing compiled or allocated). Seconds per
             model; affine in the micro-batch, so the largest micro-batch that fits is solved, not searched.
  step time  `predict_step_time`: a roofline of matmul FLOPs at the device's sustained matmul rate, plus the bytes
             the step moves through memory at its bandwidth, plus the collective bytes at the interconnect
             bandwidth (`analytic_collective_bytes`, or the compiled HLO's).
Dimension names as in jaxlm/models/layers.py: B batch, T sequence, D d_model, F MLP width, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxlm import optim, sharding, telemetry, train
from jaxlm.config import Config, ModelConfig, TrainConfig
from jaxlm.hardware import Hardware


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


def runnable_on(model: ModelConfig, platform: str) -> ModelConfig:
  """The model as it can be traced or compiled on `platform`: cuDNN attention exists only on NVIDIA GPUs, and
  elsewhere `recompute` attention stands in for it. Same function, and the same residuals (q, k, v, the output
  and per-row softmax statistics, no [T, S] probabilities), so what the step saves and moves is cuDNN's. The same
  holds for the CPU kernels off the CPU: `recompute` for `cpu_fused` attention, XLA's dots for `matmul=blas`."""
  home = {"cudnn": "gpu", "cpu_fused": "cpu"}.get(model.attention)  # the one platform the kernel runs on
  if home is not None and platform != home:
    model = dataclasses.replace(model, attention="recompute")
  if model.matmul == "blas" and platform != "cpu":
    model = dataclasses.replace(model, matmul="xla")
  return model


def saved_activation_bytes(model: ModelConfig, seq_len: int, tensor: int, local_batch: int) -> int:
  """Bytes one device keeps from the forward pass for the backward pass, for `local_batch` sequences.

  Traces (never compiles) `jax.vjp` of the training loss on one device's shard: `shard_map` over a `tensor`-way
  mesh hands the model its tensor-parallel parameter shards (heads, MLP width, vocabulary split as in
  jaxlm.sharding.RULES; FSDP shards arrive gathered, as `sharding.gather_fsdp` lays them out for compute), so the
  residuals have exactly the per-device shapes: [B, T, D] activations whole, [B, T, F/tp] and [B, H/tp, T, T]
  split. Residuals that are the parameters themselves cost nothing extra and are not counted; copies (a bf16 cast
  of an f32 weight) are. Remat policies change what is saved, and this count follows them.
  """
  graphdef, abstract_params = train.abstract_model(runnable_on(model, jax.default_backend()))
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
  The parts run one after another (matmul kernels are compute bound, the rest memory bound), so they add up; the
  step is their sum times the profile's `step_time_factor` (measured step / this roofline on that device type,
  1 where nobody has measured it), kept apart as `roofline_sec`.
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
  roofline = sum(parts.values())
  step = roofline * hardware.step_time_factor
  parts.update({"roofline_sec": roofline, "step_time_sec": step, "tokens_per_sec": tokens / step,
                "mfu": model_flops / (step * devices * hardware.bf16_flops)})
  return parts


def as_compiled_on(config: Config, platform: str) -> Config:
  """The config whose memory the compiled program on `platform` shows. XLA's CPU backend has no bf16/f16 matmuls
  and carries those activations in f32 (measured: a bf16 llama step takes 186 MB there, its f32 twin 183 MB), so a
  CPU-compiled figure is checked against the f32 prediction; accelerators run the config as it is (cuDNN
  attention: see `runnable_on`)."""
  model = runnable_on(config.model, platform)
  if platform == "cpu":
    model = dataclasses.replace(model, compute_dtype="float32")
  return dataclasses.replace(config, model=model)
