"""OLMoE-1B-7B's shape (16 layers, d_model 2048, 64 experts of 1024, top-8, query/key norms over all heads): a
mixture of experts to plan full fine-tuning for, here at 4096 tokens per sequence in bf16.

Command:  python -c "from jaxlm.planner import estimates_moe" ...  (see docs/parallelism.md#planning), or load the
          real weights with --config.init_from=<an OLMoE folder> in experiments/finetune.py
Runtime:  planning takes about a minute on a 2-core CPU (it traces the model; nothing is allocated)
Expected: on 4 x A100 80GB, data parallelism alone does not fit (every device holds all 6.9B parameters' f32 Adam
          state); the expert axis of 4 does (docs/parallelism.md)
"""

from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.model.flavour = "llama"
  config.model.vocab_size = 50304
  config.model.num_layers = 16
  config.model.d_model = 2048
  config.model.num_heads = 16
  config.model.d_ff = 1024
  config.model.num_experts = 64
  config.model.experts_per_token = 8
  config.model.qk_norm = "full"
  config.model.router_normalize_topk = False
  config.model.router_balance_weight = 0.01
  config.model.router_z_weight = 0.0
  config.model.tie_embeddings = False
  config.model.max_seq_len = 4096
  config.model.layer_norm_eps = 1e-5
  config.model.compute_dtype = "bfloat16"
  config.model.document_mask = False
  config.data.seq_len = 4096
  config.train.batch_size = 16
  config.kernels.remat = "full"
  return config
