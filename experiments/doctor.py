"""What to run first on a new machine: library versions, backend, devices, whether bf16 matmuls run, how fast.

  python experiments/doctor.py                      # prints a report
  python experiments/doctor.py --workdir=runs/doctor   # also writes runs/doctor/doctor.json

The measured matmul rate over the device's datasheet bf16 peak (jaxlm.training.telemetry.PEAK_FLOPS_BF16) is the
`matmul_efficiency` to put in your jaxlm/planner/hardware.json profile; the softmax stream rate is what the planner's
memory term runs at. Takes a few seconds on a GPU, about 10 s on a 2-core CPU.
"""

import importlib.metadata
import json
import os
import platform
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from jaxlm import cli
from jaxlm.planner import check_against_runs
from jaxlm.training import telemetry

_WORKDIR = flags.DEFINE_string("workdir", None, "if given, doctor.json is written here")
_MATMUL_SIZE = flags.DEFINE_integer("matmul_size", 0, "n of the n x n x n matmul; 0 = 1024 on CPU, 8192 elsewhere")


def versions() -> dict:
  result = {"python": platform.python_version()}
  for package in ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "numpy"):
    try:
      result[package] = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
      result[package] = "not installed"
  return result


def device_memory_bytes(device) -> int | None:
  try:
    stats = device.memory_stats()
  except (NotImplementedError, RuntimeError):
    stats = None
  if stats and "bytes_limit" in stats:
    return int(stats["bytes_limit"])
  if device.platform == "cpu" and hasattr(os, "sysconf"):  # the CPU backend keeps no stats: report host RAM
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  return None


def bf16_matmul_check(device) -> str:
  """'ok (max relative error vs f32 ...)' or the error raised: some backends and old GPUs have no bf16 matmul."""
  try:
    x = jax.device_put(np.random.default_rng(0).standard_normal((256, 256), dtype=np.float32), device)
    exact = np.asarray(x @ x)
    approx = np.asarray(jax.jit(lambda a: (a.astype(jnp.bfloat16) @ a.astype(jnp.bfloat16)))(x), dtype=np.float32)
    error = float(np.max(np.abs(approx - exact)) / np.max(np.abs(exact)))
    return f"ok (max error {error:.1e} of the largest entry vs f32)" if error < 0.05 else f"WRONG (error {error:.2f})"
  except Exception as e:  # noqa: BLE001  (a doctor reports every failure instead of stopping)
    return f"failed: {type(e).__name__}: {str(e).splitlines()[0]}"


def main(argv):
  del argv  # flags only: cli.run refuses positional arguments
  started = time.time()
  device = jax.devices()[0]
  n = _MATMUL_SIZE.value or (1024 if device.platform == "cpu" else 8192)
  report = {"versions": versions(), "backend": jax.default_backend(), "process_count": jax.process_count(),
            "device_count": jax.device_count(),
            "devices": [{"id": d.id, "platform": d.platform, "kind": d.device_kind,
                         "memory_bytes": device_memory_bytes(d)} for d in jax.local_devices()],
            "bf16_matmul": bf16_matmul_check(device)}
  rates = {}
  for dtype in ("float32", "bfloat16"):
    try:
      rates[dtype] = telemetry.measure_matmul_flops(n, jnp.dtype(dtype), device=device)
    except Exception as e:  # noqa: BLE001
      rates[dtype] = f"failed: {type(e).__name__}"
  report[f"matmul_flops_{n}^3"] = rates
  report["softmax_stream_bytes_per_sec"] = check_against_runs.measure_stream_bandwidth(device=device)
  peak = telemetry.lookup_peak_flops(device.device_kind) if device.platform != "cpu" else None
  if peak and isinstance(rates["bfloat16"], float):
    report["datasheet_bf16_peak"] = {"table_key": peak[0], "flops": peak[1]}
    report["matmul_efficiency"] = rates["bfloat16"] / peak[1]
  report["seconds"] = round(time.time() - started, 1)

  print(f"python {report['versions']['python']} on {platform.platform()}")
  print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if k != "python"))
  print(f"backend: {report['backend']}, {report['device_count']} device(s), {report['process_count']} process(es)")
  for d in report["devices"]:
    memory = f"{d['memory_bytes'] / 2**30:.1f} GiB" if d["memory_bytes"] else "unknown memory"
    host = " (host RAM, shared by all CPU devices)" if d["platform"] == "cpu" and d["memory_bytes"] else ""
    print(f"  device {d['id']}: {d['platform']} {d['kind']!r}, {memory}{host}")
  print(f"bf16 matmul: {report['bf16_matmul']}")
  for dtype, rate in rates.items():
    print(f"{n}^3 {dtype} matmul: " + (f"{rate / 1e12:.3f} TFLOP/s" if isinstance(rate, float) else rate))
  print(f"softmax stream: {report['softmax_stream_bytes_per_sec'] / 1e9:.1f} GB/s")
  if "matmul_efficiency" in report:
    print(f"bf16 matmul at {100 * report['matmul_efficiency']:.0f}% of the {peak[0]!r} datasheet peak "
          f"({peak[1] / 1e12:.0f} TFLOP/s): use it as matmul_efficiency in jaxlm/planner/hardware.json")
  if _WORKDIR.value:
    os.makedirs(_WORKDIR.value, exist_ok=True)
    with open(os.path.join(_WORKDIR.value, "doctor.json"), "w") as f:
      json.dump(report, f, indent=2)
    print(f"wrote {_WORKDIR.value}/doctor.json")
  sys.stdout.flush()


if __name__ == "__main__":
  cli.run(main)
