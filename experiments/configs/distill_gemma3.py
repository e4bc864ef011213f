"""Distillation in pretraining: a 4-layer student with Gemma 3's tokenizer and block design learns google/gemma-3-270m's
next-token distribution on the Python standard library (the demo corpus, prepared with Gemma's tokenizer), offline.

Command:  python experiments/hf_from_gguf.py --out=runs/gemma3_270m       # the teacher (about 100 s)
          python experiments/train_lm.py --config=experiments/configs/distill_gemma3.py --workdir=runs/distill_gemma3
          (the same student on cross-entropy alone: --config.distill.teacher= ; reverse KL or the JSD:
           --config.distill.loss=reverse_kl | jsd --config.distill.beta=0.5; the teacher in int8:
           --config.distill.teacher_dtype=int8; your own corpus: --config.data.source=prepared
           --config.data.prepared=<folder prepared with --tokenizer=runs/gemma3_270m>)
Runtime:  about 30 s a step on a shared 2-core CPU (the teacher's forward pass and both models' 262,144-row output
          projections); 200 steps, under two hours.
Result:   after 40 steps, held-out cross-entropy 6.38 and KL to the teacher 4.37, against 6.69 and 5.03 for the same
          student on the same tokens with cross-entropy alone (docs/distillation.md).
Output:   runs/distill_gemma3/metrics.jsonl (loss = the distillation objective, distill_divergence, cross_entropy),
          eval.json-style entries eval_loss (the student's cross-entropy) and eval_distill_divergence, report.md.
"""

from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.distill.teacher = "runs/gemma3_270m"
  config.distill.loss = "forward_kl"
  config.distill.teacher_dtype = "float32"  # bf16 matmuls are slower than f32 on CPUs; bfloat16 or int8 on GPUs
  m = config.model  # Gemma 3's design (its vocabulary, tied embeddings, block layout), 4 narrower layers
  m.flavour = "llama"
  m.vocab_size = 262144
  m.num_layers = 4
  m.d_model = 256
  m.num_heads = 4
  m.num_kv_heads = 1
  m.attention_head_dim = 64
  m.d_ff = 1024
  m.max_seq_len = 512
  m.qk_norm = "head"
  m.rope_theta = 1_000_000.0
  m.rope_local_theta = 10_000.0
  m.sliding_window = 512
  m.global_attention_every = 6
  m.block_norms = "sandwich"
  m.glu_activation = "gelu_tanh"
  m.norm_plus_one = True
  m.scale_embeddings = True
  m.layer_norm_eps = 1e-6
  m.compute_dtype = "float32"  # bf16 matmuls are slower than f32 on CPUs; use bfloat16 on accelerators
  config.data.source = "demo"
  config.data.tokenizer = "runs/gemma3_270m/tokenizer.json"
  config.data.max_bytes = 4_000_000
  config.data.seq_len = 128
  config.train.steps = 200
  config.train.batch_size = 8
  config.train.learning_rate = 3e-3
  config.train.warmup_steps = 20
  config.train.eval_every_steps = 50
  config.train.eval_batches = 4
  config.checkpoint.every_steps = 50
  config.log.every_steps = 5
  config.log.sample_tokens = 32
  return config
