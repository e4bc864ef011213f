"""Per-device memory and step time of a LoRA / QLoRA train step (lora.rank > 0), predicted without compiling.

  state        exact, from jaxlm.adapters.lora's own train state built abstractly on the mesh (`lora_state_bytes`): the
               frozen base (f32, or int8 / NF4 target weights for QLoRA, the rest f32), the adapters (and a new
               head), the optimizer state of those only
  gradients    the trainable tree only, in f32 (and its running sum with accumulation)
  activations  what the LoRA step's own gradient (of the trainable tree, the base a constant) saves, traced as
               jaxlm.planner.estimates traces full training (`lora_saved_activation_bytes`): the frozen base's backward
               still needs the inputs of its matmuls to reach the adapters below, B's [b, T, out] products count under
               remat=dots, and without remat a quantized base's dequantized weights count (computed values)
  working      as jaxlm.planner.estimates, plus one layer's dequantized weights (QLoRA) and,
               under FSDP, one gathered layer
  step time    forward and input-gradient matmuls only (no weight gradients for the frozen base: 4 of the 6
               FLOPs per parameter and token), the attention matmuls, the adapters' own 6; the dequantization
               passes over the base in memory time; FSDP gathers the stored (quantized) base, reduces adapters only
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxlm import kernels as kernels_lib
from jaxlm.adapters import lora as lora_lib
from jaxlm.training import optim
from jaxlm.parallel import sharding
from jaxlm.training import telemetry
from jaxlm.training import steps as steps_lib
from jaxlm.training.state import Features, init_train_state
from jaxlm.config import Config, LoRAConfig, ModelConfig, TrainConfig
from jaxlm.planner.hardware import Hardware
from jaxlm.kernels import Kernels
from jaxlm.models.gpt import GPT
from jaxlm.planner.estimates import (BACKWARD_WORKING_FRACTION, ELEMENTWISE_PASSES, OPTIMIZER_PASSES,
                                     OPTIMIZER_PHASE_TREES, REMAT_TRAFFIC, SAVED_PASSES, ActivationModel,
                                     _abstract_mesh, _new_buffers, abstract_batch, analytic_collective_bytes,
                                     calibrated_step_time, planned_kernels, saved_activation_bytes)


def lora_state_bytes(config: Config, sizes: tuple[int, int, int], platform: str | None = None) -> dict[str, float]:
  """Per-device bytes of a LoRA run's train state (jaxlm.adapters.lora.state_bytes of the abstract state), plus
  `target_params` (base weights with adapters, whole model), `target_layer_params` (one layer's, on one device of
  the tensor axis), `frozen_whole_bytes` and `trainable_whole_bytes` (the same on a 1-device mesh), and
  `load_peak_bytes`: the state plus what loading init_from or writing the merged model adds
  (jaxlm/interop/streaming.py)."""
  kernels = planned_kernels(config, sizes, platform)
  return dict(_lora_state_bytes(config.model, config.lora, kernels_lib.runnable_on(kernels, jax.default_backend()),
                                dataclasses.replace(config.train, grad_accum=1, batch_size=1), tuple(sizes)))


@functools.lru_cache(maxsize=None)
def _lora_state_bytes(model: ModelConfig, lora: LoRAConfig, kernels: Kernels, train_config: TrainConfig,
                      sizes: tuple[int, int, int]) -> tuple:
  make_model = lambda rngs: GPT(model, kernels=kernels, rngs=rngs)
  _, abstract_params = nnx.split(nnx.eval_shape(lambda: make_model(nnx.Rngs(0))))
  optimizer = optim.make_optimizer(train_config)

  def measured(mesh_sizes):
    split = lora_lib.LoRASplit(lora_lib.make_plan(abstract_params, lora))
    _, state, _ = init_train_state(make_model, 0, _abstract_mesh(mesh_sizes), optimizer, Features(split),
                                   abstract_only=True)
    return split.plan, lora_lib.state_bytes(state)

  plan, parts = measured(sizes)
  whole = measured((1, 1, 1))[1]
  flat = {"/".join(map(str, path)): v.get_value().shape for path, v in nnx.to_flat_state(abstract_params)}
  target_params = sum(math.prod(flat[p]) for p in plan.targets)
  per_layer = sum(math.prod(flat[p][1:] if p in plan.stacked else flat[p]) for p in plan.targets)
  parts = dict(parts, target_params=target_params, target_layer_params=per_layer / sizes[2],
               frozen_whole_bytes=whole["frozen_base_bytes"], trainable_whole_bytes=whole["trainable_bytes"],
               base=lora.base, load_peak_bytes=parts["state_bytes"] + _load_extra_bytes(plan, abstract_params, sizes))
  return tuple(parts.items())


def _load_extra_bytes(plan: lora_lib.Plan, abstract_params: nnx.State, sizes: tuple[int, int, int]) -> float:
  """Per device, beyond the state, while jaxlm/interop/streaming.py loads a checkpoint or writes the merged model: one
  float parameter that is no target weight, or one layer of a target weight in f32 twice (placed, then its f32 copy to
  quantize; or merged)."""
  shardings = lora_lib._flat(sharding.param_shardings(abstract_params, _abstract_mesh(sizes)))
  extra = 0.0
  for path, x in lora_lib._flat(abstract_params.to_pure_dict()).items():
    shard = shardings[path].shard_shape(x.shape)
    if path in plan.stacked:
      extra = max(extra, 2 * 4 * math.prod(shard[1:]))
    elif path not in plan.targets:
      extra = max(extra, math.prod(shard) * jnp.dtype(x.dtype).itemsize)
  return extra


def predict_lora_memory(config: Config, sizes: tuple[int, int, int], grad_accum: int, platform: str | None = None
                        ) -> dict[str, float]:
  """Predicted peak bytes per device of a LoRA train step, by part, plus `total` (see the module docstring):
  frozen_base, adapters (the trainable tree), optimizer (its state and the step), batch, gradients, activations,
  working, optimizer_extra."""
  data, fsdp, tensor = sizes
  s = lora_state_bytes(config, sizes, platform)
  activations = lora_activation_model(config, sizes, platform)
  remat = planned_kernels(config, sizes, platform).remat
  local_batch = config.train.batch_size // grad_accum // (data * fsdp)
  itemsize = jnp.dtype(config.model.compute_dtype).itemsize
  # With remat the backward dequantizes one layer's base again; without, the trace already counts them all.
  dequantized_layer = s["target_layer_params"] * itemsize if s["base"] != "float" and remat != "none" else 0.0
  trainable_f32 = s["trainable_bytes"]  # the adapters are kept in f32
  parts = {
      "frozen_base": float(s["frozen_base_bytes"]),
      "adapters": float(s["trainable_bytes"]),
      "optimizer": float(s["optimizer_state_bytes"] + 4),
      "batch": float(config.train.batch_size // (data * fsdp) * config.data.seq_len * 5 * 4),
      "gradients": float(trainable_f32 * (2 if grad_accum > 1 else 1)),
      "activations": activations.total(local_batch),
      "working": (BACKWARD_WORKING_FRACTION[remat] * activations.layer(local_batch) + dequantized_layer
                  + (2 * s["frozen_whole_bytes"] / config.model.num_layers / tensor if fsdp > 1 else 0.0)),
  }
  backward_phase = parts["gradients"] + parts["activations"] + parts["working"]
  parts["optimizer_extra"] = max(0.0, OPTIMIZER_PHASE_TREES * trainable_f32 - backward_phase)
  parts["total"] = sum(parts.values())
  return parts


def lora_flops_per_token(config: Config) -> float:
  """Matmul FLOPs per token of a LoRA step, as the run counts them (telemetry.flops_per_token with the LoRA config:
  4 per frozen base parameter instead of 6, the adapters' 6 per parameter)."""
  return telemetry.flops_per_token(config.model, config.data.seq_len, lora=config.lora)


def lora_collective_bytes(config: Config, sizes: tuple[int, int, int], grad_accum: int,
                          state: dict[str, float]) -> float:
  """Ring-collective bytes per device per step: DP reduces the adapters' gradients; FSDP gathers the stored base
  (quantized for QLoRA) for the forward and again for the backward of each micro-batch and reduce-scatters the
  adapters' gradients; TP's activation all-reduces as in full training."""
  data, fsdp, tensor = sizes
  adapters_whole = state["trainable_whole_bytes"]
  total = 0.0
  if data > 1:
    total += 2 * (data - 1) / data * adapters_whole / (fsdp * tensor)
  if fsdp > 1:
    total += grad_accum * (2 * state["frozen_whole_bytes"] / tensor + adapters_whole / tensor) * (fsdp - 1) / fsdp
  if tensor > 1:
    total += analytic_collective_bytes(config, (1, 1, tensor), grad_accum, 0.0)
  return total


def predict_lora_step_time(config: Config, sizes: tuple[int, int, int], grad_accum: int, hardware: Hardware,
                           collective_bytes: float) -> dict[str, Any]:
  """Roofline of one LoRA optimizer step (parts as jaxlm.planner.estimates.predict_step_time); MFU counts the LoRA
  step's own FLOPs (`lora_flops_per_token`)."""
  data, fsdp, tensor = sizes
  devices = data * fsdp * tensor
  platform = hardware.platform or None
  s = lora_state_bytes(config, sizes, platform)
  activations = lora_activation_model(config, sizes, platform)
  kernels = planned_kernels(config, sizes, platform)
  remat = kernels.remat
  dtype = config.model.compute_dtype
  tokens = config.train.batch_size * config.data.seq_len
  model_flops = lora_flops_per_token(config) * tokens
  forward_flops = (telemetry.flops_per_token(config.model, config.data.seq_len) / 3) * tokens
  executed = model_flops + (forward_flops if remat == "full" else 0.0)
  local_batch = config.train.batch_size // grad_accum // (data * fsdp)
  # Each micro-batch dequantizes the base for the forward, the backward and (remat) the recomputed forward:
  # reads the stored bytes, writes and reads the compute-dtype weights.
  passes = (3 if remat != "none" else 2) if s["base"] != "float" else 0
  dequantize = passes * (s["frozen_base_bytes"] + 2 * s["target_params"] / devices * jnp.dtype(dtype).itemsize)
  activation_bytes = (SAVED_PASSES * activations.total(local_batch)
                      + ELEMENTWISE_PASSES * REMAT_TRAFFIC[remat] * activations.unremat(local_batch))
  memory_bytes = grad_accum * (activation_bytes + dequantize) + OPTIMIZER_PASSES * s["trainable_bytes"]
  parts = {
      "compute_sec": executed / devices / hardware.matmul_rate(dtype),
      "memory_sec": memory_bytes / hardware.hbm_bytes_per_sec,
      "network_sec": collective_bytes / hardware.interconnect_bytes_per_sec,
  }
  roofline = sum(parts.values())
  step = calibrated_step_time(roofline, hardware, kernels)
  parts.update({"roofline_sec": roofline, "step_time_sec": step, "tokens_per_sec": tokens / step,
                "mfu": model_flops / (step * devices * hardware.peak_flops(dtype))})
  return parts


def lora_saved_activation_bytes(config: Config, kernels: Kernels, tensor: int, local_batch: int) -> int:
  """Bytes one device keeps from the forward pass for the backward pass of a LoRA step, for `local_batch`
  sequences, counted as jaxlm.planner.estimates.saved_activation_bytes counts them, on the gradient the train step
  takes: of the trainable tree only, with the frozen base a constant of the loss (jaxlm.training.steps). Dequantized
  base weights that the backward needs are computed values, so they count; views of the stored base do not."""
  if tensor > 1 and config.lora.base != "float":
    # A quantized weight's static shape is the whole weight's, so its shard cannot be dequantized inside shard_map:
    # traced on one device, scaled by how the tensor axis splits the base model's activations.
    split = (saved_activation_bytes(config.model, kernels, config.data.seq_len, tensor, local_batch)
             / saved_activation_bytes(config.model, kernels, config.data.seq_len, 1, local_batch))
    return int(split * lora_saved_activation_bytes(config, kernels, 1, local_batch))
  kernels = kernels_lib.runnable_on(kernels, jax.default_backend())
  make_model = lambda rngs: GPT(config.model, kernels=kernels, rngs=rngs)
  graphdef, abstract_params = nnx.split(nnx.eval_shape(lambda: make_model(nnx.Rngs(0))))
  mesh = _abstract_mesh((1, 1, tensor))
  optimizer = optim.make_optimizer(dataclasses.replace(config.train, grad_accum=1, batch_size=1))
  split = lora_lib.LoRASplit(lora_lib.make_plan(abstract_params, config.lora))
  _, state, shardings = init_train_state(make_model, 0, mesh, optimizer, Features(split), abstract_only=True)
  specs = jax.tree.map(lambda s: s.spec, (shardings["params"], shardings["frozen"]))
  loss_fn = steps_lib.make_loss_fn(graphdef)
  batch = abstract_batch(local_batch, config.data.seq_len)
  counted: list[int] = []

  def residuals(trainable, frozen, batch):
    return jax.tree.leaves(jax.vjp(lambda p: loss_fn(lora_lib.combine(p, frozen), batch), trainable)[1])

  def per_device(trees, batch):
    jaxpr = jax.make_jaxpr(residuals)(*trees, batch).jaxpr
    counted.append(sum(math.prod(r.aval.shape) * r.aval.dtype.itemsize for r in _new_buffers(jaxpr)))
    return jnp.zeros((), jnp.float32)

  traced = jax.shard_map(per_device, mesh=mesh, in_specs=(specs, P()), out_specs=P(), check_vma=False)
  jax.eval_shape(traced, (state["params"], state["frozen"]), batch)
  return counted[0]


def lora_activation_model(config: Config, sizes: tuple[int, int, int], platform: str | None = None
                          ) -> ActivationModel:
  """jaxlm.planner.estimates.ActivationModel of a LoRA step (`lora_saved_activation_bytes`), from four traces,
  cached."""
  return _lora_activation_model(config.model, config.lora, planned_kernels(config, sizes, platform),
                                config.data.seq_len, sizes[2])


@functools.lru_cache(maxsize=None)
def _lora_activation_model(model: ModelConfig, lora: LoRAConfig, kernels: Kernels, seq_len: int, tensor: int
                           ) -> ActivationModel:
  base = Config(model=model, lora=lora, data=dataclasses.replace(Config().data, seq_len=seq_len))
  deeper = dataclasses.replace(base, model=dataclasses.replace(model, num_layers=model.num_layers + 1))
  unremat = dataclasses.replace(kernels, remat="none")
  saved = lambda c, k, b: lora_saved_activation_bytes(c, k, tensor, b)
  u1, u2 = (saved(base, unremat, b) for b in (1, 2))
  t1, t2 = (u1, u2) if kernels.remat == "none" else (saved(base, kernels, b) for b in (1, 2))
  l1, l2 = (saved(deeper, unremat, b) - u for b, u in ((1, u1), (2, u2)))
  return ActivationModel(total_fixed=2 * t1 - t2, total_per_sequence=t2 - t1, layer_fixed=2 * l1 - l2,
                         layer_per_sequence=l2 - l1, unremat_fixed=2 * u1 - u2, unremat_per_sequence=u2 - u1)
