"""One config's real train step beside the planner's prediction of its peak memory per device: what a user sizing a
run (e.g. QLoRA of a 7B Llama on one GPU) should trust the plan for.

  python benchmarks/step_memory.py --config=experiments/configs/llama_7b_qlora.py --workdir=runs/qlora_7b_memory \
      --config.train.batch_size=4

Builds the step as a run does (random weights, so no checkpoint is needed; the LoRA base quantized as lora.base
says), runs --steps steps and writes <workdir>/step_memory.json: the median step time, the device's measured peak
bytes in use (the allocator's statistics, on GPUs and TPUs; absent on the CPU), the compiled program's bytes
(arguments + outputs + temporaries - aliased) and the planner's predicted peak with its parts, each with the ratio
predicted / measured.
"""

from __future__ import annotations

import os
import statistics
import time

import jax
from absl import flags, logging
from ml_collections import config_flags

from jaxlm import cli
from jaxlm import config as config_lib
from jaxlm.planner import check_against_runs, estimates_lora, plan
from jaxlm.training import atomic_files

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file")
_WORKDIR = flags.DEFINE_string("workdir", None, "where step_memory.json goes")
_STEPS = flags.DEFINE_integer("steps", 3, "timed steps after the first")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv  # flags only: cli.run refuses positional arguments
  logging.set_verbosity(logging.WARNING)
  config = config_lib.from_config_dict(_CONFIG.value)
  device = jax.devices()[0]
  compiled, state, batch, _ = check_against_runs.compiled_train_step(config, [device])
  state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  times = []
  for _ in range(_STEPS.value):
    started = time.perf_counter()
    state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - started)
  stats = device.memory_stats() or {}
  predicted = plan.predict_row_memory(config, (1, 1, 1), config.train.grad_accum, device.platform)
  out = {
      "device_kind": device.device_kind, "platform": device.platform,
      "model": f"{config.model.flavour} L{config.model.num_layers} d{config.model.d_model} ff{config.model.d_ff}",
      "lora": f"rank {config.lora.rank} base {config.lora.base}" if config.lora.rank else "none",
      "batch_size": config.train.batch_size, "seq_len": config.data.seq_len, "grad_accum": config.train.grad_accum,
      "median_step_sec": statistics.median(times), "loss": float(metrics["loss"]),
      "compiled_bytes": plan.compiled_memory_bytes(compiled),
      "predicted_peak_bytes": predicted,
  }
  if config.lora.rank:
    out["predicted_parts_bytes"] = estimates_lora.predict_lora_memory(config, (1, 1, 1), config.train.grad_accum,
                                                                      device.platform)
  if "peak_bytes_in_use" in stats:
    out["measured_peak_bytes"] = stats["peak_bytes_in_use"]
    out["predicted_over_measured_peak"] = predicted / stats["peak_bytes_in_use"]
  out["predicted_over_compiled"] = predicted / out["compiled_bytes"]
  os.makedirs(_WORKDIR.value, exist_ok=True)
  atomic_files.write_json(os.path.join(_WORKDIR.value, "step_memory.json"), out)
  gib = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
  peak = gib(out["measured_peak_bytes"]) if "measured_peak_bytes" in out else "n/a"
  print(f"{out['model']}, LoRA {out['lora']}, batch {out['batch_size']} x {out['seq_len']}: step "
        f"{out['median_step_sec']:.3f} s; peak {peak}, compiled {gib(out['compiled_bytes'])}, "
        f"predicted {gib(predicted)}")


if __name__ == "__main__":
  cli.run(main)
