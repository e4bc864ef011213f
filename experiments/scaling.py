"""Scaling: the same model on 1, 2 and 4 devices for each parallelism strategy.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu \
    python experiments/scaling.py --config=experiments/configs/demo.py --workdir=runs/scaling

For each (strategy, device count) it compiles the train step, reads the per-device memory from the compiled
executable and the bytes each device sends through collectives from its HLO (jaxlm/planner/hlo_traffic.py), compares
those bytes with the minimum the strategy needs, and times a few steps. Writes `scaling.json` and `scaling.png`.
Pipeline rows (`pp_*`, mesh.pipeline = stages) run train.grad_accum = --pipeline_microbatches and report the schedule's
bubble. On simulated CPU devices all "devices" share the same cores, so tokens/s shows overheads, not speed-up; run it
on real GPUs for speed-ups.
"""

import dataclasses
import json
import os
import time

import jax
from absl import flags, logging
from ml_collections import config_flags

from jaxlm import cli
from jaxlm import config as config_lib
from jaxlm.parallel import sharding
from jaxlm.planner import check_against_runs as measure_lib
from jaxlm.planner import hlo_traffic, plan
from jaxlm.training import optim, pipeline
from jaxlm.training import steps as steps_lib
from jaxlm.recipes import features as features_lib

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file", lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "where scaling.json and scaling.png go")
_STEPS = flags.DEFINE_integer("steps", 5, "timed steps per configuration")
_ONLY = flags.DEFINE_list("strategies", [], "strategies to run (default: all), e.g. dp,pp_gpipe,pp_1f1b")
_MICRO = flags.DEFINE_integer("pipeline_microbatches", 0, "train.grad_accum of the pipeline rows; 0 = one row of "
                              "the batch per device and micro-batch (batch_size / (data * fsdp))")
flags.mark_flags_as_required(["config", "workdir"])

# strategy -> (data, fsdp, tensor) for n devices
STRATEGIES = {
    "dp": lambda n: (n, 1, 1),
    "fsdp": lambda n: (1, n, 1),
    "tp": lambda n: (1, 1, n),
    "tp_sp": lambda n: (1, 1, n),  # tensor parallel + sequence-sharded residual stream (Megatron-SP)
    "dp_tp": lambda n: (n // 2, 1, 2),
}
SEQUENCE_PARALLEL = {"tp_sp"}
# pipeline strategy -> (stages, (data, fsdp, tensor) for the devices per stage, schedule) for n devices
PIPELINES = {
    "pp_gpipe": lambda n: (n, (1, 1, 1), "gpipe"),
    "pp_1f1b": lambda n: (n, (1, 1, 1), "1f1b"),
    "pp_dp": lambda n: (2, (n // 2, 1, 1), "1f1b"),  # 2 stages, each data parallel over n / 2 devices
    "pp_fsdp": lambda n: (2, (1, n // 2, 1), "gpipe"),
}


def minimum_bytes(strategy: str, sizes: tuple[int, int, int], param_bytes: int, config) -> float:
  """Bytes a device must send per step with ring collectives, for the gradient sync or the activations."""
  data, fsdp, tensor = sizes
  replicas = data * fsdp
  # Gradients: all-reduce (DP) or reduce-scatter + all-gather of params (FSDP): both 2 (n-1)/n of the (shard of) P.
  grad_bytes = 2 * (replicas - 1) / replicas * param_bytes / tensor if replicas > 1 else 0.0
  # Tensor parallel: per layer, 2 all-reduces of the [B_local, T, D] activations forward and 2 backward.
  act_bytes = 0.0
  if tensor > 1:
    m, t = config.model, config.train
    itemsize = 2 if m.compute_dtype == "bfloat16" else 4
    activation = t.batch_size // replicas * config.data.seq_len * m.d_model * itemsize
    act_bytes = 4 * m.num_layers * 2 * (tensor - 1) / tensor * activation
  return grad_bytes + act_bytes


def minimum_pipeline_bytes(sizes: tuple[int, int, int], stages: int, config, block_bytes: int,
                           other_bytes: int) -> float:
  """Each micro-batch's activation to the next stage and its gradient back (a middle stage sends both, M of each),
  the replicated embeddings'/head's gradient all-reduce over the stages, and each stage's gradient sync over its
  data/FSDP replicas. The step sends more: a lockstep ppermute also moves the idle buffers of bubble ticks."""
  m, t = config.model, config.train
  replicas = sizes[0] * sizes[1]
  rows = t.batch_size // (t.grad_accum * replicas)
  itemsize = 2 if m.compute_dtype == "bfloat16" else 4
  sends = t.grad_accum * rows * config.data.seq_len * m.d_model * itemsize * (2 if stages > 2 else 1)
  stage_params = block_bytes / stages + other_bytes
  grad_sync = 2 * (replicas - 1) / replicas * stage_params if replicas > 1 else 0.0
  return sends + 2 * (stages - 1) / stages * other_bytes + grad_sync


def measure(config, strategy: str, num_devices: int) -> dict:
  stages, schedule = 1, "gpipe"
  if strategy in PIPELINES:
    stages, sizes, schedule = PIPELINES[strategy](num_devices)
    micro = _MICRO.value or config.train.batch_size // (sizes[0] * sizes[1])
    config = dataclasses.replace(config, train=dataclasses.replace(config.train, grad_accum=micro))
  else:
    sizes = STRATEGIES[strategy](num_devices)
  config = dataclasses.replace(config, mesh=config_lib.MeshConfig(
      *sizes, sequence_parallel=strategy in SEQUENCE_PARALLEL, pipeline=stages, pipeline_schedule=schedule))
  config_lib.validate(config)
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:num_devices])
  optimizer = optim.make_optimizer(config.train)
  graphdef, state, shardings, features = features_lib.train_state_from_config(
      config, mesh, optimizer, features_lib.decoder_factory(config, mesh))
  train_step, _ = steps_lib.jit_steps(graphdef, optimizer, config, mesh, shardings, features)
  b, t = config.train.batch_size, config.data.seq_len
  batch = measure_lib.synthetic_batch(b, t, config.model.vocab_size, mesh)
  compiled = train_step.lower(state, batch).compile()
  traffic = hlo_traffic.collective_bytes(compiled.as_text(), num_devices)
  param_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["params"]))
  state, metrics = train_step(state, batch)
  jax.block_until_ready(metrics)
  started = time.perf_counter()
  for _ in range(_STEPS.value):
    state, metrics = train_step(state, batch)
  jax.block_until_ready(metrics)
  seconds = (time.perf_counter() - started) / _STEPS.value
  if stages > 1:
    block_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state["params"]["blocks"]))
    minimum = minimum_pipeline_bytes(sizes, stages, config, block_bytes, param_bytes - block_bytes)
  else:
    minimum = minimum_bytes(strategy, sizes, param_bytes, config)
  return {
      "strategy": strategy, "devices": num_devices, "mesh": "x".join(map(str, (stages,) + sizes)),
      "grad_accum": config.train.grad_accum,
      "pipeline_bubble": pipeline.bubble_fraction(stages, config.train.grad_accum, schedule),
      "pipeline_kept_inputs": pipeline.stash_slots(stages, config.train.grad_accum, schedule) if stages > 1 else 0,
      "tokens_per_sec": b * t / seconds, "step_time_sec": seconds, "loss": float(metrics["loss"]),
      "device_memory_bytes": plan.compiled_memory_bytes(compiled),
      "collective_bytes": traffic["total"], "collective_ops": traffic["ops"], "minimum_collective_bytes": minimum,
      "collective_ratio_to_minimum": traffic["total"] / minimum if minimum else None,
  }


def plot(rows: list[dict], path: str) -> None:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
  for strategy in (*STRATEGIES, *PIPELINES):
    sub = [r for r in rows if r["strategy"] == strategy]
    if not sub:
      continue
    n = [r["devices"] for r in sub]
    axes[0].plot(n, [r["tokens_per_sec"] for r in sub], "o-", label=strategy)
    axes[1].plot(n, [r["device_memory_bytes"] / 2**20 for r in sub], "o-", label=strategy)
    axes[2].plot(n, [r["collective_bytes"] / 2**20 for r in sub], "o-", label=strategy)
  for ax, title in zip(axes, ["tokens/s", "per-device memory (MiB)", "collective MiB sent per device per step"]):
    ax.set_title(title)
    ax.set_xlabel("devices")
    ax.set_xticks([1, 2, 4])
    ax.grid(alpha=0.3)
  axes[0].legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  config = config_lib.from_config_dict(_CONFIG.value)
  os.makedirs(_WORKDIR.value, exist_ok=True)
  rows = []
  for num_devices in (1, 2, 4):
    if num_devices > jax.device_count():
      continue
    for strategy in (*STRATEGIES, *PIPELINES):
      if (num_devices == 1 and strategy != "dp") or (_ONLY.value and strategy not in _ONLY.value):
        continue  # one device: every strategy is the same program
      if strategy in ("dp_tp", "pp_dp", "pp_fsdp") and num_devices < 4:
        continue
      if strategy in PIPELINES and config.model.num_layers % PIPELINES[strategy](num_devices)[0]:
        print(f"skipping {strategy} on {num_devices} devices: model.num_layers={config.model.num_layers} does not "
              "split into equal stages", flush=True)
        continue
      row = measure(config, strategy, num_devices)
      rows.append(row)
      print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
  with open(os.path.join(_WORKDIR.value, "scaling.json"), "w") as f:
    json.dump({"rows": rows, "device_kind": jax.devices()[0].device_kind}, f, indent=2)
  plot(rows, os.path.join(_WORKDIR.value, "scaling.png"))


if __name__ == "__main__":
  cli.run(main)
