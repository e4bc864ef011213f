"""Collective bytes of Muon's train step against AdamW's on 4-device layouts, read from the compiled HLO.

  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python benchmarks/muon_collectives.py \
      --out=benchmarks/results/cpu_muon_vs_adamw_collective_bytes.json

Newton-Schulz multiplies whole matrices: on a mesh that shards the weights (FSDP, tensor parallelism) GSPMD must move
the momentum between devices, which AdamW's elementwise update never does. This counts what each device sends per
step (jaxlm.planner.hlo_traffic, ring collectives) for experiments/configs/demo.py's model at batch 8, one
micro-batch, on data, fsdp, tensor and data x tensor layouts. Nothing runs; the programs are only compiled.
"""

from __future__ import annotations

import dataclasses
import json
import os
import runpy
import sys

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from jaxlm import cli  # noqa: E402,F401  (the scripts' environment)
from jaxlm import config as config_lib  # noqa: E402
from jaxlm.planner import plan  # noqa: E402
from jaxlm.training import atomic_files  # noqa: E402

_OUT = flags.DEFINE_string("out", "benchmarks/results/cpu_muon_vs_adamw_collective_bytes.json", "results JSON")
LAYOUTS = {"data4": (4, 1, 1), "fsdp4": (1, 4, 1), "tensor4": (1, 1, 4), "data2_tensor2": (2, 1, 2)}


def main(argv):
  del argv
  import jax  # noqa: PLC0415
  base = config_lib.from_config_dict(runpy.run_path(os.path.join(ROOT, "experiments/configs/demo.py"))["get_config"]())
  results = {"command": "XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python "
                        + " ".join(sys.argv), "layouts": {}}
  for name, sizes in LAYOUTS.items():
    row = {}
    for optimizer in ("adamw", "muon"):
      config = dataclasses.replace(base, train=dataclasses.replace(base.train, optimizer=optimizer))
      compiled = plan.compile_train_step(plan.with_mesh(config, sizes, grad_accum=1), jax.devices()[:4])
      row[optimizer] = plan.compiled_collective_bytes(compiled, 4)["total"]
    row["muon_over_adamw"] = row["muon"] / row["adamw"] if row["adamw"] else None
    results["layouts"][name] = row
    print(name, row, flush=True)
  atomic_files.write_json(_OUT.value, results)


if __name__ == "__main__":
  app.run(main)
