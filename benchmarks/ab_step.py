"""A/B of train-step variants in ONE process, rounds interleaved: the way speed options are decided on a noisy
machine: separate processes, or bench.py runs far apart, see different loads; variants run in turns see the same.

  python benchmarks/ab_step.py --config=benchmarks/configs/bench_cpu.py \
      --variants="base:,none:kernels.remat=none,block64:kernels.attention_block=64" --torch

Each variant is `name:key=value;key=value` over the config (an empty list is the config itself); the first is the
baseline. A key `xla.<option>` is an XLA debug option for that variant's compile alone (e.g.
`cublas:xla.xla_gpu_enable_triton_gemm=False`), so flag choices are timed side by side in one process too; a
variant that fails to compile (an option this XLA lacks, too little memory) is reported and skipped. Every
variant's real train step (check_against_runs.compiled_train_step) is compiled once, then each runs --steps_per_round
steps per round, in turn, for --rounds rounds; --torch adds torch.compile's GPT-2 step (bench_torch, same shape) as one
more contender. Prints the median milliseconds per step, the speed-up over the baseline, tokens/s, MFU (model
FLOPs of jaxlm.training.telemetry.flops_per_token over the device's peak: the bf16 datasheet peak on accelerators, a
measured matmul rate on the CPU) and CPU-seconds per step, and writes <workdir>/ab.json when --workdir is given.
--hlo also counts each variant's custom calls by target in its compiled step (e.g. `__cublas$lt$matmul$f8`, the fp8
GEMMs of kernels.matmul=fp8) into ab.json and prints them, and writes the HLO text to <workdir>/hlo/<name>.txt.gz.
Like every script it runs with huge pages for glibc's malloc (jaxlm.cli; JAXLM_NO_HUGE_PAGES=1 runs without).
"""

from __future__ import annotations

import collections
import gzip
import os
import re
import resource
import statistics
import time

import jax
import numpy as np
from absl import flags, logging
from ml_collections import config_flags

from jaxlm import cli
from jaxlm import config as config_lib
from jaxlm.planner import check_against_runs
from jaxlm.training import atomic_files, telemetry

_CONFIG = config_flags.DEFINE_config_file("config", "benchmarks/configs/bench_cpu.py", "the baseline config")
_VARIANTS = flags.DEFINE_string("variants", "base:", "name:key=value;key=value entries, comma-separated")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "rounds; every contender runs once per round")
_STEPS = flags.DEFINE_integer("steps_per_round", 2, "steps per contender per round")
_WARMUP_STEPS = flags.DEFINE_integer(
    "warmup_steps_per_round", 1, "untimed steps before each contender's timed steps in every round: the first step "
    "after another contender ran is slower (cold caches), which would favour whoever runs later in a round")
_TORCH = flags.DEFINE_bool("torch", False, "add torch.compile's GPT-2 step of the baseline's shape")
_WORKDIR = flags.DEFINE_string("workdir", None, "where ab.json goes (optional)")
_HLO = flags.DEFINE_bool("hlo", False, "count each variant's custom calls in its compiled step; with --workdir, also "
                         "write its HLO text to <workdir>/hlo/<name>.txt.gz")


def _literal(text: str):
  """An XLA option's value: True/False, an integer, or the text itself."""
  if text in ("True", "False"):
    return text == "True"
  try:
    return int(text)
  except ValueError:
    return text


def variant_config(base, assignments: str):
  """(typed config, XLA compiler options): the baseline ConfigDict with `key=value;...` applied, each value read as
  the type of the key it replaces; `xla.<option>=value` entries go to the compiler options instead."""
  config = base.copy_and_resolve_references()
  compiler_options = {}
  for assignment in filter(None, assignments.split(";")):
    key, sep, text = assignment.partition("=")
    section, _, name = key.strip().partition(".")
    if sep and section == "xla" and name.startswith("xla_"):
      compiler_options[name] = _literal(text)
      continue
    if not sep or section not in config or name not in config[section]:
      raise ValueError(f"variant assignment {assignment!r} is not <section>.<key>=<value> of the config (or "
                       "xla.<xla_option>=<value>)")
    old = config[section][name]
    config[section][name] = text == "True" if isinstance(old, bool) else type(old)(text)
  return config_lib.from_config_dict(config), compiler_options


class JaxStep:
  def __init__(self, config, compiler_options):
    self.step, self.state, self.batch, _ = check_against_runs.compiled_train_step(config,
                                                                                  compiler_options=compiler_options)
    self.tokens_per_step = config.train.batch_size * config.data.seq_len
    self.flops_per_token = telemetry.flops_per_token(config.model, config.data.seq_len)
    self.run(1)  # first execution: allocations, thread pools

  def run(self, steps: int) -> None:
    for _ in range(steps):
      self.state, metrics = self.step(self.state, self.batch)
    jax.block_until_ready(metrics)


class TorchStep:
  def __init__(self, config):
    import bench_torch  # noqa: PLC0415  (beside this file; imports torch)
    if reason := bench_torch.available(jax.default_backend()):
      raise ValueError(f"--torch: {reason}")
    b, t = config.train.batch_size, config.data.seq_len
    tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (b, t + 1)).astype(np.int32)
    self.step = bench_torch.TorchGPT2Step(config.model, tokens, "compile", jax.default_backend())
    self.tokens_per_step = b * t
    self.flops_per_token = telemetry.flops_per_token(config.model, t)

  def run(self, steps: int) -> None:
    self.step.run(steps)


def custom_calls(hlo_text: str) -> dict[str, int]:
  """How many custom calls of each target the compiled HLO holds (cuBLAS GEMMs, cuDNN attention, FFI kernels)."""
  return dict(collections.Counter(re.findall(r'custom_call_target="([^"]+)"', hlo_text)))


def _first_line(error: Exception) -> str:
  return f"{type(error).__name__}: {(str(error).splitlines() or [''])[0][:300]}"


def cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def main(argv):
  del argv  # flags only: cli.run refuses positional arguments
  logging.set_verbosity(logging.WARNING)
  variants = {}
  for entry in _VARIANTS.value.split(","):
    name, sep, assignments = entry.partition(":")
    if not sep or not name.strip():
      raise ValueError(f"--variants entry {entry!r} is not name:key=value;key=value")
    variants[name.strip()] = variant_config(_CONFIG.value, assignments)
  baseline_config = next(iter(variants.values()))[0]
  contenders, failed = {}, {}
  for name, variant in variants.items():
    try:
      contenders[name] = JaxStep(*variant)
    except Exception as e:  # noqa: BLE001  (an option this XLA lacks, or out of memory: time the others)
      if not contenders:
        raise  # the baseline itself must work
      failed[name] = _first_line(e)
      print(f"variant {name} skipped: {failed[name]}")
  if _TORCH.value:
    try:
      contenders["torch_compile"] = TorchStep(baseline_config)
    except Exception as e:  # noqa: BLE001  (the jaxlm rows still stand)
      failed["torch_compile"] = _first_line(e)
      print(f"torch_compile skipped: {failed['torch_compile']}")
  # Model FLOPs per device (one device here, as bench.py) over this peak; compute dtype of the baseline.
  peak, peak_source = telemetry.peak_flops_per_device(dtype=baseline_config.model.compute_dtype)
  seconds = {name: [] for name in contenders}
  cpu = {name: [] for name in contenders}
  for _ in range(_ROUNDS.value):
    for name, contender in contenders.items():
      if _WARMUP_STEPS.value:
        contender.run(_WARMUP_STEPS.value)
      wall, busy = time.perf_counter(), cpu_seconds()
      contender.run(_STEPS.value)
      seconds[name].append((time.perf_counter() - wall) / _STEPS.value)
      cpu[name].append((cpu_seconds() - busy) / _STEPS.value)
  calls = {}
  for name, contender in contenders.items():
    if _HLO.value and isinstance(contender, JaxStep):
      text = contender.step.as_text()
      calls[name] = custom_calls(text)
      print(f"{name} custom calls: {calls[name]}")
      if _WORKDIR.value:
        os.makedirs(os.path.join(_WORKDIR.value, "hlo"), exist_ok=True)
        with gzip.open(os.path.join(_WORKDIR.value, "hlo", f"{name}.txt.gz"), "wt") as f:
          f.write(text)
  base = next(iter(variants))
  baseline_tokens_per_sec = [contenders[base].tokens_per_step / x for x in seconds[base]]
  rows = {}
  for name, s in seconds.items():
    step = statistics.median(s)
    tokens_per_sec = contenders[name].tokens_per_step / step
    # Speedups in tokens/s, so a variant with another batch size compares by throughput. Paired: round by round
    # against the baseline run just before it; the median of those and a distribution-free ~95% interval for it
    # (check_against_runs.median_interval): an interval around 1.0 shows neither faster.
    paired = [contenders[name].tokens_per_step / x / b for x, b in zip(s, baseline_tokens_per_sec)]
    low, high, coverage = check_against_runs.median_interval(paired)
    rows[name] = {"step_sec": step, "step_sec_min": min(s),
                  "speedup": tokens_per_sec / statistics.median(baseline_tokens_per_sec),
                  "paired_speedup": statistics.median(paired), "paired_interval": [low, high],
                  "paired_interval_coverage": coverage,
                  "tokens_per_sec": tokens_per_sec, "mfu": tokens_per_sec * contenders[name].flops_per_token / peak,
                  "cpu_sec_per_step": statistics.median(cpu[name]), "rounds_sec": s}
    if name in calls:
      rows[name]["custom_calls"] = calls[name]
  for name, row in rows.items():
    print(f"{name:24s} {row['step_sec'] * 1e3:8.1f} ms/step (min {row['step_sec_min'] * 1e3:.1f})  "
          f"x{row['speedup']:.3f} (paired x{row['paired_speedup']:.3f}, {row['paired_interval_coverage']:.0%} "
          f"interval {row['paired_interval'][0]:.3f}-{row['paired_interval'][1]:.3f})  "
          f"{row['tokens_per_sec']:,.0f} tokens/s  MFU {row['mfu']:.1%}  {row['cpu_sec_per_step']:.2f} CPU-s/step")
  print(f"MFU peak: {peak / 1e12:.1f} TFLOP/s ({peak_source})")
  if _WORKDIR.value:
    os.makedirs(_WORKDIR.value, exist_ok=True)
    atomic_files.write_json(os.path.join(_WORKDIR.value, "ab.json"),
                     {"variants": _VARIANTS.value, "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
                      "load_average": os.getloadavg()[0], "peak_flops": peak, "peak_source": peak_source,
                      "device_kind": jax.devices()[0].device_kind, "jax_version": jax.__version__, "rows": rows,
                      "failed": failed})


if __name__ == "__main__":
  cli.run(main)
