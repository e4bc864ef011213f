"""Benchmark shape for one GPU: GPT-2 small (124M), seq 1024, bf16, batch 32.

Command:  python benchmarks/bench.py --config=benchmarks/configs/bench_gpu.py --workdir=runs/bench_gpu
          (benchmarks/bench_gpu.sh runs this and the ~1B Llama flavour in one script; benchmarks/gpu_checks.sh
          times options side by side)
Runtime:  a minute or two on an H100/H200, most of it compiling.
Expected: jaxlm ahead of torch.compile's HF GPT-2 of the same shape (`jaxlm_vs_torch_compile` > 1) and jaxlm_mfu
          about 0.4 of the bf16 datasheet peak on an H200 (the goal is 0.5).

The kernels stay `auto` (cuDNN attention, a layer loop and the chunked cross-entropy on a GPU in bf16).
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
  # The bench's rows are single random documents, so plain causal attention is the same function here, and it spares
  # cuDNN the bias tensor and its gradient. Training on packed documents keeps the default (True).
  config.model.document_mask = False
  config.data.seq_len = 1024
  config.train.batch_size = 32  # torch.compile fits beside JAX at 32 (bench.py does not preallocate JAX's memory)
  return config
