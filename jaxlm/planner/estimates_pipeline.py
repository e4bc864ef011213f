"""Per-device memory and step time of a pipeline-parallel train step (mesh.pipeline > 1), predicted without
compiling, from the layout jaxlm/training/pipeline.py runs:

  - stage s holds model.num_layers / S consecutive blocks; the embeddings, final norm and head are replicated over
    the pipeline axis, so every stage's state is that of a model of L/S layers (`stage_config`), sharded over the
    stage's data and FSDP axes;
  - the train.grad_accum = M micro-batches flow through the stages; between its forward and backward a stage keeps
    only the [b, T, D] input of each micro-batch in flight (`pipeline.stash_slots`: M for gpipe, at most 2S - 1 for
    1f1b), and each backward recomputes its stage's forward from that input;
  - every tick lasts as long as the slowest stage, the last (its L/S blocks plus the head and the loss), and the
    step idles for the bubble (`pipeline.bubble_fraction`: (S - 1) / (M + S - 1) for both schedules);
  - stages send activations forward and their gradients back to their neighbours only (`ppermute`), one
    [b, T, D] tensor per tick and direction, so PCIe's bandwidth matters far less than for tensor parallelism.

The parts reuse jaxlm/planner/estimates.py's models of one device's state, saved activations and roofline, applied to
the stage model. Dimension names: S stages, M micro-batches, b sequences per micro-batch on one device.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxlm.training import pipeline as pipeline_lib
from jaxlm.training import telemetry
from jaxlm.config import Config, stage_layer_counts
from jaxlm.planner.hardware import Hardware
from jaxlm.planner.estimates import (BACKWARD_WORKING_FRACTION, ELEMENTWISE_PASSES, OPTIMIZER_PHASE_TREES,
                                     REMAT_TRAFFIC, SAVED_PASSES, activation_model, analytic_collective_bytes,
                                     optimizer_flops, optimizer_passes, planned_kernels, state_bytes)


def bubble(num_stages: int, num_microbatches: int, schedule: str) -> float:
  """The share of a step the stages idle, as the pipeline's own schedule tables count it."""
  return pipeline_lib.bubble_fraction(num_stages, num_microbatches, schedule)


def stash_slots(num_stages: int, num_microbatches: int, schedule: str) -> int:
  return pipeline_lib.stash_slots(num_stages, num_microbatches, schedule)


def p2p_sends(num_stages: int, num_microbatches: int, schedule: str) -> int:
  """[b, T, D] tensors each device sends to a neighbour per step (the pipeline's own count: one activation per
  tick with a forward, one gradient per tick with a backward, bubble ticks included)."""
  return pipeline_lib.ppermute_bytes_per_device(num_stages, num_microbatches, schedule, 1, 1, 1, 1)


def stage_config(config: Config, num_stages: int) -> Config:
  """The config of one stage: L/S blocks with the (replicated) embeddings and head, on the stage's own mesh."""
  layers = stage_layer_counts(config.model.num_layers, num_stages)[0]
  return dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=layers),
                             mesh=dataclasses.replace(config.mesh, pipeline=1, pipeline_schedule="gpipe"))


def _stage_parts(config: Config, sizes: tuple[int, int, int, int], platform: str | None):
  data, fsdp, tensor, stages = sizes
  stage = stage_config(config, stages)
  # The kernels of the whole run (all of its devices), applied to the stage model.
  kernels_config = dataclasses.replace(stage, kernels=planned_kernels(config, sizes, platform).as_config())
  return stage, kernels_config, (data, fsdp, tensor)


def predict_pipeline_memory(config: Config, sizes: tuple[int, int, int, int], grad_accum: int, schedule: str,
                            platform: str | None = None) -> dict[str, float]:
  """Predicted peak bytes on the busiest stage's device for mesh `sizes` = (data, fsdp, tensor, pipeline), by part,
  plus `total`:

    state, batch     as jaxlm.planner.estimates.predict_memory, for the stage model (L/S blocks, embeddings and head)
    gradients        the stage's f32 gradients and their running sum over the micro-batches
    stash            the kept micro-batch inputs: stash_slots x [b, T, D] in the compute dtype
    activations      one micro-batch's saved activations inside the stage, while its backward recomputes it
    working          the backward's transient (as predict_memory), plus a gathered layer under FSDP
    optimizer_extra  the optimizer phase beyond the backward phase (as predict_memory)
  """
  data, fsdp, tensor, stages = sizes
  stage, kernels_config, sizes3 = _stage_parts(config, sizes, platform)
  static = state_bytes(kernels_config, sizes3, platform)
  activations = activation_model(kernels_config, sizes3, platform)
  remat = planned_kernels(kernels_config, sizes3, platform).remat
  local_batch = config.train.batch_size // grad_accum // (data * fsdp)
  itemsize = jnp.dtype(config.model.compute_dtype).itemsize
  parts = {
      "state": float(static.state),
      "batch": float(config.train.batch_size // (data * fsdp) * config.data.seq_len * 5 * 4),
      "gradients": float(2 * static.params_f32),
      "stash": float(stash_slots(stages, grad_accum, schedule) * local_batch * config.data.seq_len
                     * config.model.d_model * itemsize),
      "activations": activations.total(local_batch),
      "working": (BACKWARD_WORKING_FRACTION[remat] * activations.layer(local_batch)
                  + (2 * static.layer_params_f32 if fsdp > 1 else 0.0)),
  }
  backward_phase = parts["gradients"] + parts["stash"] + parts["activations"] + parts["working"]
  parts["optimizer_extra"] = max(0.0, OPTIMIZER_PHASE_TREES * static.params_f32 - backward_phase)
  parts["total"] = sum(parts.values())
  return parts


def pipeline_collective_bytes(config: Config, sizes: tuple[int, int, int, int], grad_accum: int, schedule: str,
                              platform: str | None = None) -> dict[str, float]:
  """Bytes each device sends per step: `p2p` to its neighbour stages, `sync` for the stage's data/FSDP axes (one
  gradient reduction per step: the pipeline step is one shard_map, which reduces once after the micro-batches) and
  for the pipeline axis (an all-reduce of the gradients of the replicated embeddings, final norm and head, which
  only the first and last stage compute)."""
  data, fsdp, tensor, stages = sizes
  stage, kernels_config, sizes3 = _stage_parts(config, sizes, platform)
  whole_stage_f32 = state_bytes(kernels_config, (1, 1, 1), platform).params_f32
  sync_config = dataclasses.replace(kernels_config,
                                    mesh=dataclasses.replace(kernels_config.mesh, gradient_sync="shard_map"))
  sync = analytic_collective_bytes(sync_config, sizes3, grad_accum, whole_stage_f32)
  blocks_f32 = state_bytes(kernels_config, (1, 1, 1), platform).layer_params_f32 * stage.model.num_layers
  sync += 2 * (stages - 1) / stages * (whole_stage_f32 - blocks_f32) / (data * fsdp if fsdp > 1 else 1)
  local_batch = config.train.batch_size // grad_accum // (data * fsdp)
  p2p = pipeline_lib.ppermute_bytes_per_device(stages, grad_accum, schedule, local_batch, config.data.seq_len,
                                               config.model.d_model, jnp.dtype(config.model.compute_dtype).itemsize)
  return {"p2p": float(p2p), "sync": float(sync), "total": float(p2p + sync)}


def predict_pipeline_step_time(config: Config, sizes: tuple[int, int, int, int], grad_accum: int, schedule: str,
                               hardware: Hardware, collective_bytes: float) -> dict[str, Any]:
  """Roofline of one optimizer step, by part, as jaxlm.planner.estimates.predict_step_time, for the slowest stage: its
  per-micro-batch compute (the forward recomputed in the backward) and memory traffic over M micro-batches,
  stretched by the bubble (ticks wait for the slowest stage), plus the optimizer pass and the collectives (not
  overlapped). MFU is the whole model's FLOPs over the step on all devices."""
  data, fsdp, tensor, stages = sizes
  platform = hardware.platform or None
  stage, kernels_config, sizes3 = _stage_parts(config, sizes, platform)
  activations = activation_model(kernels_config, sizes3, platform)
  remat = planned_kernels(kernels_config, sizes3, platform).remat
  static = state_bytes(kernels_config, sizes3, platform)
  dtype = config.model.compute_dtype
  local_batch = config.train.batch_size // grad_accum // (data * fsdp)
  local_tokens = local_batch * config.data.seq_len
  # forward + backward (3 forwards' worth) + the stage's recomputed forward (+1), + another under remat=full.
  recompute = (5 / 3) if remat == "full" else (4 / 3)
  stage_flops = telemetry.flops_per_token(stage.model, config.data.seq_len) * local_tokens * recompute / tensor
  stage_bytes = (SAVED_PASSES * activations.total(local_batch)
                 + ELEMENTWISE_PASSES * REMAT_TRAFFIC["full"] * activations.unremat(local_batch))
  bubble_fraction = bubble(stages, grad_accum, schedule)
  stretch = grad_accum / (1 - bubble_fraction)  # micro-batches, each tick as long as the slowest stage's
  parts = {
      "compute_sec": (stretch * stage_flops / hardware.matmul_rate(dtype)
                      + optimizer_flops(kernels_config, sizes3) / hardware.matmul_rate("float32")),
      "memory_sec": ((stretch * stage_bytes + optimizer_passes(kernels_config) * static.params_f32)
                     / hardware.hbm_bytes_per_sec),
      "network_sec": collective_bytes / hardware.interconnect_bytes_per_sec,
  }
  roofline = sum(parts.values())
  step = roofline * hardware.step_time_factor
  tokens = config.train.batch_size * config.data.seq_len
  model_flops = telemetry.flops_per_token(config.model, config.data.seq_len) * tokens
  parts.update({"roofline_sec": roofline, "step_time_sec": step, "tokens_per_sec": tokens / step,
                "mfu": model_flops / (step * data * fsdp * tensor * stages * hardware.peak_flops(dtype)),
                "bubble_fraction": bubble_fraction,
                "bubble_sec": (parts["compute_sec"] + stretch * stage_bytes / hardware.hbm_bytes_per_sec)
                * bubble_fraction * hardware.step_time_factor})
  return parts
