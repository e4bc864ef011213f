"""GPT-2 small (124M) on FineWeb-Edu's 10B-token sample: the GPT-2 reproduction of llm.c and build-nanogpt.

Command:  python experiments/prepare_data.py --hf_name=<folder of sample/10BT/*.parquet> --tokenizer=<gpt2 folder> \
            --out=corpora/fineweb_edu_10b --eval_fraction=0.001
          python experiments/train_lm.py --config=experiments/configs/gpt2_fineweb_edu.py \
            --config.data.prepared=corpora/fineweb_edu_10b --workdir=runs/gpt2_fineweb_edu
          (launch/local.sh, launch/slurm.sbatch or launch/skypilot.yaml for several GPUs; re-run to resume)
Runtime:  experiments/plan.py --config=experiments/configs/gpt2_fineweb_edu.py --hardware=h100_80gb,h200_141gb
          estimates the hours and dollars on 1-4 GPUs (docs/data.md has its table).
Expected: held-out loss near 3.3 after the 10B tokens (19,073 steps of 524,288 tokens), as llm.c reports for the same
          recipe.

The batch is GPT-2's half a million tokens: 512 sequences of 1024, accumulated over micro-batches of 64 per step.
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
  config.data.source = "prepared"
  config.data.prepared = "corpora/fineweb_edu_10b"
  config.data.seq_len = 1024
  config.train.steps = 19_073
  config.train.batch_size = 512
  config.train.grad_accum = 8
  config.train.learning_rate = 6e-4
  config.train.min_lr_ratio = 0.1
  config.train.warmup_steps = 715
  config.train.weight_decay = 0.1
  config.train.eval_every_steps = 250
  config.train.eval_batches = 20
  config.checkpoint.every_steps = 1000
  config.log.every_steps = 10
  config.log.sample_prompt = "The "
  return config
