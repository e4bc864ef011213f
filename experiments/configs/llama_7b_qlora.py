"""QLoRA fine-tuning of a 7B Llama (Llama 2 7B's shape): the base frozen in 4-bit NF4, rank-64 adapters on every
weight matmul, seq 2048, bf16 compute, each block recomputed in the backward pass. For planning on one GPU.

Command:  python experiments/plan.py --config=experiments/configs/llama_7b_qlora.py \
            --hardware=l4_24gb,a100_80gb --devices=1 --workdir=runs/plan_llama_7b_qlora
Runtime:  about a minute on a 2-core CPU (it traces shapes only, nothing is allocated).
Expected: the plan's per-device bytes of the frozen base, adapters, optimizer state and activations, whether one
          device fits and with which micro-batch (train.grad_accum; docs/planning.md has the answer).

To train it, add init_from=<an HF Llama checkpoint folder> and the data; `lora.base=int8` or `float` plans the
8-bit and plain LoRA variants.
"""

from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.model.flavour = "llama"
  config.model.vocab_size = 32000
  config.model.num_layers = 32
  config.model.d_model = 4096
  config.model.num_heads = 32
  config.model.num_kv_heads = 32
  config.model.d_ff = 11008
  config.model.tie_embeddings = False
  config.model.max_seq_len = 4096
  config.model.layer_norm_eps = 1e-5
  config.model.compute_dtype = "bfloat16"
  config.data.seq_len = 2048
  config.train.batch_size = 16
  config.train.steps = 1000
  config.train.learning_rate = 2e-4
  config.train.warmup_steps = 30
  config.train.weight_decay = 0.0
  config.kernels.remat = "full"  # gradient checkpointing, as QLoRA recipes run: activations of one block at a time
  config.lora.rank = 64
  config.lora.alpha = 16.0
  config.lora.targets = "all"
  config.lora.base = "nf4"
  config.checkpoint.every_steps = 200
  return config
