"""experiments/optimize.py end to end on a tiny trained LM: the chosen variants are measured and written (optimize.json,
the report section, the chart), the int8 checkpoints are smaller, and quality stays finite and near the float
model for the int8 variants. A subprocess, as a user runs it."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from commands_in_one_process import run_commands
from conftest import xla_flags_without_device_count

from jaxlm import config as config_lib
from jaxlm.recipes import pretraining

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _trained_workdir(tmp_path):
  corpus = tmp_path / "corpus.jsonl"
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "return", "def", "(", ")", ":", "=", "1"]
  corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, size=rng.integers(5, 30)))}) + "\n"
                            for _ in range(300)))
  config = config_lib.default_config()
  for key, value in {"model.vocab_size": 320, "model.num_layers": 2, "model.d_model": 64, "model.num_heads": 4,
                     "model.max_seq_len": 32, "model.compute_dtype": "float32", "data.seq_len": 16,
                     "data.source": "files", "data.train_files": (str(corpus),), "train.steps": 15,
                     "train.warmup_steps": 3, "train.batch_size": 8, "train.eval_batches": 2,
                     "train.eval_every_steps": 0, "checkpoint.every_steps": 0, "log.every_steps": 10,
                     "log.progress_bar": False, "log.sample_tokens": 0}.items():
    section, name = key.split(".")
    setattr(config[section], name, value)
  workdir = str(tmp_path / "run")
  pretraining.train(config_lib.from_config_dict(config), workdir)
  return workdir


def test_optimize_measures_every_variant_of_a_trained_lm(tmp_path):
  workdir = _trained_workdir(tmp_path)
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  # One device (as a user's laptop); the suite's cheaper compile settings stay (conftest.py).
  env["XLA_FLAGS"] = xla_flags_without_device_count()
  result = subprocess.run([sys.executable, os.path.join(ROOT, "experiments/optimize.py"), f"--workdir={workdir}",
                           "--repeats=2", "--calibration_batches=2", "--max_eval_batches=2",
                           "--prune_finetune_steps=1", "--prune_finetune_soup=2",  # a soup of two masked fine-tunes
                           "--variants=int8_weight-only,int8_W8A8,int8_W8A8_smooth,2:4,2:4_wanda"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stderr[-3000:]
  flat = json.loads(open(os.path.join(workdir, "optimize.json")).read())
  variants = {key.split("/")[0] for key in flat}
  assert variants >= {"fp32", "int8_weight-only", "int8_W8A8", "2:4"}
  assert "bf16" not in variants  # not asked for
  fp32 = flat["fp32/perplexity"]
  assert np.isfinite(fp32) and fp32 < 320  # trained: better than uniform over the vocabulary
  for name in ("int8_weight-only", "int8_W8A8", "int8_W8A8_smooth"):
    assert flat[f"{name}/perplexity"] == pytest.approx(fp32, rel=0.02), name
    assert flat[f"{name}/checkpoint_ratio_vs_fp32"] > 2.5, name  # 4x for the matmul weights, less overall here
  for name in ("2:4", "2:4_wanda"):
    assert flat[f"{name}/sparsity"] == pytest.approx(0.5, abs=0.01), name
    assert flat[f"{name}/perplexity"] == pytest.approx(fp32, rel=0.10), name
    assert flat[f"{name}/perplexity"] != flat[f"{name}/perplexity_before_finetune"], name  # the soup moved it
  report = open(os.path.join(workdir, "report.md")).read()
  assert report.count("<!-- optimize:begin -->") == 1 and "optimize.png" in report
  assert os.path.exists(os.path.join(workdir, "optimize.png"))
  assert not os.path.exists(os.path.join(workdir, "optimize"))  # variant checkpoints removed unless kept

  # The refusals, each a one-line error before anything is measured: one interpreter runs them all.
  script = os.path.join(ROOT, "experiments/optimize.py")
  refusals = {"--variants=int4": "error: --variants: 'int4' is not a variant; known: fp32, bf16, int8_weight-only",
              "--smoothing=1.5": "--smoothing=1.5 is out of range: SmoothQuant's strength must be in",
              "--sparsity=1.0": "--sparsity=1.0 is out of range",
              "--calibration_batches=0": "--calibration_batches=0: W8A8 and Wanda need at least one",
              "--prune_finetune_soup=0": "--prune_finetune_soup=0: give the number of masked fine-tunes",
              "--prune_finetune_schedule=run": "--prune_finetune_schedule=run is the run's own schedule: it needs "
                                               "--prune_finetune_like_run",
              "--prune_distill_temperature=0": "--prune_distill_temperature=0.0 must be > 0",
              "--prune_distill_files=texts.csv": "--prune_distill_files feeds the masked fine-tune: give it "
                                                 "--prune_finetune_steps > 0 too",
              "--prune_distill_files=texts.csv --prune_finetune_steps=1": "--prune_distill_files: 'texts.csv' does "
                                                                          "not exist",
              f"--prune_distill_files={tmp_path / 'corpus.jsonl'} --prune_finetune_steps=1":
                  "--prune_distill_files is for classifier runs;"}
  finished = run_commands({flag: [script, f"--workdir={workdir}", *flag.split()] for flag in refusals}, env=env)
  for flag, message in refusals.items():
    assert finished[flag].returncode != 0 and message in finished[flag].stderr, (flag, finished[flag].stderr[-2000:])
  assert os.path.exists(os.path.join(workdir, "optimize.json"))  # a refused run deletes nothing

  # A run whose data.tokenizer is not the tokenizer.json it trained with: refused before any data is tokenized.
  from jaxlm.data.tokenizer import train_bpe  # noqa: PLC0415
  other = str(tmp_path / "other_tokenizer.json")
  train_bpe(["entirely different text for another vocabulary"] * 20, 300, other)
  config_path = os.path.join(workdir, "config.json")
  run_config = json.loads(open(config_path).read())
  run_config["data"]["tokenizer"] = other
  open(config_path, "w").write(json.dumps(run_config))
  mismatch = subprocess.run([sys.executable, os.path.join(ROOT, "experiments/optimize.py"), f"--workdir={workdir}"],
                            env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert mismatch.returncode != 0
  assert f"data.tokenizer='{other}' differs from {workdir}/tokenizer.json" in mismatch.stderr, mismatch.stderr[-2000:]
