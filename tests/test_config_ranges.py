"""Every numeric key's range is declared beside it and checked with a one-line error naming the key; fine-tuning's
learning rate follows the method; a run with no step left says so."""

import dataclasses

import commands_in_one_process
import pytest
from conftest import load_script

from jaxlm.config import TrainConfig, default_config, from_config_dict
from jaxlm.recipes import data_defaults, pretraining


@pytest.mark.parametrize("key, value, message", [
    ("train.learning_rate", -1.0, r"^train.learning_rate=-1.0 must be >= 0; 0 = fine-tuning's rate"),
    ("train.weight_decay", -3.0, r"^train.weight_decay=-3.0 must be >= 0$"),
    ("train.batch_size", 0, r"^train.batch_size=0 must be >= 1$"),
    ("train.b2", 1.0, r"^train.b2=1.0 must be in \[0, 1\)$"),
    ("train.warmup_steps", 2000, r"^train.warmup_steps=2000 exceeds train.steps=1000"),
    ("model.num_layers", 0, r"^model.num_layers=0 must be >= 1$"),
    ("data.eval_fraction", 1.5, r"^data.eval_fraction=1.5 must be in \[0, 1\)$"),
    ("checkpoint.keep", 0, r"^checkpoint.keep=0 must be >= 1$"),
    ("kernels.scan_unroll", 0, r"^kernels.scan_unroll=0 must be >= 1$"),
    ("loss_scale.factor", 1.0, r"^loss_scale.factor=1.0 must be > 1; 2 is the usual choice$"),
    ("train.eps", float("nan"), r"^train.eps=nan must be > 0$"),
])
def test_out_of_range_values_name_their_key_in_one_line(key, value, message):
  config = default_config()
  section, name = key.split(".")
  setattr(config[section], name, value)
  with pytest.raises(ValueError, match=message):
    from_config_dict(config)


def test_fine_tuning_rate_follows_the_method_unless_set():
  assert data_defaults.resolve_learning_rate(TrainConfig(learning_rate=0.0), 0).learning_rate == 5e-5
  assert data_defaults.resolve_learning_rate(TrainConfig(learning_rate=0.0), 8).learning_rate == 1e-3
  assert data_defaults.resolve_learning_rate(TrainConfig(learning_rate=1e-3), 8).learning_rate == 1e-3
  config = dataclasses.replace(from_config_dict(default_config()), train=TrainConfig(learning_rate=0.0))
  with pytest.raises(ValueError, match=r"train.learning_rate=0 .* pretraining needs a rate > 0"):
    data_defaults.require_fixed(config, "pretraining")


# The demo config with a 1-layer, 32-wide model on 20 KB of its text: what these commands check is the script's
# exit and its lines, the same for any model size.
TINY_DEMO = {"model.num_layers": 1, "model.d_model": 32, "model.num_heads": 2, "model.max_seq_len": 32,
             "data.seq_len": 32, "data.max_bytes": 20000, "log.progress_bar": False, "log.sample_tokens": 0}
COMPLETED = {**TINY_DEMO, "train.steps": 3, "train.warmup_steps": 1, "train.eval_every_steps": 0,
             "checkpoint.every_steps": 0}
DIVERGING = {**TINY_DEMO, "train.steps": 6, "train.warmup_steps": 0, "train.learning_rate": 1e30,
             "train.max_consecutive_nonfinite": 2, "train.grad_clip": 0}


def _train_lm(workdir, flags):
  return ["experiments/train_lm.py", "--config=experiments/configs/demo.py", f"--workdir={workdir}",
          *(f"--config.{key}={value}" for key, value in flags.items())]


@pytest.fixture(scope="module")
def commands(tmp_path_factory):
  """{case: Finished} of the train_lm.py commands below, run as `python <script> <flags>` in one process in turn
  (tests/commands_in_one_process.py); "again" on a run trained to its end in this process first."""
  completed = tmp_path_factory.mktemp("completed")
  config = load_script("experiments/configs/demo.py").get_config()
  for key, value in COMPLETED.items():
    section, name = key.split(".")
    config[section][name] = value
  pretraining.train(from_config_dict(config), str(completed))  # in this process: the first run
  return commands_in_one_process.run_commands({
      "again": _train_lm(completed, COMPLETED), "diverging": _train_lm(tmp_path_factory.mktemp("diverging"), DIVERGING)})


def test_a_completed_run_run_again_says_it_is_complete(commands):
  """The demo trained to its 3 steps, then the script run on it again (a requeued job): no `loss nan`, the step
  and the last loss."""
  again = commands["again"]
  assert again.returncode == 0, again.stderr[-2000:]
  assert "already complete: step 3 of 3, last logged loss" in again.stdout and "nan" not in again.stdout


def test_a_diverging_run_ends_in_one_line_not_a_traceback(commands):
  result = commands["diverging"]
  assert result.returncode != 0
  assert "Traceback" not in result.stderr
  assert "error: 2 consecutive non-finite steps" in result.stderr
