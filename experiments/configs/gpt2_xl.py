"""GPT-2 XL (1.56B parameters), sequence length 1024, bf16 compute: a model for planning on several GPUs.

Command:  python experiments/plan.py --config=experiments/configs/gpt2_xl.py --hardware=l4_24gb,a100_80gb \
            --workdir=runs/plan_gpt2_xl
Runtime:  a few minutes on a 2-core CPU: 3 compiles on simulated devices.
Expected: its f32 params and Adam moments (17.4 GiB) plus the optimizer phase's gradient-sized trees exceed one L4
          (20.2 GiB usable), so one L4 is planned as not fitting, with the mesh that does: 4 L4s as FSDP (1x4x1,
          10.2 GiB per device); one A100 80GB fits it without accumulation (40.6 GiB).
"""

from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 50304
  config.model.num_layers = 48
  config.model.d_model = 1600
  config.model.num_heads = 25
  config.model.max_seq_len = 1024
  config.model.compute_dtype = "bfloat16"
  config.kernels.remat = "full"  # recompute each block in the backward pass: activations are what would not fit
  config.data.seq_len = 1024
  config.data.max_bytes = 0
  config.train.steps = 10000
  config.train.batch_size = 32
  config.train.warmup_steps = 500
  config.checkpoint.every_steps = 500
  return config
