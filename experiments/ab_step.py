"""A/B of train-step variants in ONE process, rounds interleaved: the way speed options are decided on a noisy
machine (separate processes, or bench.py runs an hour apart, swing by +-10% here; variants run in turns do not).

  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python experiments/ab_step.py --config=experiments/configs/bench_cpu.py \
      --variants="base:,none:model.remat=none,block64:model.attention_block=64" --torch

Each variant is `name:key=value;key=value` over the config (an empty list is the config itself); the first is the
baseline. Every variant's real train step (measure.compiled_train_step) is compiled once, then each runs
--steps_per_round steps per round, in turn, for --rounds rounds; --torch adds torch.compile's GPT-2 step
(bench_torch, same shape) as one more contender. Prints the median seconds per step, the speed-up over the
baseline and CPU-seconds per step, and writes <workdir>/ab.json when --workdir is given. Set GLIBC_TUNABLES as
bench.py does for its runs (huge pages for glibc malloc): it is read when the process starts.
"""

from __future__ import annotations

import os
import resource
import statistics
import time

import jax
import numpy as np
from absl import flags, logging
from ml_collections import config_flags

from jaxlm import cli, files, measure
from jaxlm import config as config_lib

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/configs/bench_cpu.py", "the baseline config")
_VARIANTS = flags.DEFINE_string("variants", "base:", "name:key=value;key=value entries, comma-separated")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "rounds; every contender runs once per round")
_STEPS = flags.DEFINE_integer("steps_per_round", 2, "steps per contender per round")
_TORCH = flags.DEFINE_bool("torch", False, "add torch.compile's GPT-2 step of the baseline's shape")
_WORKDIR = flags.DEFINE_string("workdir", None, "where ab.json goes (optional)")


def variant_config(base, assignments: str):
  """The baseline ConfigDict with `key=value;...` applied, each value read as the type of the key it replaces."""
  config = base.copy_and_resolve_references()
  for assignment in filter(None, assignments.split(";")):
    key, sep, text = assignment.partition("=")
    section, _, name = key.strip().partition(".")
    if not sep or section not in config or name not in config[section]:
      raise ValueError(f"variant assignment {assignment!r} is not <section>.<key>=<value> of the config")
    old = config[section][name]
    config[section][name] = text == "True" if isinstance(old, bool) else type(old)(text)
  return config_lib.from_config_dict(config)


class JaxStep:
  def __init__(self, config):
    self.step, self.state, self.batch, _ = measure.compiled_train_step(config)
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

  def run(self, steps: int) -> None:
    self.step.run(steps)


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
  contenders = {name: JaxStep(config) for name, config in variants.items()}
  if _TORCH.value:
    contenders["torch_compile"] = TorchStep(next(iter(variants.values())))
  seconds = {name: [] for name in contenders}
  cpu = {name: [] for name in contenders}
  for _ in range(_ROUNDS.value):
    for name, contender in contenders.items():
      wall, busy = time.perf_counter(), cpu_seconds()
      contender.run(_STEPS.value)
      seconds[name].append((time.perf_counter() - wall) / _STEPS.value)
      cpu[name].append((cpu_seconds() - busy) / _STEPS.value)
  baseline = statistics.median(seconds[next(iter(variants))])
  rows = {name: {"step_sec": statistics.median(s), "step_sec_min": min(s), "speedup": baseline / statistics.median(s),
                 "cpu_sec_per_step": statistics.median(cpu[name]), "rounds_sec": s} for name, s in seconds.items()}
  for name, row in rows.items():
    print(f"{name:24s} {row['step_sec']:.3f} s/step (min {row['step_sec_min']:.3f})  x{row['speedup']:.3f}  "
          f"{row['cpu_sec_per_step']:.2f} CPU-s/step")
  if _WORKDIR.value:
    os.makedirs(_WORKDIR.value, exist_ok=True)
    files.write_json(os.path.join(_WORKDIR.value, "ab.json"),
                     {"variants": _VARIANTS.value, "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
                      "load_average": os.getloadavg()[0], "rows": rows})


if __name__ == "__main__":
  cli.run(main)
