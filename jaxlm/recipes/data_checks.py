"""A run's data checked before its model: the scripts (experiments/finetune.py, experiments/train_lm.py) call the
check of their recipe before they look for the model, load it or need an extra (the `hf` extra's all-MiniLM-L6-v2),
so a bad file's one-line error is the first line a user sees, on a base install too.

  check_labelled(config)      classifier fine-tuning: the rows and labels (classification.read_labelled_rows) and
                              one global batch of them
  check_instructions(config)  prompt/response pairs or data.messages_column conversations
  check_preferences(config)   preference pairs (preference.loss)
  check_prompts(config)       RL prompts (rl.loss; prompts.read_prompt_splits) and one step of them
  check_corpus(config)        pretraining: data.train_files / data.eval_files by name, size, suffix and first text,
                              or the prepared folders' manifests; a corpus is never read whole twice

A fine-tuning set is read whole here with its recipe's own readers (it is held in memory anyway), so each raises the
error its recipe would: a missing or empty file, an unknown suffix, a missing column, a line that does not parse, bad
labels, no usable row, too few rows to hold out. What needs the model is left to the recipe: token lengths against
data.seq_len, the chat template. A check raises only what the recipe would raise too. An HF hub dataset is streamed
once, by the recipe; an HF dataset folder is checked like files.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from jaxlm.config import Config, DataConfig
from jaxlm.data import files
from jaxlm.data.corpora import datasets, shards
from jaxlm.data.tuning import classification as cls_data
from jaxlm.data.tuning import conversations
from jaxlm.data.tuning import instructions as instr_data
from jaxlm.data.tuning import preferences as pref_data
from jaxlm.data.tuning import prompts as prompt_data

# Rows of a corpus file read for its first text: past the reader's own limit for a column that no row has.
_CORPUS_HEAD_ROWS = 20_000


def check_labelled(config: Config) -> None:
  if _local(config.data):
    rows = cls_data.read_labelled_rows(config.data, config.train.seed)
    cls_data.check_batch_fits(len(rows.train), config.train.batch_size)


def check_instructions(config: Config) -> None:
  d = config.data
  if not _local(d):
    return
  read = conversations.read_conversations if d.messages_column else instr_data.read_pairs
  with instr_data.naming_the_setting():
    train, skipped = read(d, "train")
    eval_, eval_skipped = read(d, "eval")
  if not train:  # instructions.build_instruction_data's error
    columns = (repr(d.messages_column) + " with an assistant turn" if d.messages_column else
               f"{d.prompt_column!r} and {d.response_column!r}")
    raise ValueError(f"the training data holds no example with a non-empty {columns} ({skipped + eval_skipped} rows "
                     "skipped); check the files and data.*_column")
  if not eval_:
    instr_data.hold_out(train, d.eval_fraction, config.train.seed)


def check_preferences(config: Config) -> None:
  d = config.data
  if not _local(d):
    return
  usable, skipped = {}, 0
  for split in ("train", "eval"):
    with instr_data.naming_the_setting():
      records = pref_data.read_rows(d, split)
    usable[split] = [record for record in records if _may_hold_a_pair(record)]
    skipped += len(records) - len(usable[split])
  if not usable["train"]:  # preferences.build_preference_data's error
    raise ValueError(f"the training data holds no pair with a non-empty prompt, chosen and rejected response "
                     f"({skipped} rows skipped); check the files and data.prompt_column / chosen_column / "
                     "rejected_column")
  if not usable["eval"]:
    instr_data.hold_out(usable["train"], d.eval_fraction, config.train.seed)


def _may_hold_a_pair(record: tuple[str, int, Any, Any, Any]) -> bool:
  """False for a row that preferences.build_preference_data skips whatever the model (an empty part of a standard
  pair); raises its errors for cells that are neither text nor messages, or responses of two kinds. Conversations
  count as pairs: where their prompt ends is the chat template's business."""
  where, row, prompt, chosen, rejected = record
  chosen_messages = pref_data.as_messages(chosen, where, row, "the chosen column")
  rejected_messages = pref_data.as_messages(rejected, where, row, "the rejected column")
  if (chosen_messages is None) != (rejected_messages is None):
    raise ValueError(f"row {row} of {where!r}: chosen and rejected must both be strings or both be message lists")
  if chosen_messages is not None:
    if prompt is not None:
      pref_data.as_messages(prompt, where, row, "the prompt column")
    return True
  parts = (chosen, rejected) if prompt is None else (prompt, chosen, rejected)
  return all(isinstance(part, str) and part.strip() for part in parts)


def check_prompts(config: Config) -> None:
  if _local(config.data):
    train, _, _, _ = prompt_data.read_prompt_splits(config.data, config.train.seed)
    prompts_per_step(len(train), config)  # the recipe drops prompts too long for the model: never more of them


def prompts_per_step(prompts: int, config: Config) -> int:
  """The prompts of one RL step (train.batch_size / rl.num_generations), once `prompts` training prompts fill it."""
  per_step = config.train.batch_size // config.rl.num_generations
  if prompts < per_step:
    raise ValueError(f"{prompts} training prompts cannot fill a step of train.batch_size/rl.num_generations="
                     f"{per_step} prompts; add prompts or lower train.batch_size")
  return per_step


def check_corpus(config: Config) -> None:
  d = config.data
  if d.source == "files":
    for path in files.check_files([*d.train_files, *d.eval_files]):
      _check_first_text(path, d.text_column)
  elif d.source == "prepared":
    for folder in datasets.corpus_folders(d, config.model.vocab_size, None)[0]:
      shards.read_manifest(folder)


def _check_first_text(path: str, text_column: str) -> None:
  """Reads `path` as pretraining does up to its first text: a binary or non-UTF-8 start, a first line that does not
  parse, or a text column that no row has fails here."""
  with contextlib.closing(files.iter_files([path], text_column)) as texts:
    for number, text in enumerate(texts, start=1):
      if text is not None or number >= _CORPUS_HEAD_ROWS:
        return


def _local(d: DataConfig) -> bool:
  """Whether the rows are files or an HF dataset folder (a hub dataset is streamed once, by the recipe)."""
  return bool(d.train_files) or d.source != "hf" or os.path.isdir(d.hf_name)
