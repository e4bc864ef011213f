"""Benchmark shape for one GPU: GPT-2 small (124M), seq 1024, bf16, cuDNN attention.

Command:  python experiments/bench.py --config=experiments/configs/bench_gpu.py --workdir=runs/bench_gpu
          (experiments/bench_gpu.sh runs this and the ~1B Llama flavour in one script of under 8 minutes)
Runtime:  a few minutes on an H100/H200, most of it compiling (jaxlm, then torch.compile when torch has CUDA).
Expected: jaxlm_mfu >= 0.5 against the bf16 datasheet peak (llm.c reaches about 0.38 on H100s); the gpu section's
          cudnn_vs_xla_max_abs_logit_diff small against cudnn_vs_xla_logit_scale. Not yet measured: no GPU so far.
"""

from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 50304  # GPT-2's 50257 padded to a multiple of 64
  config.model.num_layers = 12
  config.model.d_model = 768
  config.model.num_heads = 12
  config.model.max_seq_len = 1024
  config.model.compute_dtype = "bfloat16"
  config.model.attention = "cudnn"
  config.data.seq_len = 1024
  config.train.batch_size = 32
  return config
