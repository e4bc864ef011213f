"""experiments/sweep.py: grid and random points, run names, commands, and the summary table sorted by a metric."""

import json
import os
import subprocess
import sys

import pytest
from conftest import load_script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sweep = load_script("experiments/sweep.py")


def test_grid_is_every_combination_and_random_draws_are_seeded():
  points = sweep.run_points(["train.learning_rate=1e-4,3e-4", "config.train.batch_size=16,32,64"], [], 0, 0)
  assert len(points) == 6 and points[0] == {"train.learning_rate": "1e-4", "train.batch_size": "16"}
  assert points[-1] == {"train.learning_rate": "3e-4", "train.batch_size": "64"}
  specs = ["train.learning_rate=loguniform:1e-5:1e-3", "train.warmup_steps=int:0:20", "data.batching=dynamic,bucket"]
  draws = sweep.run_points(["train.batch_size=16,32"], specs, 5, seed=3)
  assert len(draws) == 10 and draws == sweep.run_points(["train.batch_size=16,32"], specs, 5, seed=3)
  assert draws != sweep.run_points(["train.batch_size=16,32"], specs, 5, seed=4)
  for point in draws:
    assert 1e-5 <= float(point["train.learning_rate"]) <= 1e-3 and 0 <= int(point["train.warmup_steps"]) <= 20
    assert point["data.batching"] in ("dynamic", "bucket")


@pytest.mark.parametrize("grid,samples,count,message", [
    (["train.learning_rate"], [], 0, r"must look like section.key=values"),
    (["a.b=1", "a.b=2"], [], 0, r"a key appears twice"),
    ([], ["train.learning_rate=loguniform:0:1"], 2, r"loguniform bounds must be > 0"),
    ([], ["train.learning_rate=uniform:x:1"], 2, r"give uniform:low:high with two numbers"),
    ([], ["train.seed=int:0:9"], 0, r"--sample needs --random=N"),
    (["train.seed=1,2"], ["train.seed=int:0:9"], 2, r"train.seed is in both --grid and --sample"),
])
def test_bad_specs_are_one_line_errors(grid, samples, count, message):
  with pytest.raises(ValueError, match=message):
    sweep.run_points(grid, samples, count, 0)


def test_summary_is_sorted_by_the_metric_and_marks_failed_and_pending_runs(tmp_path):
  runs = []
  for i, (lr, f1) in enumerate([("1e-4", 0.8), ("3e-4", 0.95), ("1e-3", None), ("3e-3", 0.5)]):
    workdir = tmp_path / sweep.run_name({"train.learning_rate": lr}, i)
    workdir.mkdir()
    if f1 is not None:
      (workdir / "eval.json").write_text(json.dumps({"f1_macro": f1, "accuracy": f1, "eval_loss": 1 - f1,
                                                     "f1/pos": 0.1}))
    runs.append({"values": {"train.learning_rate": lr}, "workdir": str(workdir)})
  runs[3]["status"] = "failed"
  table = sweep.summarise(str(tmp_path), runs, "f1_macro").splitlines()
  assert "001_learning_rate=3e-4" in table[2] and "000_learning_rate=1e-4" in table[3]
  assert table[4].endswith("| failed |") and table[5].endswith("| pending |")
  saved = json.loads((tmp_path / "sweep.json").read_text())
  assert [r["values"]["train.learning_rate"] for r in saved["runs"]] == ["3e-4", "1e-4", "3e-3", "1e-3"]
  assert "f1/pos" not in saved["runs"][0]["eval"] and (tmp_path / "summary.md").exists()
  by_loss = sweep.summarise(str(tmp_path), runs, "eval_loss").splitlines()
  assert "001_learning_rate=3e-4" in by_loss[2]  # lowest loss first


def test_print_mode_gives_one_finetune_command_per_run(tmp_path):
  done = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "sweep.py"),
                         "--config=experiments/configs/finetune_bert.py", f"--workdir={tmp_path}",
                         "--grid=train.learning_rate=1e-4,2e-4", "--launch=print", "--", "--config.train.steps=5"],
                        cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert done.returncode == 0, done.stderr[-2000:]
  lines = done.stdout.strip().splitlines()
  assert len(lines) == 2 and all("experiments/finetune.py" in line for line in lines)
  assert f"--workdir={tmp_path}/001_learning_rate=2e-4" in lines[1] and lines[1].endswith(
      "--config.train.learning_rate=2e-4 --config.train.steps=5")


def test_a_key_the_config_does_not_have_stops_the_sweep_before_any_run(tmp_path):
  done = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "sweep.py"),
                         "--config=experiments/configs/finetune_bert.py", f"--workdir={tmp_path}",
                         "--grid=train.learning_rat=1e-4,2e-4"], cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert done.returncode != 0 and not os.listdir(tmp_path)
  assert 'train has no \'learning_rat\'; did you mean "learning_rate"?' in done.stderr
