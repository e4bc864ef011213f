"""Instruction-tune a decoder on conversations under its chat template, offline: a small random Qwen2-style model
with a ChatML template learns multi-turn word and number dialogues (experiments/conversations.py).

Command:  python experiments/conversations.py --out=runs/conversations --checkpoint=runs/tiny_qwen_chat
          python experiments/finetune.py --config=experiments/configs/finetune_conversations.py --workdir=runs/chat
          (LoRA: --config.lora.rank=8; another model: --config.init_from=path/to/hf_llama_or_qwen_folder with its
           tokenizer.json and a chat template (chat_template.jinja or tokenizer_config.json's chat_template); own
           data: --config.data.train_files=conversations.jsonl [--config.data.eval_files=held_out.jsonl]
           --config.data.messages_column=messages, each record a list of {role, content})
Runtime:  a few minutes on a 2-core CPU; seconds on a GPU.
Output:   runs/chat/eval.json (eval_loss: the mean over the held-out assistant tokens, start_eval_loss before
          tuning), report.md (greedy replies to the held-out conversations next to the references), hf_model/ (an HF
          folder with the template) and checkpoints/. `experiments/generate.py --workdir=runs/chat --chat` answers
          with the template; `experiments/lm_eval.py --workdir=runs/chat --apply_chat_template` evaluates with it.

Each conversation is written with the checkpoint's chat template and the loss falls on the assistant turns only
(their content and end-of-turn token); conversations are packed whole and never attend to each other. A
conversation longer than data.seq_len keeps its first data.seq_len + 1 tokens (counted and warned about, as for
pairs). The model's shape, tokenizer and template come from init_from.
"""

from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.init_from = "runs/tiny_qwen_chat"
  config.model.flavour = "llama"  # a decoder: instruction tuning (the checkpoint decides the rest)
  config.model.compute_dtype = "float32"  # bf16 matmuls are slower than f32 on CPUs; use bfloat16 on accelerators
  config.data.source = "files"
  config.data.train_files = ("runs/conversations/train.jsonl",)
  config.data.eval_files = ("runs/conversations/eval.jsonl",)
  config.data.messages_column = "messages"
  config.data.seq_len = 0  # chosen from the data
  config.train.steps = 0  # derived from train.epochs
  config.train.epochs = 2.0
  config.train.batch_size = 16
  config.train.learning_rate = 1e-3
  config.train.warmup_steps = -1  # train.warmup_fraction of the steps
  config.train.warmup_fraction = 0.1
  config.train.weight_decay = 0.01
  config.train.eval_every_steps = 0  # at the end
  config.checkpoint.every_steps = 100
  config.checkpoint.keep = 1
  config.log.every_steps = 10
  config.log.sample_tokens = 32  # new tokens at most per held-out conversation in report.md
  return config
