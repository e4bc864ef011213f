"""Distilling a classifier into its pruned copy on unlabelled text of the task's domain.

A pruned model fine-tuned on a small labelled set mostly relearns the training rows, which the dense model already
fits. Matching the dense model's output distribution on many more unlabelled texts passes on how it generalises
instead (task-specific distillation, as TinyBERT does with augmented data):

  examples = distill.read_texts(["unlabelled.csv"], data_config, tokenizer, seq_len)
  batches = distill.teacher_batches(dense_model, forward, examples, batch_size=16, seq_len=seq_len, batching="bucket")
  loss_fn = distill.make_distillation_loss_fn(graphdef, temperature=2.0)    # for prune.finetune(...)

The batches carry the dense model's logits (TEACHER_LOGITS), computed once; the loss needs no labels.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.data.files import MissingColumn
from jaxlm.data.tuning import classification as cls_data

TEACHER_LOGITS = "teacher_logits"


def read_texts(files: list[str] | tuple[str, ...], data_config: Any, tokenizer: Any, seq_len: int
               ) -> cls_data.Examples:
  """The texts (column data.text_column, and data.text_pair_column when the task has pairs) of CSV/TSV/JSONL/Parquet
  `files`, tokenized to `seq_len` as the task's rows are; a label column is neither needed nor read."""
  for path in files:
    if not os.path.isfile(path):
      raise FileNotFoundError(f"distillation file {path!r} does not exist; give files of unlabelled task text")
  config = dataclasses.replace(data_config, train_files=tuple(files))
  texts, pairs = [], []
  columns = {config.text_column: "data.text_column"}
  if config.text_pair_column:
    columns[config.text_pair_column] = "data.text_pair_column"
  try:
    for _, table, _ in cls_data.read_rows(config, "train", columns):
      for row in table:
        values = [row[c] for c in columns]
        if all(isinstance(v, str) and v.strip() for v in values):
          texts.append(values[0])
          pairs.append(values[1] if len(values) > 1 else None)
  except MissingColumn as e:  # the column is the task's: the files are what to change
    raise ValueError(f"column {e.column!r} not found in {e.where!r}; columns are {e.found}; the distillation files "
                     "need the task's text column(s) (data.text_column)") from None
  if not texts:
    raise ValueError(f"the distillation files {list(files)} hold no non-empty text in column {config.text_column!r}")
  examples, _ = cls_data.tokenize(tokenizer, texts, pairs if config.text_pair_column else None, seq_len)
  return examples


def teacher_batches(model: nnx.Module, forward: Callable[[nnx.Module, dict], jax.Array],
                    examples: cls_data.Examples, batch_size: int, seq_len: int, batching: str) -> list[dict]:
  """Every example once in batches of similar length (as evaluation batches them), each with the dense `model`'s
  float32 logits under TEACHER_LOGITS; filler rows of the last batch have weight 0."""
  graphdef, params = nnx.split(model)
  run = jax.jit(lambda p, b: forward(nnx.merge(graphdef, p), b))
  batches = cls_data.eval_batches(examples, batch_size, seq_len, batching)
  for batch in batches:
    batch[TEACHER_LOGITS] = np.asarray(run(params, batch), np.float32)
  return batches


def make_distillation_loss_fn(graphdef: nnx.GraphDef, temperature: float = 2.0) -> Callable:
  """Sum over examples of T^2 x the cross-entropy between the teacher's and the student's softmax at temperature T
  (Hinton et al., 2015: T^2 keeps the gradient's scale as T changes), the weight sum, and agreement with the
  teacher's top class. Its gradient is zero where the student equals the teacher."""
  if temperature <= 0:
    raise ValueError(f"distillation temperature {temperature} must be > 0 (1 matches the plain softmax; 2 is usual)")

  def loss_fn(params, batch):
    logits_BC = nnx.merge(graphdef, params).classify(batch)
    teacher_BC = batch[TEACHER_LOGITS]
    targets_BC = jax.nn.softmax(teacher_BC / temperature, axis=-1)
    losses_B = -(targets_BC * jax.nn.log_softmax(logits_BC.astype(jnp.float32) / temperature, axis=-1)).sum(-1)
    weights_B = batch["weights"]
    agree_B = (jnp.argmax(logits_BC, -1) == jnp.argmax(teacher_BC, -1)).astype(jnp.float32)
    return (losses_B * weights_B).sum() * temperature ** 2, (weights_B.sum(), {"agree": (agree_B * weights_B).sum()})

  return loss_fn
