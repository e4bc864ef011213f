"""Capacity and cost planner: will a model fit, how fast will it train, and what will the run cost, before renting.

For every layout of every device count on every hardware profile (jaxlm/planner/hardware.py; layouts:
jaxlm/planner/layouts.py, data / FSDP / tensor mixes and pipelines), in the dtype the hardware has (`for_hardware`), the
planner takes the split into micro-batches that fits (jaxlm/planner/estimates.py: state, gradients, saved activations;
predict_pipeline.py and predict_lora.py for pipelines and LoRA; no compiling), the roofline step time and MFU, all for
the kernels the run would use there (`planned_kernels`: config.kernels with `auto` resolved for the profile's platform,
the compute dtype and the mesh), and the run's wall time and cost on on-demand and spot devices, or hours and energy on
owned ones (`run_cost`, with checkpoint writes and the work lost to preemptions). jaxlm/planner/advice.py says in words
which layout wins and why. The model is the config's, or an HF config.json's (`with_hf_model`, no weights needed).
`compile_train_step` + `compiled_memory_bytes` check a prediction against the real train step compiled by XLA for
simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N): its buffer assignment from
`memory_analysis()`, its collective bytes from the HLO (jaxlm/planner/hlo_traffic.py). Tens of seconds per program on a
CPU, so experiments/plan.py compiles the chosen candidates only and reports both numbers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Sequence

import jax

from jaxlm.config import Config, validate, validate_pipeline
from jaxlm.interop import hf_config as hf_config_lib
from jaxlm.kernels import runnable_on
from jaxlm.models.gpt import GPT
from jaxlm.parallel import sharding
from jaxlm.planner import estimates_lora as lora_predict
from jaxlm.planner import estimates_pipeline as pipeline_predict
from jaxlm.planner import estimates_preference as preference_predict
from jaxlm.planner import estimates_rl as rl_predict
from jaxlm.planner import hlo_traffic
from jaxlm.planner.estimates import (
  abstract_batch,
  activation_model,
  analytic_collective_bytes,
  largest_local_micro_batch,
  planned_kernels,
  predict_memory,
  predict_step_time,
  state_bytes,
)
from jaxlm.planner.hardware import GIB, Hardware, planned_dtype
from jaxlm.planner.layouts import Layout, accumulation_splits, as_layout, layouts
from jaxlm.recipes import features as features_lib
from jaxlm.training import optim
from jaxlm.training import steps as steps_lib

# ----------------------------------------------------------------------------------------------- the model


def with_hf_model(config: Config, path: str) -> Config:
  """`config` with the model an HF config.json describes (`path`: the file, or a folder holding it), from that file
  alone (`hf_config.model_config_from_file`, no weights); the precision (model.compute_dtype, model.param_dtype)
  stays the config's. A key jaxlm cannot read is a one-line error naming it."""
  m = config.model
  config = dataclasses.replace(config, model=hf_config_lib.model_config_from_file(path, m.compute_dtype,
                                                                                  m.param_dtype))
  validate(config)
  return config


# ----------------------------------------------------------------------------------------------- candidates


def mesh_problem(config: Config, sizes: "tuple[int, ...] | Layout", platform: str | None = None) -> str | None:
  """Why a mesh (or Layout) of `platform` devices (None: this host's) cannot run this model, batch and kernels
  (None when it can): the same checks as training."""
  layout = as_layout(sizes)
  data, fsdp, tensor = layout.sizes
  m = config.model
  if layout.pipeline > 1:
    problem = _pipeline_problem(config, layout)
    if problem:
      return problem
  if m.num_experts and tensor > 1:
    return f"model.num_experts={m.num_experts} runs with mesh.data, mesh.fsdp and mesh.expert, not mesh.tensor"
  if m.num_heads % tensor:
    return f"model.num_heads={m.num_heads} is not divisible by mesh.tensor={tensor}"
  if m.mlp_width % tensor:
    return f"model MLP width {m.mlp_width} is not divisible by mesh.tensor={tensor}"
  if config.train.batch_size % (data * fsdp):
    return f"train.batch_size={config.train.batch_size} is not divisible by mesh.data*mesh.fsdp={data * fsdp}"
  try:
    planned_kernels(config, (data, fsdp, tensor, layout.pipeline), platform)
  except ValueError as e:  # an explicit kernel these devices cannot run (e.g. a one-device CPU kernel on a mesh)
    return str(e)
  return None


def _pipeline_problem(config: Config, layout: Layout) -> str | None:
  """jaxlm.training.pipeline's own checks of a pipeline layout, with the most micro-batches the batch allows."""
  splits = accumulation_splits(config.train.batch_size, layout.data * layout.fsdp)
  if config.lora.rank:
    return f"lora.rank={config.lora.rank} does not run with mesh.pipeline > 1"
  if config.rl.loss:
    return f"rl.loss={config.rl.loss} samples its rollouts on the training mesh, which has no mesh.pipeline > 1"
  try:
    validate_pipeline(with_mesh(config, layout, splits[-1]))
  except ValueError as e:
    return str(e)
  return None


# ----------------------------------------------------------------------------------------------- abstract train step


def with_mesh(config: Config, sizes: "tuple[int, ...] | Layout", grad_accum: int | None = None) -> Config:
  """The config on mesh `sizes` (or a Layout, with its pipeline; other mesh settings, e.g. gradient_sync, kept),
  optionally with `grad_accum`."""
  layout = as_layout(sizes)
  train_config = config.train if grad_accum is None else dataclasses.replace(config.train, grad_accum=grad_accum)
  mesh = dataclasses.replace(config.mesh, data=layout.data, fsdp=layout.fsdp, tensor=layout.tensor, preset="",
                             pipeline=layout.pipeline, pipeline_schedule=layout.schedule or "gpipe")
  return dataclasses.replace(config, mesh=mesh, train=train_config)


def compile_train_step(config: Config, devices: Sequence[jax.Device] | None = None, platform: str | None = None):
  """The train step `steps_lib.jit_steps` builds, compiled for `config.mesh` over `devices` (simulated CPU devices are
  fine: nothing is allocated or run) with the kernels planned for `platform` devices (None: those of `devices`);
  kernels that cannot run on `devices` are compiled as their stand-ins (jaxlm.kernels.runnable_on). Returns the
  compiled executable; `as_compiled_on(config, <devices' platform>, sizes, platform)` is its predicted twin."""
  mesh = sharding.make_mesh(config.mesh, devices)
  here = mesh.devices.flat[0].platform
  sizes = tuple(mesh.shape[a] for a in sharding.MESH_AXES)
  kernels = runnable_on(planned_kernels(config, sizes, platform or here), here, platform or here)
  # Written out, so that whatever reads config.kernels on the way sees the kernels compiled, not `auto`.
  config = dataclasses.replace(config, kernels=kernels.as_config())
  optimizer = optim.make_optimizer(config.train)
  make_model = lambda rngs: GPT(config.model, kernels=kernels, rngs=rngs)
  # The one train-state builder, unallocated: LoRA's frozen base apart, float16's loss scale beside the state.
  graphdef, state, shardings, features = features_lib.train_state_from_config(config, mesh, optimizer, make_model,
                                                                              abstract_only=True)
  train_step, _ = steps_lib.jit_steps(graphdef, optimizer, config, mesh, shardings, features)
  return train_step.lower(state, abstract_batch(config.train.batch_size, config.data.seq_len)).compile()


def compiled_memory_bytes(compiled) -> int:
  """Peak bytes per device of a compiled program: live arguments and outputs (donated ones counted once) plus the
  temporaries of XLA's buffer assignment."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


def compiled_collective_bytes(compiled, num_devices: int) -> dict[str, float]:
  return hlo_traffic.collective_bytes(compiled.as_text(), num_devices)


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
  """Steps, hours, dollars and energy for the token budget on on-demand and on spot devices.

  On-demand: the steps plus one checkpoint save every `checkpoint_every_steps`. Spot: each preemption loses on
  average half a checkpoint interval of work plus a restart; at `spot_preemptions_per_hour` (per node) the expected
  wall time W solves W = W_on_demand + rate * W * loss, i.e. W = W_on_demand / (1 - rate * loss). A profile
  without a price (owned hardware) gets None for the dollars (and for spot without a spot price); `energy_kwh` is
  the on-demand hours at the boards' rated power (None where the profile does not give it).
  """
  steps = math.ceil(assumptions.tokens / tokens_per_step)
  save_sec = state_bytes / assumptions.checkpoint_bytes_per_sec
  saves = math.ceil(steps / assumptions.checkpoint_every_steps)
  on_demand_hours = (steps * step_time_sec + saves * save_sec) / 3600
  interval_hours = (assumptions.checkpoint_every_steps * step_time_sec + save_sec) / 3600
  loss_hours = interval_hours / 2 + assumptions.restart_sec / 3600
  lost_fraction = hardware.spot_preemptions_per_hour * loss_hours
  spot_hours = on_demand_hours / (1 - lost_fraction) if lost_fraction < 1 else math.inf
  has_spot = hardware.usd_per_hour_spot is not None
  return {"steps": steps, "on_demand_hours": on_demand_hours, "spot_hours": spot_hours if has_spot else None,
          "on_demand_usd": None if hardware.owned else on_demand_hours * devices * hardware.usd_per_hour_on_demand,
          "spot_usd": spot_hours * devices * hardware.usd_per_hour_spot if has_spot else None,
          "energy_kwh": on_demand_hours * devices * hardware.board_power_watts / 1000 if hardware.board_power_watts
          else None,
          "checkpoint_save_sec": save_sec,
          "spot_expected_preemptions": spot_hours * hardware.spot_preemptions_per_hour if has_spot else None}


# ----------------------------------------------------------------------------------------------- the plan


def for_hardware(config: Config, hardware: Hardware) -> tuple[Config, str]:
  """(the config as it runs on `hardware`, a note of what changed or ""): its compute dtype replaced where the
  device lacks it, and `auto` attention planned as `xla` on GPUs without cuDNN's fused attention (V100, T4)."""
  dtype, note = planned_dtype(config.model.compute_dtype, hardware)
  config = dataclasses.replace(config, model=dataclasses.replace(config.model, compute_dtype=dtype))
  if hardware.platform == "gpu" and not hardware.has_fused_attention and config.kernels.attention == "auto":
    config = dataclasses.replace(config, kernels=dataclasses.replace(config.kernels, attention="xla"))
    note = "; ".join(filter(None, [note, f"{hardware.name} (compute capability {hardware.compute_capability}) has no "
                                         "cuDNN fused attention: planned with kernels.attention=xla"]))
  return config, note


def _predict(config: Config, layout: Layout, grad_accum: int, hardware: Hardware) -> tuple[dict, dict, float, float]:
  """(memory parts, timing parts, collective bytes, state bytes per device) of one layout and split; an RL config
  (rl.loss, as `rl_predict.as_sequence_run` made it) adds its rollout, reference and log-prob passes to its update
  step's (jaxlm/planner/estimates_rl.py)."""
  memory, timing, collective, state = _predict_step(config, layout, grad_accum, hardware)
  if config.rl.loss:
    memory = rl_predict.predict_rl_memory(config, layout.sizes, grad_accum, hardware.platform or None, memory)
    timing = rl_predict.predict_rl_step_time(config, layout.sizes, grad_accum, hardware, timing)
  return memory, timing, collective, state


def _predict_step(config: Config, layout: Layout, grad_accum: int, hardware: Hardware
                  ) -> tuple[dict, dict, float, float]:
  """`_predict` of the train step alone."""
  platform = hardware.platform or None
  sizes = layout.sizes
  if layout.pipeline > 1:
    sizes4 = sizes + (layout.pipeline,)
    memory = pipeline_predict.predict_pipeline_memory(config, sizes4, grad_accum, layout.schedule, platform)
    collective = pipeline_predict.pipeline_collective_bytes(config, sizes4, grad_accum, layout.schedule, platform)
    timing = pipeline_predict.predict_pipeline_step_time(config, sizes4, grad_accum, layout.schedule, hardware,
                                                         collective["total"])
    timing["p2p_bytes"] = collective["p2p"]
    return memory, timing, collective["total"], memory["state"]
  if config.lora.rank:
    memory = lora_predict.predict_lora_memory(config, sizes, grad_accum, platform)
    lora_state = lora_predict.lora_state_bytes(config, sizes, platform)
    collective = lora_predict.lora_collective_bytes(config, sizes, grad_accum, lora_state)
    timing = lora_predict.predict_lora_step_time(config, sizes, grad_accum, hardware, collective)
    return memory, timing, collective, memory["frozen_base"] + memory["adapters"] + memory["optimizer"]
  memory = predict_memory(config, sizes, grad_accum, platform)
  static = state_bytes(config, sizes, platform)
  collective = analytic_collective_bytes(config, sizes, grad_accum,
                                         state_bytes(config, (1, 1, 1), platform).params_f32)
  timing = predict_step_time(config, sizes, grad_accum, hardware, activation_model(config, sizes, platform),
                             static.params_f32, collective)
  return memory, timing, collective, float(static.state)


def plan_mesh(config: Config, sizes: "tuple[int, ...] | Layout", hardware: Hardware, assumptions: RunAssumptions
              ) -> dict[str, Any]:
  """One row of the plan for a mesh (data, fsdp, tensor) or a Layout (with a pipeline) on `hardware`, in the dtype
  the hardware runs (`for_hardware`). Without a pipeline, the fewest micro-batches (largest micro-batch) that fit;
  with one, the split of at least one micro-batch per stage that fits with the shortest step (more micro-batches
  shrink the bubble and, under 1f1b, the stash). With memory, step time, MFU, bubble and cost; when nothing fits,
  the row says so and what the smallest split needs."""
  layout = as_layout(sizes)
  config, hardware_note = for_hardware(config, hardware)
  usable = hardware.usable_bytes
  platform = hardware.platform or None
  row: dict[str, Any] = {"hardware": hardware.name, "devices": layout.devices, "mesh": layout.mesh,
                         "layout": layout.name, "data": layout.data, "fsdp": layout.fsdp, "tensor": layout.tensor,
                         "pipeline": layout.pipeline, "schedule": layout.schedule,
                         "compute_dtype": config.model.compute_dtype, "hardware_note": hardware_note,
                         "lora": f"rank {config.lora.rank}, base {config.lora.base}" if config.lora.rank else "",
                         "usable_memory_gib": usable / GIB, "remat_fallback": False,
                         "kernels": planned_kernels(config, layout.sizes + (layout.pipeline,), platform).describe()}
  splits = accumulation_splits(config.train.batch_size, layout.data * layout.fsdp)
  if layout.pipeline > 1:
    splits = [k for k in splits if k >= layout.pipeline]
  candidates = []
  for grad_accum in splits:  # fewest micro-batches first: without a pipeline, the fastest step that fits
    predicted = _predict(config, layout, grad_accum, hardware)
    if predicted[0]["total"] <= usable:
      candidates.append((grad_accum, predicted))
      if layout.pipeline == 1:
        break
  if candidates:
    grad_accum, (memory, timing, collective, state) = min(candidates, key=lambda c: c[1][1]["step_time_sec"])
  else:
    grad_accum = splits[-1]
    memory, timing, collective, state = _predict(config, layout, grad_accum, hardware)
  tokens_per_step = config.train.batch_size * config.data.seq_len
  row.update({
      "fits": bool(candidates), "grad_accum": grad_accum, "micro_batch": config.train.batch_size // grad_accum,
      "largest_local_micro_batch": (largest_local_micro_batch(config, layout.sizes, usable, platform)
                                    if layout.pipeline == 1 and not config.lora.rank and not config.rl.loss
                                    else _largest_by_search(config, layout, hardware)),
      "predicted_memory_gib": memory["total"] / GIB, "headroom_gib": (usable - memory["total"]) / GIB,
      "memory_parts_gib": {k: v / GIB for k, v in memory.items() if k != "total"},
      "collective_bytes": collective, "collective_source": "analytic",
      "bubble_fraction": timing.get("bubble_fraction", 0.0),
      **timing,
      **run_cost(timing["step_time_sec"], hardware, layout.devices, tokens_per_step, state, assumptions),
  })
  return row


def _largest_by_search(config: Config, layout: Layout, hardware: Hardware) -> int:
  """The most sequences per micro-batch on one device that fit (0 if none), with accumulation on. LoRA: solved from
  two predictions (memory is affine in the micro-batch); pipeline (the stash depends on the split too): the
  largest local micro-batch of the batch's own splits that fits."""
  if layout.pipeline == 1:
    shards = layout.data * layout.fsdp
    at = lambda b: _predict(dataclasses.replace(config, train=dataclasses.replace(config.train,
                                                                                  batch_size=2 * b * shards)),
                            layout, 2, hardware)[0]["total"]
    one, two = at(1), at(2)
    return 0 if one > hardware.usable_bytes else 1 + int((hardware.usable_bytes - one) // (two - one))
  best = 0
  for grad_accum in accumulation_splits(config.train.batch_size, layout.data * layout.fsdp):
    if layout.pipeline > 1 and grad_accum < layout.pipeline:
      continue
    if _predict(config, layout, grad_accum, hardware)[0]["total"] <= hardware.usable_bytes:
      return config.train.batch_size // grad_accum // (layout.data * layout.fsdp)
  return best


def plan(config: Config, hardware: Sequence[Hardware], device_counts: Iterable[int] = (1, 2, 4, 8),
         assumptions: RunAssumptions | None = None, pipelines: bool = True,
         remat_fallback: bool = True) -> list[dict[str, Any]]:
  """Every valid layout (`layouts`: data, FSDP, tensor, their mixes and, with `pipelines`, pipelines of each
  schedule) of every device count on every hardware profile, one row each (see `plan_mesh`); layouts that cannot
  run the model (heads, layers or batch not divisible, or a kernel the profile's devices cannot run:
  `mesh_problem`) are left out, and so are device counts over a profile's `max_devices`. With `remat_fallback`,
  a device count where nothing fits without recomputation is planned again with kernels.remat=full (those rows
  have `remat_fallback` set). A preference-tuning config (preference.loss) is planned as the LM run of its
  sequences, two per pair, with the reference pass added (jaxlm/planner/estimates_preference.py); an RL config
  (rl.loss) as the LM run of its prompt + completion sequences, with the rollouts, the reference and the log-prob
  passes added (jaxlm/planner/estimates_rl.py)."""
  preference_config = config if config.preference.loss else None
  if preference_config is not None:
    config = preference_predict.as_sequence_run(config)
  if config.rl.loss:
    config = rl_predict.as_sequence_run(config)
  assumptions = assumptions or RunAssumptions(
      tokens=config.train.steps * config.train.batch_size * config.data.seq_len,
      checkpoint_every_steps=config.checkpoint.every_steps)
  rows = []
  for profile in hardware:
    run_config = for_hardware(config, profile)[0]
    for n in device_counts:
      if n > profile.max_devices:
        continue
      found = [plan_mesh(config, layout, profile, assumptions) for layout in layouts(n, config.model.num_layers)
               if (pipelines or layout.pipeline == 1)
               and mesh_problem(run_config, layout, profile.platform or None) is None]
      if remat_fallback and found and not any(r["fits"] for r in found) and config.kernels.remat in ("auto", "none"):
        found += [dict(plan_mesh(with_full_remat(config), layout, profile, assumptions), remat_fallback=True)
                  for layout in layouts(n, config.model.num_layers) if (pipelines or layout.pipeline == 1)
                  and mesh_problem(run_config, layout, profile.platform or None) is None]
      rows += found
  if preference_config is not None:
    rows = [preference_predict.reference_pass(row, preference_config, assumptions.tokens) for row in rows]
  return rows


def with_full_remat(config: Config) -> Config:
  return dataclasses.replace(config, kernels=dataclasses.replace(config.kernels, remat="full"))


def row_config(config: Config, row: dict[str, Any]) -> Config:
  """The config a plan row was planned with (kernels.remat=full for a `remat_fallback` row)."""
  return with_full_remat(config) if row.get("remat_fallback") else config


def predict_row_memory(config: Config, sizes: "tuple[int, ...] | Layout", grad_accum: int,
                       platform: str | None = None) -> float:
  """The predicted peak bytes per device of any layout (pipeline, LoRA or neither) on `platform` devices: the train
  step alone (an RL config's update step, without its reference and rollout), as `compile_train_step` compiles it."""
  layout = as_layout(sizes)
  if layout.pipeline > 1:
    return pipeline_predict.predict_pipeline_memory(config, layout.sizes + (layout.pipeline,), grad_accum,
                                                    layout.schedule, platform)["total"]
  if config.lora.rank:
    return lora_predict.predict_lora_memory(config, layout.sizes, grad_accum, platform)["total"]
  return predict_memory(config, layout.sizes, grad_accum, platform)["total"]


def predict_row_time(config: Config, sizes: "tuple[int, ...] | Layout", grad_accum: int, hardware: Hardware,
                     collective_bytes: float) -> dict[str, Any]:
  """The step-time parts of any layout with the given collective bytes (e.g. a compiled HLO's), on `hardware`; an RL
  config's (`rl_predict.as_sequence_run`'s) with its rollout and log-prob passes."""
  timing = _predict_row_step_time(config, sizes, grad_accum, hardware, collective_bytes)
  if config.rl.loss:
    return rl_predict.predict_rl_step_time(config, as_layout(sizes).sizes, grad_accum, hardware, timing)
  return timing


def _predict_row_step_time(config: Config, sizes: "tuple[int, ...] | Layout", grad_accum: int, hardware: Hardware,
                           collective_bytes: float) -> dict[str, Any]:
  layout = as_layout(sizes)
  if layout.pipeline > 1:
    return pipeline_predict.predict_pipeline_step_time(config, layout.sizes + (layout.pipeline,), grad_accum,
                                                       layout.schedule, hardware, collective_bytes)
  if config.lora.rank:
    return lora_predict.predict_lora_step_time(config, layout.sizes, grad_accum, hardware, collective_bytes)
  platform = hardware.platform or None
  return predict_step_time(config, layout.sizes, grad_accum, hardware, activation_model(config, layout.sizes, platform),
                           state_bytes(config, layout.sizes, platform).params_f32, collective_bytes)
