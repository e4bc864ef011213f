"""Command-line overrides of tuple keys as absl and ml_collections parse them: `--config.key=a,b` gives two values,
as the same text does for a key whose file default is a string."""

import sys

from absl import flags
from ml_collections import config_flags

from jaxlm import config as config_lib


def test_a_comma_separates_the_values_of_a_tuple_key(monkeypatch):
  argv = ["finetune.py", "--config=experiments/configs/finetune_bert.py", "--config.data.labels=negative,positive",
          "--config.data.train_files=a.csv,b.csv", "--config.data.eval_files="]
  monkeypatch.setattr(sys, "argv", argv)  # ml_collections reads the overrides from sys.argv
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values)
  values(argv)
  config = config_lib.from_config_dict(values.config)
  assert config.data.labels == ("negative", "positive")
  assert config.data.train_files == ("a.csv", "b.csv") and config.data.eval_files == ()


def test_a_comma_list_of_module_colon_function_names_reaches_the_config(monkeypatch):
  """`--config.rl.rewards=a.py:f,pkg.mod:g` as docs/finetuning.md writes it: ml_collections alone refuses it (':' is
  not a Python literal); cli.quote_comma_lists hands it over as one string, which the config splits at its commas."""
  from jaxlm import cli  # noqa: PLC0415

  argv = ["finetune.py", "--config=experiments/configs/finetune_rl.py",
          "--config.rl.rewards=my_rewards.py:short_and_correct,jaxlm.recipes.rewards:answer_format",
          "--config.rl.reward_weights=1.0,0.5", "--config.lora.targets=w_q,w_v"]
  monkeypatch.setattr(sys, "argv", argv)
  values = flags.FlagValues()
  config_flags.DEFINE_config_file("config", flag_values=values)
  values(cli.quote_comma_lists(argv, cli._config_file(argv)))
  config = config_lib.from_config_dict(values.config)
  assert config.rl.rewards == ("my_rewards.py:short_and_correct", "jaxlm.recipes.rewards:answer_format")
  assert config.rl.reward_weights == (1.0, 0.5) and config.lora.targets == "w_q,w_v"  # a string key stays as typed
