"""Tests for jaxlm.training.telemetry and jaxlm.training.report: FLOP counts, metrics.jsonl, resume, report, peak,
throughput."""

import json
import math
import os

import jax
import numpy as np
import pytest

from jaxlm.config import ModelConfig
from jaxlm.training import report, telemetry


def _lines(workdir):
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_flops_per_token_matches_hand_count():
  model = ModelConfig(vocab_size=16, num_layers=2, d_model=8, num_heads=2)  # mlp_width = 32
  # per layer: qkv + out = 4 * 8 * 8 = 256, MLP = 2 * 8 * 32 = 512; 2 layers = 1536; LM head 16 * 8 = 128
  matmul_params = 1536 + 128
  attention = 12 * 2 * 8 * 4  # 12 * layers * d_model * seq_len
  assert telemetry.flops_per_token(model, seq_len=4) == 6 * matmul_params + attention == 10752
  wide = ModelConfig(vocab_size=16, num_layers=2, d_model=8, num_heads=2, d_ff=16)
  assert telemetry.flops_per_token(wide, seq_len=4) == 6 * (2 * (256 + 256) + 128) + attention


def test_peak_table_prefers_the_most_specific_kind():
  assert telemetry.lookup_peak_flops("NVIDIA H100 PCIe")[1] == 756e12
  assert telemetry.lookup_peak_flops("NVIDIA H100 80GB HBM3")[1] == 989e12
  assert telemetry.lookup_peak_flops("NVIDIA H200")[1] == 989e12
  assert telemetry.lookup_peak_flops("TPU v5 lite")[1] == 197e12
  assert telemetry.lookup_peak_flops("TPU v5")[1] == 459e12
  assert telemetry.lookup_peak_flops("NVIDIA L40S")[1] == 362e12
  assert telemetry.lookup_peak_flops("some new chip") is None


def test_measured_peak_on_cpu_is_positive_and_cached():
  flops, source = telemetry.peak_flops_per_device(dtype="float32")
  assert math.isfinite(flops) and flops > 0
  assert source.startswith("measured")
  assert telemetry.peak_flops_per_device(dtype="float32")[0] == flops  # one measurement per process


def test_a_peak_kept_in_the_cache_file_is_read_back_not_measured(tmp_path, monkeypatch):
  """JAXLM_PEAK_FLOPS_CACHE: a later process reads the peaks an earlier one measured and adds the ones it lacks."""
  path = tmp_path / "peaks.json"
  path.write_text(json.dumps({"cpu/float16/1024": 7e9, "cpu/float16/2048": 5e9}))
  monkeypatch.setenv(telemetry.PEAK_CACHE_ENV, str(path))
  telemetry._measured_peak.cache_clear()
  try:
    flops, _ = telemetry.peak_flops_per_device(dtype="float16")
    assert flops == 7e9 / len(jax.local_devices(backend="cpu"))  # the best size's, shared by the devices
    assert telemetry._measured_peak("cpu", "float32", 256) > 0  # not in the file: measured and added
    assert set(json.loads(path.read_text())) == {"cpu/float16/1024", "cpu/float16/2048", "cpu/float32/256"}
  finally:
    telemetry._measured_peak.cache_clear()


def test_metrics_writer_writes_json_lines_and_nan_as_null(tmp_path):
  workdir = str(tmp_path)
  with telemetry.MetricsWriter(workdir) as writer:
    writer.write(1, {"loss": 2.5, "mfu": np.float32(0.25), "tokens": np.int64(512), "phase": "train"})
    writer.write(2, {"loss": float("nan"), "grad_norm": float("inf")})
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    raw = f.read()
  assert "NaN" not in raw and "Infinity" not in raw
  records = _lines(workdir)
  assert records == [
      {"step": 1, "loss": 2.5, "mfu": 0.25, "tokens": 512, "phase": "train"},
      {"step": 2, "loss": None, "grad_norm": None},
  ]
  assert type(records[0]["tokens"]) is int
  assert os.listdir(os.path.join(workdir, "tensorboard"))  # an events file


def test_tensorboard_writer_does_not_import_torch(tmp_path):
  """tensorboardX would import torch (seconds) when the hf extra is installed; the writer keeps it out, and torch
  still imports afterwards."""
  import subprocess  # noqa: PLC0415
  import sys  # noqa: PLC0415
  code = ("import sys, importlib.util; from jaxlm.training import telemetry\n"
          f"with telemetry.MetricsWriter({str(tmp_path)!r}) as w: w.write(1, {{'loss': 1.0}})\n"
          "assert 'torch' not in sys.modules, 'torch imported'\n"
          "if importlib.util.find_spec('torch'): import torch; print('torch', torch.__version__)\n")
  result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  assert result.returncode == 0, result.stderr[-2000:]
  assert os.listdir(tmp_path / "tensorboard")


def test_resume_keeps_exactly_one_line_per_step(tmp_path):
  workdir = str(tmp_path)
  # First run logs steps 10..70 (checkpoint at 50), then is killed mid-write of step 80.
  with telemetry.MetricsWriter(workdir, enable_tensorboard=False) as writer:
    for step in range(10, 80, 10):
      writer.write(step, {"loss": 1.0 / step})
  with open(os.path.join(workdir, "metrics.jsonl"), "a") as f:
    f.write('{"step": 80, "lo')

  # Resume from checkpoint 50, telling the writer.
  with telemetry.MetricsWriter(workdir, enable_tensorboard=False, start_step=50) as writer:
    assert [r["step"] for r in _lines(workdir)] == [10, 20, 30, 40, 50]
    for step in range(60, 110, 10):
      writer.write(step, {"loss": 2.0 / step})
  steps = [r["step"] for r in _lines(workdir)]
  assert steps == list(range(10, 110, 10))

  # Resume again from 70 without start_step: the first write drops lines at and past it.
  with telemetry.MetricsWriter(workdir, enable_tensorboard=False) as writer:
    for step in range(70, 130, 10):
      writer.write(step, {"loss": 3.0 / step})
  records = _lines(workdir)
  assert [r["step"] for r in records] == list(range(10, 130, 10))
  assert records[-1]["loss"] == 3.0 / 120 and records[5]["loss"] == 2.0 / 60


def test_step_times_give_rates_and_mfu_of_the_timed_steps():
  times = telemetry.StepTimes()
  assert times.rates(peak_flops=1.0) == {}  # nothing timed yet (a run's first step holds the compile)
  times.add({"tokens": 1000, "flops": 6000.0}, seconds=1.0)
  times.add({"tokens": 2000, "flops": 12000.0}, seconds=1.0)
  rates = times.rates(peak_flops=2000.0)
  assert rates == {"tokens_per_sec": 1500.0, "mfu": pytest.approx(9000.0 / 2000.0), "step_time_sec": 1.0}
  times.clear()
  assert times.rates(peak_flops=2000.0) == {}


def test_report_has_plot_final_loss_and_sample(tmp_path):
  workdir = str(tmp_path)
  with telemetry.MetricsWriter(workdir, enable_tensorboard=False) as writer:
    for step in range(1, 21):
      metrics = {"loss": 5.0 - 0.1 * step, "tokens_per_sec": 1234.0, "mfu": 0.123}
      if step % 10 == 0:
        metrics["eval_loss"] = 4.9 - 0.1 * step
      writer.write(step, metrics)
  sample = 'def hello():\n    return "```"\n'
  path = report.write_report(
      workdir, "Demo run", {"steps": 20, "tokens": 20 * 1024, "mfu": 0.123, "devices": 1}, "model:\n  d_model: 8\n",
      sample, {"documents": 42, "train_tokens": 123456})
  assert path == os.path.join(workdir, "report.md")
  assert os.path.getsize(os.path.join(workdir, "loss.png")) > 1000
  with open(path) as f:
    text = f.read()
  assert text.startswith("# Demo run")
  assert "| final_loss | 3 |" in text and "| first_loss | 4.9 |" in text
  assert "| final_eval_loss | 2.9 |" in text and "| mfu | 12.3% |" in text
  assert "![loss](loss.png)" in text
  assert "````\ndef hello():" in text  # the fence outgrows the sample's own backticks
  assert "| train_tokens | 123,456 |" in text and "d_model: 8" in text


def test_device_memory_stats_is_a_flat_dict_of_ints():
  stats = telemetry.device_memory_stats()  # {} on the CPU, per-device bytes on GPUs and TPUs
  assert all(isinstance(value, int) for value in stats.values())


def test_progress_bar_accepts_absolute_steps(capsys):
  bar = telemetry.ProgressBar(total_steps=10, initial_step=2)
  bar.update(3, loss=2.345678, tokens_per_sec=12345.0, mfu=0.412)
  bar.update(10, loss=None)
  assert bar._bar.n == 10
  bar.close()
  assert telemetry._format_postfix({"loss": 2.345678, "tokens_per_sec": 12345.0, "mfu": 0.412}) == (
      "loss=2.3457, tok/s=12.3k, mfu=41.2%")

