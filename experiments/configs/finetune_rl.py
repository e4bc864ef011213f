"""Online RL (DAPO, TRL's default loss) with LoRA, offline: google/gemma-3-270m (from the PyPI GGUF packages) learns
to answer arithmetic word problems in the `#### <number>` format, rewarded by the exact answer and the format;
held-out problems are of a kind no training prompt has (experiments/rl_tasks.py).

Command:  python experiments/hf_from_gguf.py --out=runs/gemma3_270m       # the pretrained model (about 100 s)
          python experiments/rl_tasks.py --out=runs/rl_tasks
          python experiments/finetune.py --config=experiments/configs/finetune_rl.py --workdir=runs/rl
          (other losses: --config.rl.loss=grpo|dr_grpo|bnpo, GSPO: --config.rl.importance_sampling=sequence; a KL
           to the starting weights: --config.rl.beta=0.04; your own rewards: --config.rl.rewards=my_rewards.py:fn,
           signature f(prompts, completions, **columns) -> list[float | None] as TRL's; your own prompts:
           --config.data.train_files=prompts.jsonl with a `prompt` column, plain or conversational)
Runtime:  about 20 minutes on a 2-core CPU (steps of 35-90 s); minutes on a GPU.
Result:   held-out greedy accuracy (the right number on a final "#### <number>" line, then a stop) 5 of 64 -> 55 of
          64, measured with this file's settings on a 36-step schedule stopped after step 15 (docs/finetuning.md).
Output:   runs/rl/eval.json (eval_reward, eval_accuracy, eval_reward/<function>; start_* before tuning),
          metrics.jsonl (TRL's names: reward, reward_std, rewards/<function>/mean, frac_reward_zero_std,
          completions/mean_length, clip_ratio/*, kl, entropy, sampled_tokens_per_sec, sampling_share),
          rollouts.jsonl, answers.json and report.md (reward curve, held-out answers before and after), hf_model/
          (merged), adapter/ (a PEFT folder) and checkpoints/.
"""

from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.init_from = "runs/gemma3_270m"
  config.model.flavour = "llama"  # a decoder (the checkpoint decides the rest)
  config.model.compute_dtype = "float32"  # bf16 matmuls are slower than f32 on CPUs; use bfloat16 on accelerators
  config.rl.loss = "dapo"
  config.rl.num_generations = 8
  config.rl.max_completion_length = 32
  # A base model rarely ends a completion with <eos> (p ~ 0.02 after the answer line): a blank line ends it too
  config.rl.stop_tokens = ("\n\n", "\n\n\n", "\n\n\n\n")
  config.rl.rewards = ("jaxlm.recipes.rewards:exact_answer", "jaxlm.recipes.rewards:answer_format")
  config.rl.reward_weights = (1.0, 0.5)
  config.rl.eval_prompts = 64
  config.lora.rank = 16
  config.lora.alpha = 32.0
  config.data.source = "files"
  config.data.seq_len = 0  # rows are prompt + rl.max_completion_length slots
  config.data.train_files = ("runs/rl_tasks/train.jsonl",)
  config.data.eval_files = ("runs/rl_tasks/eval.jsonl",)
  config.train.steps = 15
  config.train.batch_size = 32  # completions: 4 prompts x 8 generations
  config.train.learning_rate = 1e-4
  config.train.warmup_steps = 3
  config.train.weight_decay = 0.0
  config.train.eval_every_steps = 5
  config.checkpoint.every_steps = 5
  config.checkpoint.keep = 1
  config.log.every_steps = 1
  return config
