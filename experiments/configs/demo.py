"""Demo: a small GPT trained on the Python standard library's own source code (no network needed).

Command:  python experiments/train_lm.py --config=experiments/configs/demo.py --workdir=runs/demo
          (or `make demo`)
Runtime:  about 3 minutes on a 2-core CPU machine, mostly training; seconds on a GPU.
Expected: loss falls from ~8.3 (ln 4096) to below 3 in 300 steps; runs/demo/report.md shows the curve and a
          sample of generated Python-like text.
"""

from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 4096
  config.model.num_layers = 4
  config.model.d_model = 256
  config.model.num_heads = 4
  config.model.max_seq_len = 128
  config.model.compute_dtype = "float32"  # bf16 matmuls are slower than f32 on CPUs
  config.data.source = "demo"
  config.data.seq_len = 128
  config.data.max_bytes = 4_000_000
  config.train.steps = 300
  config.train.batch_size = 16
  config.train.learning_rate = 2e-3
  config.train.warmup_steps = 30
  config.train.eval_every_steps = 100
  config.checkpoint.every_steps = 100
  config.log.every_steps = 10
  config.log.sample_prompt = "def "
  config.log.sample_tokens = 64
  return config
