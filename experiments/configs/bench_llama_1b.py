"""Benchmark shape for one GPU: a ~1.1B Llama flavour (TinyLlama's shape), seq 2048, bf16, cuDNN attention.

Command:  python experiments/bench.py --config=experiments/configs/bench_llama_1b.py --workdir=runs/bench_llama_1b \
            --frameworks=jaxlm --sections=peak,step,gpu
Runtime:  about 1 minute on an H200 (compile 9-20 s); far too slow for a CPU.
Expected: the goal is jaxlm_mfu >= 0.6 against the bf16 datasheet peak. Measured on an H200, 2026-11-30
          (WORKSPACE.md, experiments/ab_step.py): 232 ms/step, 70.5k tokens/s, MFU 0.522 (0.528 with fuse_qkv;
          FLOPs from jaxlm.telemetry.flops_per_token); the scanned step of the same options 0.452, the first
          measurement (scanned, [B, T, V] logits, document mask) 0.37. The matmuls run at about 715 TFLOP/s (61% of
          the step), cuDNN attention 16%, XLA's RoPE / SwiGLU / norm fusions 22%.
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
  config.model.scan_layers = False  # a Python loop over the layers: 1.16x the scanned step on an H200
  config.model.attention = "cudnn"
  config.model.cross_entropy_chunk = 4096  # fused loss over 4096-token chunks: no f32 [B, T, V] logits
  config.model.document_mask = False  # the bench's rows are single documents: plain causal is the same function
  config.data.seq_len = 2048
  config.train.batch_size = 8
  return config
