"""Grid or random search over `--config.*` values: each run in its own workdir, then a table sorted by a metric.

  python experiments/sweep.py --config=experiments/configs/finetune_bert.py --workdir=runs/sweep \
      --grid=train.learning_rate=5e-5,1e-4,2e-4 --grid=train.batch_size=16,32 --metric=f1_macro
  python experiments/sweep.py --config=... --workdir=runs/rs --random=8 --seed=0 \
      --sample=train.learning_rate=loguniform:1e-5:1e-3 --sample=train.warmup_steps=int:0:20 \
      --sample=data.batching=dynamic,bucket -- --config.train.steps=100
  python experiments/sweep.py ... --launch=print     # only print one command per run (for a cluster scheduler)
  python experiments/sweep.py ... --launch=none      # only (re)build the summary from the runs' eval.json

Runs go one after another here (`--launch=local`); a run whose eval.json exists is not started again, and an
interrupted run resumes from its checkpoint, so re-running the sweep finishes it. Flags after `--` go to every run.
`<workdir>/<run>/` is each run's workdir; `<workdir>/sweep.json` (every run: its values, status and eval.json
numbers) and `<workdir>/summary.md` (the table, best first) are rewritten after every run.

Value specs: `--grid=key=v1,v2,...` (every combination of all grid keys); `--sample=key=SPEC` for `--random=N`
draws, SPEC one of `v1,v2,...` (uniform choice), `uniform:lo:hi`, `loguniform:lo:hi`, `int:lo:hi` (inclusive);
grid keys and samples may be mixed (each random draw is crossed with the grid).
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shlex
import subprocess
import sys
from typing import Any

from absl import app, flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # jaxlm from a checkout, too
from jaxlm import cli  # noqa: E402
from jaxlm.training import atomic_files

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_assignment(text: str, flag: str) -> tuple[str, str]:
  key, sep, values = text.partition("=")
  if not sep or not key or not values or not re.fullmatch(r"[A-Za-z_][\w.]*", key):
    raise ValueError(f"--{flag}={text!r} must look like section.key=values, e.g. train.learning_rate=1e-4,3e-4")
  return key.removeprefix("config."), values


def grid_points(grid: list[str]) -> list[dict[str, str]]:
  """Every combination of the --grid values, in flag order (the last key varies fastest)."""
  axes = [parse_assignment(g, "grid") for g in grid]
  keys = [k for k, _ in axes]
  if len(set(keys)) != len(keys):
    raise ValueError(f"a key appears twice in --grid: {keys}")
  values = [[v.strip() for v in vs.split(",") if v.strip()] for _, vs in axes]
  return [dict(zip(keys, combo)) for combo in itertools.product(*values)]


def sample_points(samples: list[str], count: int, seed: int) -> list[dict[str, str]]:
  """`count` seeded draws of the --sample specs (the same seed gives the same draws on every machine)."""
  import random  # noqa: PLC0415

  specs = [parse_assignment(s, "sample") for s in samples]
  rng = random.Random(seed)
  points = []
  for _ in range(count):
    point = {}
    for key, spec in specs:
      kind, _, bounds = spec.partition(":")
      if kind in ("uniform", "loguniform", "int") and bounds:
        try:
          lo, hi = (float(b) for b in bounds.split(":"))
        except ValueError:
          raise ValueError(f"--sample={key}={spec!r}: give {kind}:low:high with two numbers") from None
        if kind == "uniform":
          point[key] = f"{rng.uniform(lo, hi):.4g}"
        elif kind == "loguniform":
          if lo <= 0 or hi <= 0:
            raise ValueError(f"--sample={key}={spec!r}: loguniform bounds must be > 0")
          point[key] = f"{math.exp(rng.uniform(math.log(lo), math.log(hi))):.3g}"
        else:
          point[key] = str(rng.randint(int(lo), int(hi)))
      else:
        point[key] = rng.choice([v.strip() for v in spec.split(",") if v.strip()])
    points.append(point)
  return points


def run_points(grid: list[str], samples: list[str], count: int, seed: int) -> list[dict[str, str]]:
  grid_part = grid_points(grid) if grid else [{}]
  random_part = sample_points(samples, count, seed) if count else [{}]
  if samples and not count:
    raise ValueError("--sample needs --random=N (the number of draws)")
  if count and not samples:
    raise ValueError("--random=N needs --sample=key=lo:hi,... (what to draw); without it every run is the same")
  overlap = set(grid_part[0]) & set(random_part[0])
  if overlap:
    raise ValueError(f"{sorted(overlap)[0]} is in both --grid and --sample; give it once")
  return [{**g, **r} for r in random_part for g in grid_part]


def run_name(point: dict[str, str], index: int) -> str:
  """A folder name that says what the run changed, e.g. 000_learning_rate=1e-4_batch_size=16."""
  parts = [f"{key.split('.')[-1]}={value}" for key, value in point.items()]
  name = re.sub(r"[^\w.=,+-]", "_", "_".join(parts))[:120]
  return f"{index:03d}_{name}" if name else f"{index:03d}"


def command(script: str, config: str, workdir: str, point: dict[str, str], extra: list[str]) -> list[str]:
  return [sys.executable, script, f"--config={config}", f"--workdir={workdir}",
          *(f"--config.{k}={v}" for k, v in point.items()), *extra]


def summarise(sweep_dir: str, runs: list[dict[str, Any]], metric: str) -> str:
  """Reads each run's eval.json, writes sweep.json and summary.md (best first) and returns the table."""
  lower_first = metric.endswith(("loss", "perplexity"))
  for run in runs:
    path = os.path.join(run["workdir"], "eval.json")
    if os.path.isfile(path):
      with open(path) as f:
        run["eval"] = {k: v for k, v in json.load(f).items() if "/" not in k}
      if run.get("status") != "failed":  # a run that failed now keeps that mark beside an older eval.json
        run["status"] = "done"
  def key(run):
    value = run.get("eval", {}).get(metric)
    if not isinstance(value, (int, float)) or not math.isfinite(value):
      return (1, 0.0)
    return (0, value if lower_first else -value)
  ordered = sorted(runs, key=key)
  columns = list(dict.fromkeys(k for run in runs for k in run["values"]))  # in order of first appearance
  shown = [metric] + [m for m in ("accuracy", "f1_macro", "eval_loss", "wall_time_sec") if m != metric]
  header = ["rank", "run", *columns, *shown, "status"]
  lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
  for rank, run in enumerate(ordered, 1):
    numbers = [run.get("eval", {}).get(m) for m in shown]
    cells = [str(rank), os.path.basename(run["workdir"]), *(run["values"].get(c, "") for c in columns),
             *("-" if n is None else f"{n:.4g}" if isinstance(n, float) else str(n) for n in numbers),
             run.get("status", "pending")]
    lines.append("| " + " | ".join(cells) + " |")
  table = "\n".join(lines)
  os.makedirs(sweep_dir, exist_ok=True)
  atomic_files.write_json(os.path.join(sweep_dir, "sweep.json"), {"metric": metric, "runs": ordered})
  atomic_files.write_text(os.path.join(sweep_dir, "summary.md"),
                   f"# Sweep {os.path.basename(os.path.abspath(sweep_dir))}, sorted by {metric}\n\n{table}\n")
  return table


def main(argv):
  extra = argv[1:]  # the flags after `--`, given to every run
  if any(not a.startswith("--") for a in extra):
    raise app.UsageError(f"unexpected arguments {extra}; give per-run flags after `--`, e.g. "
                         f"-- --config.train.steps=50")
  try:
    points = run_points(_GRID.value, _SAMPLE.value, _RANDOM.value, _SEED.value)
  except ValueError as e:
    raise app.UsageError(str(e)) from None
  keys = sorted({k for p in points for k in p})
  if error := cli.unknown_override([f"--config={_CONFIG.value}", *(f"--config.{k}=_" for k in keys), *extra]):
    raise app.UsageError(error)
  runs = [{"values": p, "workdir": os.path.join(_WORKDIR.value, run_name(p, i))} for i, p in enumerate(points)]
  if _LAUNCH.value == "print":
    for run in runs:
      print(shlex.join(command(_SCRIPT.value, _CONFIG.value, run["workdir"], run["values"], extra)))
    return
  if _LAUNCH.value == "local":
    for i, run in enumerate(runs):
      if os.path.isfile(os.path.join(run["workdir"], "eval.json")):
        continue  # finished in an earlier invocation of this sweep
      print(f"[{i + 1}/{len(runs)}] {os.path.basename(run['workdir'])}", flush=True)
      done = subprocess.run(command(_SCRIPT.value, _CONFIG.value, run["workdir"], run["values"], extra))
      run["status"] = "done" if done.returncode == 0 else "failed"
      summarise(_WORKDIR.value, runs, _METRIC.value)
  print(summarise(_WORKDIR.value, runs, _METRIC.value))


if __name__ == "__main__":  # flags only when run as a script: tests import this module beside other scripts
  _CONFIG = flags.DEFINE_string("config", None, "experiment config file, passed to every run")
  _WORKDIR = flags.DEFINE_string("workdir", None, "sweep folder; each run gets <workdir>/<run name>")
  _SCRIPT = flags.DEFINE_string("script", os.path.join(_ROOT, "experiments", "finetune.py"), "experiment script")
  _GRID = flags.DEFINE_multi_string("grid", [], "key=v1,v2,...: values of one config key (all combinations)")
  _SAMPLE = flags.DEFINE_multi_string("sample", [], "key=SPEC for random search (see the module docstring)")
  _RANDOM = flags.DEFINE_integer("random", 0, "number of random draws of the --sample keys (0 = grid only)")
  _SEED = flags.DEFINE_integer("seed", 0, "seed of the random draws")
  _METRIC = flags.DEFINE_string("metric", "f1_macro", "eval.json number that sorts the table (losses: lower first)")
  _LAUNCH = flags.DEFINE_enum("launch", "local", ["local", "print", "none"],
                              "local: run one after another; print: print the commands; none: summarise only")
  flags.mark_flags_as_required(["config", "workdir"])
  app.run(main)
