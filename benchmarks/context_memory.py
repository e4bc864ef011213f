"""Context parallelism's memory: the train step's temporaries (activations and workspace, XLA's buffer assignment)
per device at a long sequence, one device against `mesh.context` devices, from the compiled programs (nothing runs).

  XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu python benchmarks/context_memory.py \
      --config=experiments/configs/demo.py --seq_len=4096 --context=4 --out=runs/context_memory.json

Rows: one device with its `auto` kernels (remat=dots) and with `kernels.remat=none`; `mesh.context` devices with
theirs (remat=none on a mesh) and with remat=dots. Each row: temporaries, arguments and the whole program per device;
the ratios compare the temporaries at the same recomputation.
"""

from __future__ import annotations

import jax
from absl import flags
from ml_collections import config_flags

from jaxlm import cli
from jaxlm import config as config_lib
from jaxlm.planner import check_against_runs
from jaxlm.training import atomic_files

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/demo.py", "the model and batch")
_SEQ = flags.DEFINE_integer("seq_len", 4096, "tokens per row")
_CONTEXT = flags.DEFINE_integer("context", 4, "devices that split each row's sequence")
_OUT = flags.DEFINE_string("out", None, "where the JSON goes (optional)")


def measure(overrides: dict, devices) -> dict:
  base = _CONFIG.value.to_dict()
  for section, values in overrides.items():
    base[section].update(values)
  config = config_lib.from_config_dict(base)
  compiled, *_ = check_against_runs.compiled_train_step(config, devices)
  m = compiled.memory_analysis()
  return {"temp_bytes": int(m.temp_size_in_bytes), "argument_bytes": int(m.argument_size_in_bytes),
          "program_bytes": int(m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
                               + m.temp_size_in_bytes)}


def main(argv):
  del argv
  seq = {"model": {"max_seq_len": _SEQ.value}, "data": {"seq_len": _SEQ.value}}
  devices = jax.devices()[:_CONTEXT.value]
  one = {**seq, "mesh": {"data": 1}}
  rows = {
      "one_device_auto": measure(one, jax.devices()[:1]),
      "one_device_remat_none": measure({**one, "kernels": {"remat": "none"}}, jax.devices()[:1]),
      f"context_{_CONTEXT.value}_auto": measure({**seq, "mesh": {"data": 1, "context": _CONTEXT.value}},
                                                devices),
      f"context_{_CONTEXT.value}_remat_dots": measure(
          {**seq, "mesh": {"data": 1, "context": _CONTEXT.value}, "kernels": {"remat": "dots"}}, devices),
  }
  split, split_dots = (rows[f"context_{_CONTEXT.value}_{kind}"]["temp_bytes"] for kind in ("auto", "remat_dots"))
  out = {"seq_len": _SEQ.value, "context": _CONTEXT.value, "rows": rows,
         # the same recomputation on both sides: remat=none (the mesh's auto) and remat=dots (one device's auto)
         "temp_vs_one_device_remat_none": split / rows["one_device_remat_none"]["temp_bytes"],
         "temp_vs_one_device_remat_dots": split_dots / rows["one_device_auto"]["temp_bytes"]}
  for name, row in rows.items():
    print(f"{name:24s} temporaries {row['temp_bytes'] / 2**20:8.1f} MiB  arguments {row['argument_bytes'] / 2**20:6.1f} "
          f"MiB  program {row['program_bytes'] / 2**20:8.1f} MiB per device")
  print(f"temporaries, context {_CONTEXT.value} / one device: {out['temp_vs_one_device_remat_none']:.4f} (both "
        f"remat=none), {out['temp_vs_one_device_remat_dots']:.4f} (both remat=dots)")
  if _OUT.value:
    atomic_files.write_json(_OUT.value, out)


if __name__ == "__main__":
  cli.run(main)
