"""Benchmark shape for a mixture-of-experts step on one GPU: a Llama flavour with 8 experts of 2816 (top-2) in each
of 8 layers, d_model 1024, seq 2048, bf16, batch 8 (about 0.6B parameters, 0.2B active).

Command:  python benchmarks/ab_step.py --config=benchmarks/configs/bench_moe_gpu.py --workdir=runs/ab_moe_gpu \
            --variants="ragged_dot:,tokamax:kernels.grouped_matmul=tokamax,dense_same_active:model.num_experts=0;model.d_ff=5632"
Runtime:  a minute or two on an H100/H200, mostly compiling; far too slow for a CPU.
Expected: tokens/s of the dropless step with XLA's ragged_dot and with tokamax's grouped matmul, beside a dense model
          of the same active parameters (benchmarks/gpu_checks.sh's ab_moe part runs it).
"""

from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.model.flavour = "llama"
  config.model.vocab_size = 32768
  config.model.num_layers = 8
  config.model.d_model = 1024
  config.model.num_heads = 16
  config.model.num_kv_heads = 4
  config.model.num_experts = 8
  config.model.experts_per_token = 2
  config.model.expert_d_ff = 2816
  config.model.tie_embeddings = False
  config.model.max_seq_len = 2048
  config.model.compute_dtype = "bfloat16"
  config.model.document_mask = False  # single-document rows: plain causal attention is the same function
  config.data.seq_len = 2048
  config.train.batch_size = 8
  return config
