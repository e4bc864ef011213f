"""OLMoE-1B-7B's shape (16 layers, d_model 2048, 64 experts of 1024, top-8, query/key norms over all heads): a
mixture of experts to plan full fine-tuning for, here at 4096 tokens per sequence in bf16.

Command:  python experiments/plan.py --config=experiments/configs/olmoe_1b_7b.py --hardware=a100_80gb,h100_80gb \
            --devices=4 --compile=none --workdir=runs/plan_olmoe
Runtime:  about 10 s on a 2-core CPU (the model is traced, nothing is allocated)
Expected: 6.92B parameters, 1.28B active; on 4 x A100 80GB data parallelism alone does not fit (every device holds
          all the f32 Adam state), FSDP does and is fastest, the expert axis of 4 fits too but sends about 100 GB
          per step in its all-to-alls (docs/parallelism.md#planning)
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
