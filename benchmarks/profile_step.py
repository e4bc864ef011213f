"""Where one train step's time goes: the configured step under `jax.profiler`, op by op, grouped by kind.

  python benchmarks/profile_step.py --config=benchmarks/configs/bench_cpu.py --workdir=runs/profile
  python benchmarks/profile_step.py --config=benchmarks/configs/bench_gpu.py --workdir=runs/profile_gpu

Writes <workdir>/profile.json (step wall time, milliseconds per step of every kind and of the top ops, each with
its shape and the JAX operation it came from), the compiled step's HLO (<workdir>/step.hlo.txt.gz) and the raw
trace under <workdir>/trace (open it with TensorBoard's profile plugin or xprof for the timeline). Each profiled
event is matched by name to its instruction in the compiled step's HLO, and the instruction decides the kind:
matmul (a dot, or a fusion / library call around one), attention (cuDNN), collective, copy/transpose, slicing,
reduce, elementwise. On a GPU the events are the device's kernels, one stream, so they add up to about the step;
kernels that belong to no instruction (cuBLAS, cuDNN) are counted under their own names. On the CPU they are XLA's
thunks on its worker threads, which overlap, so the kinds add up to thread time; `wall_time_shares` then says how
the wall time splits by what runs at once (jaxlm.planner.check_against_runs.wall_time_shares).
"""

from __future__ import annotations

import collections
import glob
import gzip
import os
import shutil
import time

import jax
from absl import flags, logging
from ml_collections import config_flags

from jaxlm import cli
from jaxlm import config as config_lib
from jaxlm.planner import check_against_runs, hlo_traffic
from jaxlm.training import atomic_files

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file (model, batch, mesh)")
_WORKDIR = flags.DEFINE_string("workdir", None, "where profile.json and the trace go")
_STEPS = flags.DEFINE_integer("steps", 3, "profiled steps (after two unprofiled ones)")
_TOP = flags.DEFINE_integer("top", 25, "ops listed by time")
flags.mark_flags_as_required(["config", "workdir"])

def op_events(trace_dir: str, kinds: dict[str, str]) -> tuple[collections.Counter, list[tuple], list[dict]]:
  """(nanoseconds per HLO instruction over the trace, (start, end, instruction) of each event of the first plane,
  what the trace holds): the device's kernel events on a GPU/TPU, XLA's thunks on the CPU (host threads named
  XLA/Eigen), matched by their `hlo_op` stat or their name. Device kernels that match no instruction (library
  kernels) are counted under their kernel name, which is added to `kinds`. The intervals come from one plane (the first
  device, or the host's threads), so that devices running side by side do not read as ops running at once. The third
  value lists each plane's lines with a few sample events, for when nothing matches."""
  path = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True)[0]
  profile = jax.profiler.ProfileData.from_file(path)
  device_planes = [p for p in profile.planes if p.name.startswith(("/device:GPU", "/device:TPU"))]
  per_op: collections.Counter = collections.Counter()
  intervals = []
  contents = []
  for plane_index, plane in enumerate(device_planes or [p for p in profile.planes if p.name.startswith("/host:CPU")]):
    lines = list(plane.lines)
    contents.append({"plane": plane.name, "lines": [_line_sample(line) for line in lines[:12]]})
    if device_planes:  # a GPU plane has the ops once on "XLA Ops" and again as kernels on its stream lines
      # (XLA:GPU's CUDA-graph replays leave only the stream lines; "XLA Modules"/"Steps" events span whole steps)
      lines = ([line for line in lines if line.name == "XLA Ops"]
               or [line for line in lines if line.name.startswith("Stream")] or lines)
    else:
      lines = [line for line in lines if "XLAEigen" in line.name or "XLACpu" in line.name]
    for line in lines:
      for event in line.events:
        stats = dict(event.stats) if hasattr(event, "stats") else {}
        # The `hlo_op` stat where the profiler sets one, else the event's (kernel's) own name.
        name = next(filter(None, (hlo_traffic.event_instruction(str(n).lstrip("%"), kinds)
                                  for n in (stats.get("hlo_op"), event.name) if n)), None)
        if name is None and device_planes:
          # A kernel with no HLO name (a cuBLAS/cuDNN kernel inside a CUDA graph): counted under its own name.
          name = str(event.name)[:100]
          kinds.setdefault(name, hlo_traffic.library_kernel_kind(name))
        # Loops and calls are left out: their events span the ops inside them, which are counted themselves.
        if name is not None and kinds[name] != "control":
          per_op[name] += event.duration_ns
          if plane_index == 0:
            intervals.append((event.start_ns, event.start_ns + event.duration_ns, name))
  if not contents:
    contents = [{"plane": p.name, "lines": [_line_sample(line) for line in list(p.lines)[:4]]} for p in profile.planes]
  return per_op, intervals, contents


def _line_sample(line) -> dict:
  events = list(line.events)
  samples = []
  for event in events[:3]:
    stats = dict(event.stats) if hasattr(event, "stats") else {}
    samples.append({"name": str(event.name)[:120], "stats": {str(k): str(v)[:80] for k, v in stats.items()}})
  return {"line": line.name, "events": len(events), "samples": samples}


def main(argv):
  del argv  # flags only: cli.run refuses positional arguments
  logging.set_verbosity(logging.WARNING)
  config = config_lib.from_config_dict(_CONFIG.value)
  workdir = _WORKDIR.value
  os.makedirs(workdir, exist_ok=True)
  compiled, state, batch, _ = check_against_runs.compiled_train_step(config)
  hlo_text = compiled.as_text()
  kinds = hlo_traffic.instruction_kinds(hlo_text)
  # The compiled module beside the profile, so that a top op's name (a fusion) can be read back to what it computes.
  with gzip.open(os.path.join(workdir, "step.hlo.txt.gz"), "wt") as f:
    f.write(hlo_text)
  for _ in range(2):  # compile-free warm-up: allocations, autotuning caches
    state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  trace_dir = os.path.join(workdir, "trace")
  shutil.rmtree(trace_dir, ignore_errors=True)
  steps = _STEPS.value
  with jax.profiler.trace(trace_dir):
    started = time.perf_counter()
    for _ in range(steps):
      state, metrics = compiled(state, batch)
    jax.block_until_ready(metrics)
    step_ms = (time.perf_counter() - started) / steps * 1e3
  per_op, intervals, contents = op_events(trace_dir, kinds)
  if not per_op:
    atomic_files.write_json(os.path.join(workdir, "trace_contents.json"), contents)
    raise ValueError(f"the trace under {trace_dir} holds no events of the step's HLO ops (what it holds: "
                     f"{workdir}/trace_contents.json); is the profiler plugin for this backend installed?")
  by_kind: collections.Counter = collections.Counter()
  for name, ns in per_op.items():
    by_kind[kinds[name]] += ns
  ms = lambda ns: ns / steps / 1e6
  top = per_op.most_common(_TOP.value)
  summaries = hlo_traffic.instruction_summaries(hlo_text, [name for name, _ in top])
  result = {
      "backend": jax.default_backend(), "device_kind": jax.devices()[0].device_kind, "steps": steps,
      "step_ms": step_ms, "op_ms_total": ms(sum(per_op.values())),
      "kinds_ms": {k: ms(v) for k, v in by_kind.most_common()},
      "wall_time_shares": check_against_runs.wall_time_shares([(start, end, kinds[name])
                                                               for start, end, name in intervals]),
      "top_ops": [{"op": name, "kind": kinds[name], "ms": ms(ns), **summaries.get(name, {})} for name, ns in top],
  }
  atomic_files.write_json(os.path.join(workdir, "profile.json"), result)
  print(f"step {step_ms:.2f} ms wall; ops {result['op_ms_total']:.2f} ms per step "
        f"({'one device stream' if result['backend'] != 'cpu' else 'CPU thread time, threads overlap'})")
  for kind, value in result["kinds_ms"].items():
    print(f"  {kind:20s} {value:9.2f} ms  {100 * value / result['op_ms_total']:5.1f}%")
  print("wall time: " + ", ".join(f"{state} {100 * share:.1f}%" for state, share in result["wall_time_shares"].items()))
  print("top ops:")
  for row in result["top_ops"]:
    print(f"  {row['ms']:9.3f} ms  {row['kind']:18s} {row['op'][:60]:60s} {row.get('shape', '')[:50]:50s} "
          f"{row.get('source', '')[-60:]}")
  print(f"wrote {workdir}/profile.json and {trace_dir}")


if __name__ == "__main__":
  cli.run(main)
