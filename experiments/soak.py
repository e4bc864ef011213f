"""Soak test: kill a training run at random moments, resume it each time, and check it equals an uninterrupted run.

Command:  make soak
          (= python experiments/soak.py --kills=12 --workdir=runs/soak, with 4 simulated CPU devices)
Runtime:  about 4 minutes on a busy 2-core CPU (a 40-step, 2-layer GPT on a 2x2 mesh; ~15 s per restart, as
          compiled programs are cached in <workdir>/jax_cache after the first run).
Expected: the last line reads "soak: 12 kills survived (8 SIGKILL, 4 SIGTERM, N during a checkpoint save), 40 steps
          compared, all bit-identical"; any difference, a SIGTERM that does not exit 0 with a checkpoint at its last
          logged step, or a checkpoint moved aside as corrupt makes it exit 1.

Each kill starts `experiments/train_lm.py` on the same workdir, waits until the run has logged a randomly chosen
step and then a random fraction of a step more (so kills land in steps, in checkpoint saves and in metric writes),
and sends SIGKILL or SIGTERM. A few SIGKILLs land during start-up instead. A SIGTERM must end the process with exit
code 0 after it saved a checkpoint at the last step it logged. After the last kill the run is resumed to the end and
its per-step losses and parameter norms (metrics.jsonl, logged every step) are compared with a run that was never
interrupted, as exact floats. `tests/test_reliability_soak.py` runs the same code with two kills.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU_ENV = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",  # cache every program, so restarts compile nothing
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
COMPARED = ("loss", "param_norm")  # per-step metrics that must match bit for bit
SIGTERM_EXIT_LIMIT_SEC = 120.0  # a SIGTERM must end the run (step finished, checkpoint saved) within this

CONFIG_FILE = '''"""Soak / fault-injection config: a 2-layer GPT on a small corpus, a 2x2 mesh, every step logged."""
from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 320
  config.model.num_layers = 2
  config.model.d_model = 64
  config.model.num_heads = 4
  config.model.max_seq_len = 32
  config.model.compute_dtype = "float32"
  config.mesh.data = 2
  config.mesh.fsdp = 2
  config.data.source = "files"
  config.data.train_files = ({corpus!r},)
  config.data.seq_len = 16
  config.data.eval_fraction = 0.05
  config.train.steps = {steps}
  config.train.batch_size = 8
  config.train.warmup_steps = 2
  config.train.learning_rate = 3e-3
  config.train.eval_batches = 1
  config.checkpoint.every_steps = {every}
  config.checkpoint.keep = 2
  config.log.every_steps = 1
  config.log.progress_bar = False
  config.log.sample_tokens = 0
  return config
'''


@dataclasses.dataclass
class Kill:
  signal: str  # SIGKILL | SIGTERM
  after_step: int | None  # kill once this step is logged (None: during start-up, after `delay` seconds)
  delay: float  # seconds after the trigger
  logged_step: int = 0  # the last step in metrics.jsonl when the signal was sent
  exit_code: int | None = None
  exit_sec: float | None = None  # seconds from the signal to the process's exit
  left_tmp_folder: bool = False  # the kill interrupted a checkpoint save


def write_config(folder: str, steps: int, every_steps: int) -> str:
  """Writes a small corpus and a config file into `folder`; returns the config path."""
  os.makedirs(folder, exist_ok=True)
  corpus = os.path.join(folder, "corpus.jsonl")
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "delta", "return", "def", "value", "(", ")", ":", "=", "+", "1", "2"]
  with open(corpus, "w") as f:
    for _ in range(400):
      f.write(json.dumps({"text": " ".join(rng.choice(words, size=int(rng.integers(5, 40))))}) + "\n")
  path = os.path.join(folder, "soak_config.py")
  with open(path, "w") as f:
    f.write(CONFIG_FILE.format(corpus=os.path.abspath(corpus), steps=steps, every=every_steps))
  return path


def start(config_path: str, workdir: str) -> subprocess.Popen:
  """Starts train_lm.py; compiled programs are cached beside the config, so only the first start compiles."""
  os.makedirs(workdir, exist_ok=True)
  cache = os.path.join(os.path.dirname(os.path.abspath(config_path)), "jax_cache")
  log = open(os.path.join(workdir, "soak_attempts.log"), "a")  # noqa: SIM115 (kept open by the child)
  log.write(f"\n=== start {time.strftime('%H:%M:%S')}\n")
  log.flush()
  command = [sys.executable, os.path.join(REPO, "experiments", "train_lm.py"),
             f"--config={os.path.abspath(config_path)}", f"--workdir={os.path.abspath(workdir)}"]
  env = {**os.environ, **CPU_ENV, "JAX_COMPILATION_CACHE_DIR": cache}
  # The caller's other XLA flags stay (the tests' cheaper compile settings, a dump folder); the device count is ours.
  other_flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", "")).split()
  env["XLA_FLAGS"] = " ".join(other_flags + [CPU_ENV["XLA_FLAGS"]])
  # cwd is the soak folder, so anything a run wrote outside its workdir would show up there.
  return subprocess.Popen(command, cwd=os.path.dirname(cache), env=env, stdout=log, stderr=subprocess.STDOUT)


def metric_lines(workdir: str) -> list[str]:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return f.read().splitlines()


def logged(workdir: str, ignore: frozenset[str] = frozenset()) -> dict[int, dict]:
  """Parsed metrics.jsonl lines by step, except the lines in `ignore`; a line a kill cut in half is ignored."""
  records = {}
  for line in metric_lines(workdir):
    if line in ignore:
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError:
      continue
    records[int(record["step"])] = record
  return records


def checkpoint_folders(workdir: str) -> list[str]:
  folder = os.path.join(workdir, "checkpoints")
  return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def complete_steps(workdir: str) -> list[int]:
  return sorted(int(name) for name in checkpoint_folders(workdir) if name.isdigit())


def run_to_end(config_path: str, workdir: str, timeout: float = 900.0) -> None:
  process = start(config_path, workdir)
  if process.wait(timeout=timeout) != 0:
    raise RuntimeError(f"training in {workdir} exited with {process.returncode}; see {workdir}/soak_attempts.log")


def interrupt(config_path: str, workdir: str, kill: Kill, timeout: float = 600.0) -> Kill:
  """Starts a resume, sends `kill.signal` at the moment `kill` describes, waits for the exit and records it."""
  # Lines an earlier attempt logged stay in the file until this attempt's metrics writer opens; a line counts as
  # progress only when it is new (its timing fields make a re-logged step's line differ).
  earlier = frozenset(metric_lines(workdir))
  leftovers = {name for name in checkpoint_folders(workdir) if "orbax-checkpoint-tmp" in name}
  process = start(config_path, workdir)
  deadline = time.time() + timeout
  if kill.after_step is not None:
    while max(logged(workdir, earlier), default=0) < kill.after_step and process.poll() is None:
      if time.time() > deadline:
        process.kill()
        raise RuntimeError(f"step {kill.after_step} was not logged within {timeout} s in {workdir}")
      time.sleep(0.02)
  time.sleep(kill.delay)
  kill.logged_step = max(logged(workdir), default=0)
  if process.poll() is not None:  # it finished (or failed) first: nothing was killed
    kill.exit_code = process.returncode
    return kill
  sent = time.time()
  process.send_signal(getattr(signal, kill.signal))
  kill.exit_code = process.wait(timeout=SIGTERM_EXIT_LIMIT_SEC * 2)
  kill.exit_sec = time.time() - sent
  # A new temporary folder (not one an earlier kill left) means this kill cut a save short.
  kill.left_tmp_folder = any("orbax-checkpoint-tmp" in name and name not in leftovers
                             for name in checkpoint_folders(workdir))
  return kill


def check_kill(kill: Kill, workdir: str) -> list[str]:
  """Problems with one interrupted attempt (empty when it behaved)."""
  problems = []
  if any(".corrupt-" in name for name in checkpoint_folders(workdir)):
    problems.append(f"a checkpoint was moved aside as unreadable after {kill}")
  if kill.signal == "SIGTERM" and kill.exit_sec is not None:
    steps = complete_steps(workdir)
    last_logged = max(logged(workdir), default=0)
    if kill.exit_code != 0:
      problems.append(f"SIGTERM ended the run with exit code {kill.exit_code}, not 0 ({kill})")
    elif kill.exit_sec > SIGTERM_EXIT_LIMIT_SEC:
      problems.append(f"SIGTERM took {kill.exit_sec:.0f} s to exit ({kill})")
    elif last_logged and (not steps or steps[-1] != last_logged):
      problems.append(f"after SIGTERM the last logged step is {last_logged} but the checkpoints are {steps}")
  return problems


def random_kills(count: int, steps: int, seed: int) -> list[Kill]:
  """`count` kills, SIGKILL and SIGTERM mixed: mostly 1 to 3 steps past the newest checkpoint, plus 0-0.6 s."""
  rng = random.Random(seed)
  kills = []
  for i in range(count):
    if i % 6 == 5:  # now and then during start-up (imports, data, compilation, restore): SIGKILL only
      kills.append(Kill("SIGKILL", None, rng.uniform(0.5, 8.0)))
    else:
      kills.append(Kill(rng.choice(["SIGKILL", "SIGTERM"]), rng.randint(1, 3), rng.uniform(0.0, 0.6)))
  return kills


def soak(folder: str, kills: list[Kill], steps: int, every_steps: int = 2, log=print) -> dict:
  """Runs the reference and the interrupted run under `folder`; returns a summary with `problems` (empty = pass).

  `Kill.after_step` is relative: steps past the newest checkpoint at the time of that attempt, capped so that the
  run never finishes before the signal arrives.
  """
  config_path = write_config(folder, steps, every_steps)
  reference_dir, soak_dir = os.path.join(folder, "reference"), os.path.join(folder, "interrupted")
  for path in (reference_dir, soak_dir):
    shutil.rmtree(path, ignore_errors=True)
  started = time.time()
  run_to_end(config_path, reference_dir)
  log(f"reference run: {steps} steps in {time.time() - started:.0f} s")
  problems, done = [], []
  for number, kill in enumerate(kills, start=1):
    resume_from = (complete_steps(soak_dir) or [0])[-1]
    if kill.after_step is not None:
      kill.after_step = min(resume_from + kill.after_step, steps - 1)
    kill = interrupt(config_path, soak_dir, kill)
    done.append(kill)
    problems += check_kill(kill, soak_dir)
    log(f"kill {number}/{len(kills)}: {kill.signal} "
        f"{'during start-up' if kill.after_step is None else f'after step {kill.after_step}'} "
        f"(+{kill.delay:.2f} s; last logged step {kill.logged_step}), exit code {kill.exit_code}"
        f"{f' after {kill.exit_sec:.1f} s' if kill.exit_sec is not None else ''}"
        f"{', interrupted a save' if kill.left_tmp_folder else ''}; checkpoints {complete_steps(soak_dir)}")
  run_to_end(config_path, soak_dir)
  reference, got = logged(reference_dir), logged(soak_dir)
  if sorted(got) != sorted(reference):
    problems.append(f"logged steps differ: {sorted(set(reference) ^ set(got))}")
  for step in sorted(reference):
    for key in COMPARED:
      if step in got and got[step].get(key) != reference[step].get(key):
        problems.append(f"step {step}: {key} {got[step].get(key)!r} != uninterrupted {reference[step].get(key)!r}")
  survived = [k for k in done if k.exit_sec is not None]
  summary = {
      "kills_survived": len(survived),
      "sigkill": sum(k.signal == "SIGKILL" for k in survived),
      "sigterm": sum(k.signal == "SIGTERM" for k in survived),
      "kills_during_save": sum(k.left_tmp_folder for k in survived),
      "max_sigterm_exit_sec": max((k.exit_sec for k in survived if k.signal == "SIGTERM"), default=None),
      "steps_compared": len(set(reference) & set(got)),
      "problems": problems,
      "wall_sec": round(time.time() - started, 1),
  }
  return summary


def main(argv: list[str]) -> int:
  import argparse  # noqa: PLC0415

  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--kills", type=int, default=12)
  parser.add_argument("--steps", type=int, default=0, help="training steps (0 = 3 per kill + 4, at least 20)")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--workdir", default="runs/soak")
  args = parser.parse_args(argv)
  steps = args.steps or max(20, 3 * args.kills + 4)
  summary = soak(args.workdir, random_kills(args.kills, steps, args.seed), steps, log=lambda m: print(m, flush=True))
  for problem in summary["problems"]:
    print(f"PROBLEM: {problem}")
  print(json.dumps({k: v for k, v in summary.items() if k != "problems"}))
  verdict = "all bit-identical" if not summary["problems"] else f"{len(summary['problems'])} problems"
  print(f"soak: {summary['kills_survived']} kills survived ({summary['sigkill']} SIGKILL, {summary['sigterm']} "
        f"SIGTERM, {summary['kills_during_save']} during a checkpoint save), {summary['steps_compared']} steps "
        f"compared, {verdict}")
  return 0 if not summary["problems"] else 1


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
