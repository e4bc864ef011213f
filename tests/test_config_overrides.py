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
