"""Capacity and cost planner: will a model fit, how fast will it train, and what will the run cost, before renting.

For every mesh of every device count on every hardware profile (jaxlm/hardware.py), the planner takes the fewest
micro-batches whose predicted memory fits (jaxlm/predict.py: state, gradients, saved activations; no compiling),
the roofline step time and MFU, all for the kernels the run would use there (`planned_kernels`: config.kernels with
`auto` resolved for the profile's platform, the compute dtype and the mesh), and the run's wall time and cost on
on-demand and spot devices (`run_cost`, with checkpoint writes and the work lost to preemptions).
`compile_train_step` + `compiled_memory_bytes` check a prediction against the real train step compiled by XLA for
simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=N): its buffer assignment from
`memory_analysis()`, its collective bytes from the HLO (jaxlm/hlo.py). Tens of seconds per program on a CPU, so
experiments/plan.py compiles the chosen candidates only and reports both numbers.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable, Sequence

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from jaxlm import hlo, optim, sharding
from jaxlm import steps as steps_lib
from jaxlm.config import Config
from jaxlm.kernels import Kernels, runnable_on
# The planner is the public face of the three modules: callers use plan.Hardware, plan.predict_memory, ...
from jaxlm.hardware import GIB, PROFILES_PATH, Hardware, load_hardware  # noqa: F401
from jaxlm.predict import (ActivationModel, abstract_batch, abstract_model, activation_model,  # noqa: F401
                           analytic_collective_bytes, as_compiled_on, largest_local_micro_batch, planned_kernels,
                           predict_memory, predict_step_time, saved_activation_bytes, state_bytes)


# ----------------------------------------------------------------------------------------------- candidates


def mesh_shapes(num_devices: int) -> list[tuple[int, int, int]]:
  """Every (data, fsdp, tensor) of powers of two whose product is `num_devices`: DP, FSDP, TP and their mixes."""
  powers = [2**i for i in range(int(math.log2(num_devices)) + 1)]
  return [(d, f, num_devices // (d * f)) for d in powers for f in powers if num_devices % (d * f) == 0]


def mesh_problem(config: Config, sizes: tuple[int, int, int], platform: str | None = None) -> str | None:
  """Why a mesh of `platform` devices (None: this host's) cannot run this model, batch and kernels (None when it
  can): the same checks as training."""
  data, fsdp, tensor = sizes
  m = config.model
  if m.num_heads % tensor:
    return f"model.num_heads={m.num_heads} is not divisible by mesh.tensor={tensor}"
  if m.mlp_width % tensor:
    return f"model MLP width {m.mlp_width} is not divisible by mesh.tensor={tensor}"
  if config.train.batch_size % (data * fsdp):
    return f"train.batch_size={config.train.batch_size} is not divisible by mesh.data*mesh.fsdp={data * fsdp}"
  try:
    planned_kernels(config, sizes, platform)
  except ValueError as e:  # an explicit kernel these devices cannot run (e.g. a one-device CPU kernel on a mesh)
    return str(e)
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


def abstract_train_state(config: Config, mesh: Mesh, optimizer: optax.GradientTransformation, kernels: Kernels):
  """(graphdef, state of ShapeDtypeStructs, state shardings): what `steps_lib.init_train_state` builds with `kernels`,
  unallocated."""
  graphdef, abstract_params = abstract_model(config.model, kernels)
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
  steps_lib.check_mesh_fits_model(config.model, mesh)
  optimizer = optim.make_optimizer(config.train)
  graphdef, state, shardings = abstract_train_state(config, mesh, optimizer, kernels)
  train_step, _ = steps_lib.jit_steps(graphdef, optimizer, config, mesh, shardings)
  return train_step.lower(state, abstract_batch(config.train.batch_size, config.data.seq_len)).compile()


def compiled_memory_bytes(compiled) -> int:
  """Peak bytes per device of a compiled program: live arguments and outputs (donated ones counted once) plus the
  temporaries of XLA's buffer assignment."""
  m = compiled.memory_analysis()
  return int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes + m.temp_size_in_bytes)


def compiled_collective_bytes(compiled, num_devices: int) -> dict[str, float]:
  return hlo.collective_bytes(compiled.as_text(), num_devices)


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
  platform = hardware.platform or None
  row: dict[str, Any] = {"hardware": hardware.name, "devices": data * fsdp * tensor, "mesh": "x".join(map(str, sizes)),
                         "data": data, "fsdp": fsdp, "tensor": tensor, "usable_memory_gib": usable / GIB,
                         "kernels": planned_kernels(config, sizes, platform).describe()}
  splits = accumulation_splits(config.train.batch_size, data * fsdp)
  chosen = None
  for grad_accum in splits:  # fewest micro-batches first: the fastest step that fits
    memory = predict_memory(config, sizes, grad_accum, platform)
    if memory["total"] <= usable:
      chosen = grad_accum, memory
      break
  grad_accum, memory = chosen or (splits[-1], predict_memory(config, sizes, splits[-1], platform))
  static = state_bytes(config, sizes, platform)
  collective = analytic_collective_bytes(config, sizes, grad_accum,
                                         state_bytes(config, (1, 1, 1), platform).params_f32)
  timing = predict_step_time(config, sizes, grad_accum, hardware, activation_model(config, sizes, platform),
                             static.params_f32, collective)
  tokens_per_step = config.train.batch_size * config.data.seq_len
  row.update({
      "fits": chosen is not None, "grad_accum": grad_accum, "micro_batch": config.train.batch_size // grad_accum,
      "largest_local_micro_batch": largest_local_micro_batch(config, sizes, usable, platform),
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
  cannot run the model (heads or batch not divisible, or a kernel the profile's devices cannot run: `mesh_problem`)
  are left out, and so are device counts over a profile's `max_devices`."""
  assumptions = assumptions or RunAssumptions(
      tokens=config.train.steps * config.train.batch_size * config.data.seq_len,
      checkpoint_every_steps=config.checkpoint.every_steps)
  rows = []
  for profile in hardware:
    for n in device_counts:
      if n > profile.max_devices:
        continue
      for sizes in mesh_shapes(n):
        if mesh_problem(config, sizes, profile.platform or None) is None:
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
