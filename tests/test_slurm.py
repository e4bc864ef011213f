"""launch/slurm.sbatch under a real single-host SLURM (Debian's slurm-wlm and munge; `.ci/run` installs them).

The module starts munged, slurmctld and slurmd itself, with every state, spool, socket and log file in a temporary
folder, and stops them (and cancels any job left) at the end. One job of 2 tasks x 2 CPU devices trains a tiny GPT;
`scancel --signal=TERM --full` (the signal a preemption sends to the batch shell and its children) reaches it mid-run:
both tasks must save a checkpoint and exit 0, the job requeue itself, and its second run resume and log the same
per-step losses as one uninterrupted process.
"""

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time

import numpy as np
import pytest
from conftest import demo_config, write_token_corpus, xla_flags_without_device_count

from jaxlm.recipes import pretraining

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SBIN_PATH = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "squeue", "sinfo")
CRED_EXPIRE_S = 5  # seconds a killed job's credential stays revoked (slurm.conf AuthInfo; the default is 120)
TIMEOUT_S = 300  # for any one wait below: generous, as a shared 2-core CI machine can be slow; a hang still ends

OVERRIDES = {
    "model.vocab_size": 320, "model.num_layers": 2, "model.d_model": 32, "model.num_heads": 2,
    "model.max_seq_len": 16, "data.seq_len": 16, "data.source": "files", "train.steps": 30, "train.batch_size": 8,
    "train.warmup_steps": 5, "train.eval_batches": 1, "train.eval_every_steps": 0, "checkpoint.every_steps": 1000,
    "log.every_steps": 1, "log.progress_bar": False, "log.sample_tokens": 0, "mesh.data": 2, "mesh.fsdp": 2,
}
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}
STEP_DELAY_S = 0.1  # per training step of the SLURM job, so that the signal lands before the last stop check

# experiments/train_lm.py with each step slowed down (the test's only change to it): a signal sent after step 1 has
# at least 1.8 s to reach the tasks before step 20, the last step at which the two can still agree to stop early.
SLOW_TRAIN_LM = f"""
import os, runpy, sys, time
from jaxlm.training import steps
to_global_batch = steps.to_global_batch
def slowed(*args, **kwargs):
  time.sleep({STEP_DELAY_S})
  return to_global_batch(*args, **kwargs)
steps.to_global_batch = slowed
script = os.path.join({ROOT!r}, "experiments", "train_lm.py")
sys.argv = [script, *sys.argv[1:]]
runpy.run_path(script, run_name="__main__")
"""


def _missing_programs() -> list[str]:
  return [p for p in PROGRAMS if shutil.which(p, path=SBIN_PATH) is None]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _wait_until(what: str, condition, timeout_s: float = TIMEOUT_S, every_s: float = 0.2):
  deadline = time.monotonic() + timeout_s
  while time.monotonic() < deadline:
    if result := condition():
      return result
    time.sleep(every_s)
  raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


SLURM_CONF = """\
ClusterName=jaxlmtest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={dir}/munge/socket,cred_expire={cred_expire_s}
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/log/slurmctld.log
SlurmdLogFile={dir}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
FirstJobId={first_job_id}
ReturnToService=2
KillWait=5
MinJobAge=600
InactiveLimit=0
NodeName=localhost NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


class Cluster:
  """munged + slurmctld + slurmd on this host, configured through `folder`/slurm.conf."""

  def __init__(self, folder: str):
    self.folder = folder
    self.env = dict(os.environ, SLURM_CONF=os.path.join(folder, "slurm.conf"), PATH=SBIN_PATH)
    self.daemons: list[subprocess.Popen] = []

  def start(self) -> None:
    for sub in ("munge", "state", "spool", "log"):
      os.makedirs(os.path.join(self.folder, sub), mode=0o755, exist_ok=True)
    key = os.path.join(self.folder, "munge", "munge.key")
    with open(os.open(key, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
      f.write(os.urandom(1024))
    munge = os.path.join(self.folder, "munge")
    self._daemon("munged", "--foreground", "--force", f"--socket={munge}/socket", f"--key-file={key}",
                 f"--pid-file={munge}/munged.pid", f"--log-file={munge}/munged.log", f"--seed-file={munge}/seed")
    _wait_until("munged's socket", lambda: os.path.exists(f"{munge}/socket"))
    # Job ids set the port of JAX's coordinator (jax.distributed's SLURM detection); a random first id keeps two
    # runs of this module on one machine apart.
    with open(self.env["SLURM_CONF"], "w") as f:
      f.write(SLURM_CONF.format(dir=self.folder, cred_expire_s=CRED_EXPIRE_S, ctld_port=_free_port(),
                                slurmd_port=_free_port(), cpus=os.cpu_count(),
                                first_job_id=random.randrange(1000, 60000)))
    self._daemon("slurmctld", "-D", "-f", self.env["SLURM_CONF"])
    self._daemon("slurmd", "-D", "-N", "localhost", "-f", self.env["SLURM_CONF"])
    _wait_until("the node to be idle", lambda: self.command("sinfo", "-h", "-o", "%t", check=False) == "idle")

  def _daemon(self, program: str, *args: str) -> None:
    log = open(os.path.join(self.folder, "log", f"{program}.out"), "w")
    # setpriv --pdeathsig: the daemon gets SIGTERM should pytest die without running the teardown.
    guard = ["setpriv", "--pdeathsig", "TERM", "--"] if shutil.which("setpriv") else []
    self.daemons.append(subprocess.Popen([*guard, shutil.which(program, path=SBIN_PATH), *args], env=self.env,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    log.close()
    time.sleep(0.2)
    if self.daemons[-1].poll() is not None:
      raise RuntimeError(f"{program} exited at start: {self.logs()}")

  def command(self, *args: str, check: bool = True) -> str:
    result = subprocess.run(args, env=self.env, capture_output=True, text=True, timeout=TIMEOUT_S)
    if check and result.returncode:
      raise RuntimeError(f"{' '.join(args)} failed: {result.stderr.strip()}")
    return result.stdout.strip()

  def job(self, job_id: str) -> dict[str, str]:
    """The controller's record of a job (`scontrol show job`), as key -> value."""
    return dict(re.findall(r"(\w+)=(\S*)", self.command("scontrol", "show", "job", "-o", job_id)))

  def logs(self) -> str:
    parts = []
    for name in ("log/slurmctld.log", "log/slurmd.log", "log/munged.out", "log/slurmctld.out", "log/slurmd.out"):
      path = os.path.join(self.folder, name)
      if os.path.exists(path):
        with open(path) as f:
          parts.append(f"--- {name}\n" + "".join(f.readlines()[-15:]))
    return "\n".join(parts)

  def stop(self) -> None:
    """Cancels every job, waits for the node to be empty, then stops the daemons (SIGTERM, SIGKILL after 10 s)."""
    try:
      if len(self.daemons) == 3 and all(d.poll() is None for d in self.daemons):
        if jobs := self.command("squeue", "-h", "-o", "%i", check=False).split():
          self.command("scancel", *jobs, check=False)
          _wait_until("cancelled jobs to end", lambda: not self.command("squeue", "-h", "-o", "%i", check=False),
                      timeout_s=30)
    except (TimeoutError, subprocess.TimeoutExpired):
      pass  # the daemons are stopped all the same
    for daemon in reversed(self.daemons):
      daemon.send_signal(signal.SIGTERM)
      try:
        daemon.wait(timeout=10)
      except subprocess.TimeoutExpired:
        daemon.kill()
        daemon.wait(timeout=10)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  if missing := _missing_programs():
    pytest.skip(f"SLURM is not installed ({', '.join(missing)} not found); "
                f"apt-get install slurm-wlm munge (as .ci/run does) to run these tests")
  if os.geteuid() != 0:
    pytest.skip("slurmd must run as root to start jobs; run these tests as root (CI does)")
  cluster = Cluster(str(tmp_path_factory.mktemp("slurm")))
  try:
    cluster.start()
    yield cluster
  finally:
    cluster.stop()


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {line["step"]: line["loss"] for line in map(json.loads, f)}


def test_sigterm_to_the_job_saves_exits_0_and_the_requeued_job_resumes_with_the_same_losses(cluster, tmp_path):
  corpus = tmp_path / "corpus.jsonl"
  write_token_corpus(corpus)
  overrides = dict(OVERRIDES, **{"data.train_files": str(corpus)})
  workdir = tmp_path / "run"
  (tmp_path / "slow_train_lm.py").write_text(SLOW_TRAIN_LM)
  output = tmp_path / "job.out"
  # The requeued run compiles nothing: it finds every program in the first run's compilation cache.
  env = dict(cluster.env, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "jax_cache"),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             XLA_FLAGS=f"{xla_flags_without_device_count()} --xla_force_host_platform_device_count=2".strip())
  for name in ("JAXLM_COORDINATOR_ADDRESS", "JAXLM_NUM_PROCESSES", "JAXLM_PROCESS_ID", "JAXLM_REQUEUE"):
    env.pop(name, None)
  # The file's own resources are a GPU cluster's; these command-line options take their place on this host.
  submit = subprocess.run(
      ["sbatch", "--parsable", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", "--overcommit",
       "--gpus-per-node=0", "--time=10", f"--output={output}", os.path.join(ROOT, "launch/slurm.sbatch"),
       str(tmp_path / "slow_train_lm.py"), f"--config={ROOT}/experiments/configs/demo.py", f"--workdir={workdir}",
       *[f"--config.{k}={v}" for k, v in overrides.items()]],
      env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT_S)
  assert submit.returncode == 0, submit.stderr
  job_id = submit.stdout.strip().split(";")[0]

  def text():
    return output.read_text() if output.exists() else ""

  def job_failed():
    return cluster.job(job_id)["JobState"] in ENDED - {"COMPLETED"}

  try:
    metrics = workdir / "metrics.jsonl"
    _wait_until("the first logged step", lambda: (metrics.exists() and metrics.stat().st_size) or job_failed())
    assert not job_failed(), text()
    cluster.command("scancel", "--signal=TERM", "--full", job_id)

    # The batch shell passes the signal on, both tasks save and exit 0, and the job requeues itself.
    def requeued_or_ended():
      record = cluster.job(job_id)
      return (record["Restarts"], record["JobState"]) == ("1", "PENDING") or record["JobState"] in ENDED
    _wait_until("the job to requeue itself", requeued_or_ended)
    log = text()
    stopped = re.findall(r"^([01]): stopped after step (\d+) \(checkpoint saved\)", log, re.MULTILINE)
    assert sorted(task for task, _ in stopped) == ["0", "1"], log
    stop_step = int(stopped[0][1])
    assert {step for _, step in stopped} == {str(stop_step)} and stop_step < OVERRIDES["train.steps"], log
    assert "the training step exited with status 0" in log and f"job {job_id} requeued" in log, log
    assert str(stop_step) in os.listdir(workdir / "checkpoints")

    # SLURM holds a requeued job back until its old credential expires (cred_expire, 120 s by default); started
    # sooner, slurmd refuses it ("Job credential revoked", exit 1). Past that, the test starts it instead of
    # waiting for the next scheduling pass. The reference run (one process, four devices, straight through) fills
    # the wait.
    revoked_until = time.monotonic() + CRED_EXPIRE_S + 1
    pretraining.train(demo_config(overrides), str(tmp_path / "one"))
    time.sleep(max(0.0, revoked_until - time.monotonic()))
    cluster.command("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    _wait_until("the requeued job to finish",
                lambda: text().count("the training step exited") == 2 and cluster.job(job_id)["JobState"] in ENDED,
                timeout_s=2 * TIMEOUT_S)
  except Exception:
    print(text(), cluster.logs(), sep="\n")
    raise
  record, log = cluster.job(job_id), text()
  assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("COMPLETED", "0:0", "1"), log
  assert len(re.findall(r"^[01]: done: loss", log, re.MULTILINE)) == 2, log
  report = (workdir / "report.md").read_text()
  assert re.search(rf"resumed_from_step\W+{stop_step}\b", report), report

  one, two = _losses(tmp_path / "one"), _losses(workdir)
  assert sorted(two) == sorted(one) == list(range(1, OVERRIDES["train.steps"] + 1))
  np.testing.assert_allclose([two[s] for s in sorted(two)], [one[s] for s in sorted(one)], rtol=1e-5)
