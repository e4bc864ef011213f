"""Fine-tune a pretrained model and evaluate it: a BERT encoder as a classifier (model.flavour=bert), a GPT-2 /
Llama decoder on prompt/response pairs or conversations (model.flavour=gpt2 or llama: instruction tuning), a
decoder on preference pairs (preference.loss=dpo, ipo or simpo: preference tuning), or a decoder on its own sampled
completions scored by reward functions (rl.loss=dapo, grpo, dr_grpo or bnpo: online RL).

  python experiments/finetune.py --config=experiments/configs/finetune_bert.py --workdir=runs/ft \
      --config.data.train_files=train.csv --config.data.eval_files=test.csv --config.data.label_column=label
  python experiments/finetune.py --config=experiments/configs/finetune_instructions.py --workdir=runs/instruct \
      --config.init_from=path/to/hf_gpt2_folder --config.data.train_files=pairs.jsonl
  python experiments/finetune.py --config=experiments/configs/finetune_preferences.py --workdir=runs/dpo \
      --config.init_from=path/to/hf_decoder_folder --config.data.train_files=preferences.jsonl
  python experiments/finetune.py --config=experiments/configs/finetune_rl.py --workdir=runs/rl \
      --config.init_from=path/to/hf_decoder_folder --config.data.train_files=prompts.jsonl \
      --config.rl.rewards=jaxlm.recipes.rewards:exact_answer

Writes metrics.jsonl, TensorBoard events, checkpoints/, eval.json and report.md into --workdir (a classifier also
best_model/, a decoder hf_model/, both HF folders); re-running with the same --workdir resumes. See
jaxlm/recipes/classifier_finetuning.py and jaxlm/recipes/instruction_tuning.py for what each file holds.
"""

import os

from absl import flags, logging
from ml_collections import config_flags

from jaxlm import cli
from jaxlm import config as config_lib
from jaxlm.parallel import distributed
from jaxlm.recipes import (classifier_finetuning, data_checks, instruction_tuning, policy_optimization,
                           preference_tuning)

_CONFIG = config_flags.DEFINE_config_file("config", None, "experiment config file (experiments/configs/*.py)",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "run folder: checkpoints, metrics.jsonl, eval.json, report.md")
_STOP_AT_STEP = flags.DEFINE_integer("stop_at_step", None, "checkpoint after this step and exit, as a preemption "
                                     "would (re-running the same command resumes)")
flags.mark_flags_as_required(["config", "workdir"])


def main(argv):
  del argv  # flags only: cli.run refuses positional arguments
  logging.set_verbosity(logging.WARNING)  # orbax logs every checkpoint step at INFO
  config = config_lib.from_config_dict(_CONFIG.value)
  if config.rl.loss:
    tune, check_data = policy_optimization.policy_optimize, data_checks.check_prompts
  elif config.preference.loss:
    tune, check_data = preference_tuning.preference_tune, data_checks.check_preferences
  elif config.model.flavour == "bert":
    tune, check_data = classifier_finetuning.finetune, data_checks.check_labelled
  else:
    tune, check_data = instruction_tuning.instruction_tune, data_checks.check_instructions
  # Before any output, the data's own errors first, then the model's: a bad file is the news even where the model
  # (or the extra that carries it) is missing.
  check_data(config)
  if config.init_from and not os.path.isdir(config.init_from):
    raise ValueError(f"init_from={config.init_from!r} is not a folder; give an HF checkpoint folder or a jaxlm run "
                     "workdir")
  distributed.initialize()
  result = tune(config, _WORKDIR.value, stop_at_step=_STOP_AT_STEP.value)
  if "preempted_at_step" in result:
    print(f"stopped after step {result['preempted_at_step']} (checkpoint saved); "
          f"re-run the same command to resume")
    return
  if config.rl.loss:
    print(f"done: {config.rl.loss} eval_reward {result['eval_reward']:.4f}, eval_accuracy {result['eval_accuracy']:.3f} "
          f"(before tuning {result.get('start_eval_accuracy', float('nan')):.3f}) on {result['eval_prompts']} held-out "
          f"prompts; eval.json, report.md, rollouts.jsonl and hf_model/ in {_WORKDIR.value}")
    return
  if config.preference.loss:
    print(f"done: {config.preference.loss} eval_preference_loss {result['eval_preference_loss']:.4f}, "
          f"eval_reward_accuracy {result['eval_reward_accuracy']:.3f} (before tuning "
          f"{result.get('start_eval_reward_accuracy', float('nan')):.3f}) on {result['eval_pairs']} held-out pairs; "
          f"eval.json, report.md and hf_model/ in {_WORKDIR.value}")
    return
  if config.model.flavour != "bert":
    examples = "conversations" if config.data.messages_column else "pairs"
    print(f"done: eval_loss {result['eval_loss']:.4f} (perplexity {result['eval_perplexity']:.2f}) on the response "
          f"tokens of {result['eval_pairs']} held-out {examples}; eval.json, report.md and hf_model/ in "
          f"{_WORKDIR.value}")
    return
  print(f"done: accuracy {result['accuracy']:.4f}, f1_macro {result['f1_macro']:.4f} on {result['eval_examples']} "
        f"held-out examples; eval.json and report.md in {_WORKDIR.value}")


if __name__ == "__main__":
  cli.run(main)  # checks every --config.* override against the config file first
