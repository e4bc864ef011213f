"""GPT-2 small (124M parameters), sequence length 1024, bf16 compute, for GPUs.

Command:  python experiments/train_lm.py --config=experiments/configs/gpt2_small.py --workdir=runs/gpt2_small \
            --config.data.source=hf --config.data.hf_name=<dataset> --config.train.steps=2000
Runtime:  about 5 minutes for 2000 steps of 64 x 1024 tokens on one H200 (experiments/plan.py predicts the step).
Expected: on web text, loss below 4.5 after 2000 steps (131M tokens); the demo corpus (the default source) is far too
          small for this model and only serves to check throughput and MFU.

The kernels stay `auto`: on a GPU in bf16 that is cuDNN attention, a layer loop and the chunked cross-entropy.
"""

from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 50304  # GPT-2's 50257 padded to a multiple of 64 for faster matmuls
  config.model.num_layers = 12
  config.model.d_model = 768
  config.model.num_heads = 12
  config.model.max_seq_len = 1024
  config.model.compute_dtype = "bfloat16"
  config.data.seq_len = 1024
  config.data.max_bytes = 0
  config.train.steps = 2000
  config.train.batch_size = 64
  config.train.grad_accum = 1
  config.train.learning_rate = 6e-4
  config.train.warmup_steps = 200
  config.train.eval_every_steps = 500
  config.checkpoint.every_steps = 500
  config.log.every_steps = 10
  return config
