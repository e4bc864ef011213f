"""benchmarks/configs/shakespeare_char.py (nanoGPT's small CPU recipe) trained with Muon instead of AdamW: Muon on
the blocks' weight matrices, AdamW on the embeddings, norms and biases (train.optimizer=muon,
jaxlm/training/muon.py), with Moonlight's consistent RMS scaling (train.muon_consistent_rms=0.2: updates of AdamW's
RMS) at the rate that measured best for Muon on this shape, 1e-2 (AdamW's best was 3e-3).

Command:  python experiments/train_lm.py --config=benchmarks/configs/shakespeare_char_muon.py --workdir=runs/char_muon \
            --config.data.source=files --config.data.train_files=input.txt --config.data.tokenizer=...
          (the data flags as shakespeare_char.py describes; the same command with shakespeare_char.py is the AdamW
          run to compare held-out losses with), and Newton-Schulz's step-time cost next to AdamW in one process:
          python benchmarks/ab_step.py --config=benchmarks/configs/shakespeare_char_muon.py \
            --variants="muon:,adamw:train.optimizer=adamw" --rounds=6 --steps_per_round=10
Result:   held-out loss 1.498 ± 0.015 against AdamW's 1.826 ± 0.006 after 1,000 steps, each at its best rate, 3 seeds
          (benchmarks/muon_vs_adamw.py, on the Python manual's topics: docs/configuration.md).
"""

import importlib.util
import os


def _adamw_recipe():
  # Loaded by path: config files are run as files (jaxlm.cli, ml_collections), not imported from a package.
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shakespeare_char.py")
  spec = importlib.util.spec_from_file_location("shakespeare_char", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def get_config():
  config = _adamw_recipe().get_config()
  config.train.optimizer = "muon"
  config.train.muon_consistent_rms = 0.2  # Moonlight's scaling: updates of AdamW's RMS
  config.train.learning_rate = 1e-2  # Muon's best in benchmarks/muon_vs_adamw.py's sweep, for both groups of leaves
  return config
