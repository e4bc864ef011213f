"""Benchmark shape for one GPU: a ~1.1B Llama flavour (TinyLlama's shape), seq 2048, bf16, cuDNN attention.

Command:  python experiments/bench.py --config=experiments/configs/bench_llama_1b.py --workdir=runs/bench_llama_1b \
            --frameworks=jaxlm --sections=peak,step,gpu
Runtime:  about 1 minute on an H200 (compile 9 s); far too slow for a CPU.
Expected: the goal is jaxlm_mfu >= 0.6 against the bf16 datasheet peak. Measured on an H200 (WORKSPACE.md):
          49.6k tokens/s, MFU 0.37 (FLOPs from jaxlm.telemetry.flops_per_token), 71 GB per device.
"""

from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.model.flavour = "llama"
  config.model.vocab_size = 32768  # Llama's 32000 padded to a multiple of 1024
  config.model.num_layers = 22
  config.model.d_model = 2048
  config.model.num_heads = 32
  config.model.num_kv_heads = 4
  config.model.d_ff = 5632
  config.model.tie_embeddings = False
  config.model.max_seq_len = 2048
  config.model.compute_dtype = "bfloat16"
  config.model.scan_layers = False  # a Python loop over the layers: 1.28x the scanned step on an H200 (GPT-2 B32)
  config.model.attention = "cudnn"
  config.data.seq_len = 2048
  config.train.batch_size = 8
  return config
