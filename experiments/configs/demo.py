"""Demo: a small GPT trained on the Python standard library's own source code (no network needed).

Command:  make demo
          (= python experiments/train_lm.py --config=experiments/configs/demo.py --workdir=runs/demo, with 4
          simulated CPU devices, so the batch is split over a 4-way data-parallel mesh)
Runtime:  about a minute on a 2-core CPU machine (plus the install); seconds on a GPU.
Expected: the loss falls from ln(320) = 5.8 to about 2.7 in 1000 steps (the last logged loss is well under half the
          first); runs/demo/report.md shows the curve and a sample of Python-like text.

Why these sizes: a 4-layer, 128-wide model is small enough for a 2-core CPU; a small byte-level BPE vocabulary (320)
keeps the output layer cheap, and batches of 8 x 128 tokens give 1000 updates in about a minute.
"""

from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 320
  config.model.num_layers = 4
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.max_seq_len = 128
  config.model.compute_dtype = "float32"  # bf16 matmuls are slower than f32 on CPUs
  config.data.source = "demo"
  config.data.seq_len = 128
  config.data.max_bytes = 4_000_000
  config.train.steps = 1000
  config.train.batch_size = 8
  config.train.learning_rate = 3e-3
  config.train.warmup_steps = 50
  config.train.eval_every_steps = 250
  config.checkpoint.every_steps = 250
  config.log.every_steps = 10
  config.log.sample_prompt = "def "
  config.log.sample_tokens = 96
  return config
