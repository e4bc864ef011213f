"""A real multi-process job: launch/local.sh 2 2 (two processes, two CPU devices each, gloo collectives), stopped
after a collective checkpoint and resumed by a second launch, computes the same per-step losses as one process with
four devices running straight through."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import demo_config, write_token_corpus

from jaxlm.parallel import distributed
from jaxlm.recipes import pretraining
from jaxlm.training import telemetry

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

OVERRIDES = {
    "model.vocab_size": 320, "model.num_layers": 2, "model.d_model": 64, "model.max_seq_len": 32,
    "data.seq_len": 16, "data.source": "files", "train.steps": 4, "train.warmup_steps": 1, "train.batch_size": 8,
    "train.eval_batches": 1, "train.eval_every_steps": 0, "checkpoint.every_steps": 2, "log.every_steps": 1,
    "log.progress_bar": False, "log.sample_tokens": 4, "mesh.data": 2, "mesh.fsdp": 2,
}


def _losses(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line)["loss"] for line in f]


def test_two_processes_stopped_and_resumed_match_one_process(tmp_path):
  corpus = tmp_path / "corpus.jsonl"
  write_token_corpus(corpus)
  overrides = dict(OVERRIDES, **{"data.train_files": str(corpus)})
  flags = [f"--config.{k}={v}" for k, v in overrides.items()]
  # local.sh replaces the device count in XLA_FLAGS and keeps the suite's cheaper compile settings (conftest.py).
  env = {k: v for k, v in os.environ.items() if k != distributed.ENV_COORDINATOR}
  env["PYTHON"] = sys.executable
  env["JAX_COMPILATION_CACHE_DIR"] = str(tmp_path / "jax_cache")  # the second launch reuses the first's compiles
  env["JAXLM_NO_HUGE_PAGES"] = "1"  # the re-exec would import everything twice in each process
  # The CPU's matmul peak (MFU's denominator) measured here once, into the session's file that the processes read:
  # otherwise both measure it at once, on the same cores.
  telemetry.peak_flops_per_device(dtype=demo_config(overrides).model.compute_dtype)
  command = [os.path.join(ROOT, "launch/local.sh"), "2", "2", os.path.join(ROOT, "experiments/train_lm.py"),
             f"--config={os.path.join(ROOT, 'experiments/configs/demo.py')}", f"--workdir={tmp_path / 'two'}", *flags]
  # First launch: both processes save step 2 together and exit; the second launch restores it collectively.
  for extra in (["--stop_at_step=2"], []):
    result = subprocess.run(command + extra, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
  assert {"2", "4"} <= set(os.listdir(tmp_path / "two" / "checkpoints"))
  assert "## Sample" in (tmp_path / "two" / "report.md").read_text()  # both processes joined the sampler

  # The sample at the end (every process joins the sampler) is the two processes' part only: it follows the losses.
  pretraining.train(demo_config({**overrides, "log.sample_tokens": 0}), str(tmp_path / "one"))
  one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
  assert len(one) == len(two) == 4
  np.testing.assert_allclose(two, one, rtol=1e-5)


@pytest.fixture(scope="module")
def unreachable():
  """{case: (exit status, stderr)} of one process that is rank 1 of 2 and cannot reach its coordinator: started
  together, as each mostly waits (its import of jax, then the 1 s timeout)."""
  joining = dict(os.environ, JAXLM_COORDINATOR_ADDRESS="127.0.0.1:1", JAXLM_NUM_PROCESSES="2", JAXLM_PROCESS_ID="1",
                 JAX_PLATFORMS="cpu")
  # Under srun without JAXLM_COORDINATOR_ADDRESS: the address JAX's SLURM detection derives.
  slurm = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAXLM_"))}
  slurm.update(SLURM_JOB_ID="7", SLURM_STEP_NODELIST="127.0.0.1", SLURM_NTASKS="2", SLURM_PROCID="1",
               SLURM_LOCALID="1", JAX_PLATFORMS="cpu")
  code = "from jaxlm.parallel import distributed; distributed.initialize(timeout_s=1)"
  started = {case: subprocess.Popen([sys.executable, "-c", code], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for case, env in {"coordinator": joining, "slurm": slurm}.items()}
  stderr = {case: process.communicate(timeout=120)[1] for case, process in started.items()}
  return {case: (process.returncode, stderr[case]) for case, process in started.items()}


def test_unreachable_coordinator_fails_with_a_timeout_not_a_hang(unreachable):
  returncode, stderr = unreachable["coordinator"]
  assert returncode != 0
  assert "could not join the job through the coordinator at 127.0.0.1:1 within 1 s" in stderr


def test_slurm_task_with_unreachable_first_node_fails_with_a_timeout_not_a_hang(unreachable):
  """Under srun without JAXLM_COORDINATOR_ADDRESS: rank 1 probes the address JAX's SLURM detection derives (first
  node, port from the job id) and fails with the one-line error instead of JAX's process abort."""
  returncode, stderr = unreachable["slurm"]
  assert returncode != 0
  port = 7 % 2**12 + 65535 - 2**12 + 1
  assert f"could not join the job through the coordinator at 127.0.0.1:{port} within 1 s" in stderr
