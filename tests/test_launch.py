"""The cluster launch files: SLURM runs for real under a stand-in `srun`; the SkyPilot and Kubernetes files are
checked against what jaxlm.parallel.distributed reads and against the repository's scripts and configs."""

import json
import os
import random
import shlex
import subprocess
import sys

import yaml

from jaxlm.parallel import distributed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JAXLM_ENV = {distributed.ENV_COORDINATOR, distributed.ENV_NUM_PROCESSES, distributed.ENV_PROCESS_ID}

# Joins the job the way experiments/train_lm.py does, then all-gathers every process's index across processes.
PROBE = """
import json, os, sys
import numpy as np
from jaxlm.parallel import distributed
joined = distributed.initialize(timeout_s=60)
import jax
from jax.experimental import multihost_utils
indices = multihost_utils.process_allgather(np.array([jax.process_index()]))
report = {"joined": joined, "index": jax.process_index(), "count": jax.process_count(),
          "devices": jax.device_count(), "gathered": np.asarray(indices).ravel().tolist()}
# One file per task: two tasks printing to one pipe can interleave their lines.
with open(os.path.join(os.environ["PROBE_DIR"], f"{jax.process_index()}.json"), "w") as f:
  json.dump(report, f)
"""

# Stands in for `srun`: starts SLURM_NTASKS copies of the command with the variables a real srun sets per task.
FAKE_SRUN = """#!/usr/bin/env bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((i = 0; i < SLURM_NTASKS; i++)); do
  SLURM_PROCID=$i SLURM_LOCALID=$i SLURM_STEP_NODELIST=localhost SLURM_STEP_NUM_NODES=1 "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def test_slurm_sbatch_joins_two_tasks_through_jax_slurm_detection(tmp_path):
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  (bin_dir / "srun").write_text(FAKE_SRUN)
  (bin_dir / "srun").chmod(0o755)
  (tmp_path / "probe.py").write_text(PROBE)
  env = {k: v for k, v in os.environ.items() if k not in JAXLM_ENV | {"XLA_FLAGS"}}
  env.update(PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:{env['PATH']}", SLURM_SUBMIT_DIR=ROOT,
             SLURM_JOB_ID=str(random.randrange(10_000, 90_000)), SLURM_NTASKS="2", JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONPATH=ROOT,
             PROBE_DIR=str(tmp_path))
  result = subprocess.run(["bash", os.path.join(ROOT, "launch/slurm.sbatch"), str(tmp_path / "probe.py")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  reports = [json.loads(p.read_text()) for p in sorted(tmp_path.glob("*.json"))]
  assert [r["index"] for r in reports] == [0, 1], result.stdout
  for report in reports:
    assert report["joined"] and report["count"] == 2 and report["devices"] == 4 and report["gathered"] == [0, 1]


def _env_names(entries):
  return {e["name"] for e in entries}


def test_kubernetes_jobset_sets_what_jaxlm_reads_and_runs_a_real_script():
  with open(os.path.join(ROOT, "launch/k8s/jobset.yaml")) as f:
    jobset = yaml.safe_load(f)
  job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
  container = job["template"]["spec"]["containers"][0]
  assert JAXLM_ENV <= _env_names(container["env"])
  processes = next(e["value"] for e in container["env"] if e["name"] == distributed.ENV_NUM_PROCESSES)
  assert int(processes) == job["parallelism"] == job["completions"]
  assert job["completionMode"] == "Indexed"  # the completion index is the process id
  port = next(e["value"] for e in container["env"] if e["name"] == distributed.ENV_COORDINATOR).rsplit(":", 1)[1]
  assert int(port) in [p["containerPort"] for p in container["ports"]]
  script, *flags = container["command"][1:]
  assert os.path.isfile(os.path.join(ROOT, script))
  config = next(f.split("=", 1)[1] for f in flags if f.startswith("--config="))
  assert os.path.isfile(os.path.join(ROOT, config))
  # A pod that saved after SIGTERM exits with the code the Job replaces it for, not 0 (which would count as done).
  stopped = next(f.split("=", 1)[1] for f in flags if f.startswith("--exit_code_when_stopped="))
  ignored = [code for rule in job["podFailurePolicy"]["rules"] if rule["action"] == "Ignore"
             for code in rule["onExitCodes"]["values"]]
  assert int(stopped) in ignored and int(stopped) != 0
  with open(os.path.join(ROOT, script)) as f:
    assert '"exit_code_when_stopped"' in f.read()


def test_skypilot_recipe_resumes_from_the_bucket_and_sets_what_jaxlm_reads():
  with open(os.path.join(ROOT, "launch/skypilot.yaml")) as f:
    recipe = yaml.safe_load(f)
  assert recipe["resources"]["use_spot"] and recipe["resources"]["job_recovery"]
  mount = next(iter(recipe["file_mounts"]))
  run = recipe["run"]
  assert f'--workdir="{mount}/$RUN"' in run  # the same workdir after a preemption = resume
  exported = {line.split()[1].split("=")[0] for line in run.splitlines() if line.strip().startswith("export ")}
  assert JAXLM_ENV <= exported
  command = next(line for line in run.splitlines() if "experiments/" in line and "python" in line)
  script = next(word for word in shlex.split(command, posix=False) if word.startswith("experiments/"))
  assert os.path.isfile(os.path.join(ROOT, script))
  assert os.path.isfile(os.path.join(ROOT, recipe["envs"]["CONFIG"]))


def test_local_launcher_sets_the_device_count_and_keeps_other_xla_flags(tmp_path):
  """launch/local.sh gives each process its own simulated device count and passes the caller's other XLA flags
  through (it used to replace XLA_FLAGS whole)."""
  script = tmp_path / "env_probe.py"
  script.write_text("import os, sys\n"
                    "with open(os.path.join(sys.argv[1], os.environ['JAXLM_PROCESS_ID']), 'w') as f:\n"
                    "  f.write(os.environ['XLA_FLAGS'])\n")
  env = dict(os.environ, PYTHON=sys.executable,
             XLA_FLAGS="--xla_force_host_platform_device_count=4 --xla_backend_optimization_level=0")
  result = subprocess.run([os.path.join(ROOT, "launch/local.sh"), "2", "3", str(script), str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=60)
  assert result.returncode == 0, result.stderr
  for process in ("0", "1"):
    assert (tmp_path / process).read_text() == ("--xla_backend_optimization_level=0 "
                                                 "--xla_force_host_platform_device_count=3")
