"""Benchmark shape for one GPU: GPT-2 small (124M), seq 1024, bf16, cuDNN attention.

Command:  python experiments/bench.py --config=experiments/configs/bench_gpu.py --workdir=runs/bench_gpu
          (experiments/bench_gpu.sh runs this and the ~1B Llama flavour in one script of under 8 minutes)
Runtime:  about 1.5 minutes on an H200, most of it compiling (jaxlm 10 s, torch.compile 34 s).
Expected: the goal is jaxlm_mfu >= 0.5 against the bf16 datasheet peak (llm.c reaches about 0.38 on H100s).
          Measured on an H200 (WORKSPACE.md): jaxlm 278k tokens/s, MFU 0.24; torch.compile 396k tokens/s, MFU 0.34;
          cudnn_vs_xla_max_abs_logit_diff 0.023 at a logit scale of 3.3.
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
  config.model.scan_layers = False  # a Python loop over the layers: 1.28x the scanned step on an H200 (GPT-2 B32)
  config.model.attention = "cudnn"
  config.data.seq_len = 1024
  config.train.batch_size = 16  # 32 left no room for torch beside JAX on one 141 GB H200
  return config
