"""Instruction-tune a decoder on prompt/response pairs, offline: `make demo`'s small GPT (trained on the Python
standard library's sources) learns to write a function's docstring line from its signature.

Command:  make demo                                               # the base model, runs/demo
          python experiments/docstring_pairs.py --out=runs/docstring_pairs
          python experiments/finetune.py --config=experiments/configs/finetune_instructions.py --workdir=runs/instruct
          (another model: --config.init_from=path/to/hf_gpt2_or_llama_folder (with its tokenizer.json) or a jaxlm
           run workdir; own data: --config.data.train_files=pairs.jsonl [--config.data.eval_files=held_out.jsonl]
           --config.data.prompt_column=instruction --config.data.response_column=output; .csv and .parquet work too)
Runtime:  a few minutes on a 2-core CPU; seconds on a GPU.
Output:   runs/instruct/eval.json (eval_loss on the held-out response tokens), report.md (greedy responses to
          held-out prompts next to the references), hf_model/ (an HF folder) and checkpoints/.

Defaults fit the data as for classification (jaxlm/recipes/data_defaults.py): train.epochs=2 passes over the packed rows
(train.steps=0), data.seq_len=0 (the 99th percentile of the pairs' token counts, at most the model's positions), warmup
10% of the steps. The loss is on the response tokens only; pairs are packed whole and never attend to each other. The
model's shape and tokenizer come from init_from; model.compute_dtype/param_dtype and kernels.* from here.
"""

from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.init_from = "runs/demo"
  config.model.flavour = "gpt2"  # a decoder: instruction tuning (gpt2 or llama; the checkpoint decides which)
  config.model.compute_dtype = "float32"  # bf16 matmuls are slower than f32 on CPUs; use bfloat16 on accelerators
  config.data.source = "files"
  config.data.train_files = ("runs/docstring_pairs/train.jsonl",)
  config.data.eval_files = ("runs/docstring_pairs/eval.jsonl",)
  config.data.prompt_column = "prompt"
  config.data.response_column = "response"
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
  config.log.sample_tokens = 48  # new tokens at most per held-out prompt in report.md
  return config
