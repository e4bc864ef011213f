"""Benchmark shape for one GPU: a ~1.1B Llama flavour (TinyLlama's shape), seq 2048, bf16, batch 8.

Command:  python benchmarks/bench.py --config=benchmarks/configs/bench_llama_1b.py --workdir=runs/bench_llama_1b \
            --frameworks=jaxlm --sections=peak,step,gpu
Runtime:  about a minute on an H100/H200, mostly compiling; far too slow for a CPU.
Expected: jaxlm_mfu above 0.5 of the bf16 datasheet peak on an H200 (the goal is 0.6; model FLOPs of
          jaxlm.training.telemetry.flops_per_token).

There is no torch reference for the Llama flavour; the kernels stay `auto`.
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
  config.model.document_mask = False  # the bench's rows are single documents: plain causal is the same function
  config.data.seq_len = 2048
  config.train.batch_size = 8
  return config
