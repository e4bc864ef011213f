"""Prompts for online RL (GRPO, jaxlm/recipes/policy_optimization.py): rows of TRL's prompt-only datasets -> each
prompt's token ids, the prompt as the reward functions receive it, and the rows' other columns.

  data = build_prompt_data(config.data, tokenizer, seed, max_prompt_len, chat_folder)
  data.train.ids[i]       # the prompt's token ids, what the policy continues
  data.train.prompts[i]   # `prompts` for the rewards: the string, or the list of {role, content} messages
  data.train.columns      # {"answer": [...], ...}: every other column, one value per prompt (None where a row has none)

Formats (TRL's prompt-only datasets), the column data.prompt_column (`prompt`):
  * standard: a string, tokenized as it is (no chat template, as TRL);
  * conversational: a list of {role, content} messages, rendered with the checkpoint's chat template and its
    generation prompt (add_generation_prompt=True); `conversational` tells the recipe to hand the rewards each
    completion as [{"role": "assistant", "content": text}], as TRL does.
Tokens as preferences.py makes a prompt: no special tokens from the tokenizer, then its BOS in front where it has one
and the text lacks it. `stop_ids`: the checkpoint's EOS (tokenizer_config.json's eos_token, as transformers reads
it) and, for conversations, the template's end-of-turn tokens.
Sources: `.csv`/`.tsv`/`.jsonl`/`.json`/`.parquet` files or an HF dataset, read as for classification
(data.train_files, data.eval_files or a seeded data.eval_fraction held out, as instructions.py holds it out).
Bad input: a missing prompt column, an empty file or one without rows, a cell that is neither a string nor messages,
or a file mixing the two, is a one-line error naming the file and the setting. A row with an empty prompt is skipped
and counted; a prompt longer than `max_prompt_len` tokens is dropped (a cut prompt would ask another question),
counted, and warned about above seq_lengths.TRUNCATION_WARNING_RATE.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
import tokenizers

from jaxlm.config import DataConfig
from jaxlm.data import files
from jaxlm.data.tuning import chat, seq_lengths
from jaxlm.data.tuning import classification as cls_data
from jaxlm.data.tuning.instructions import hold_out, naming_the_setting
from jaxlm.data.tuning.preferences import as_messages, prompt_ids, response_end_id


@dataclasses.dataclass
class PromptRows:
  ids: list[list[int]]  # each prompt's token ids as the model sees them
  prompts: list[Any]  # what reward functions receive as `prompts`: the string, or the list of messages
  columns: dict[str, list]  # every other column of the rows, passed to reward functions as keyword arguments

  def __len__(self) -> int:
    return len(self.ids)


@dataclasses.dataclass
class PromptData:
  train: PromptRows
  eval: PromptRows
  conversational: bool  # completions go to the rewards as [{"role": "assistant", "content": text}] when True
  stop_ids: list[int]  # the tokens that end a completion: EOS, and a conversation's end-of-turn tokens
  stats: dict[str, Any]


@dataclasses.dataclass
class _Row:
  where: str
  row: int  # from 1, as the errors count rows
  prompt: Any  # the cell: a string or a list of messages
  columns: dict[str, Any]  # the row's other columns


def read_prompts(config: DataConfig, split: str) -> tuple[list[_Row], int]:
  """The rows of `split` with a non-empty prompt, each with every other column, and the number skipped as empty."""
  rows, skipped = [], 0
  column = config.prompt_column
  for where, table, _ in cls_data.read_rows(config, split, {column: "data.prompt_column"}, every_column=True):
    read = 0
    try:
      for i, row in enumerate(table):
        read += 1
        prompt = row.pop(column)
        if prompt is None or prompt == [] or (isinstance(prompt, str) and not prompt.strip()):
          skipped += 1
          continue
        rows.append(_Row(where, i + 1, prompt, row))
    except files.MissingColumn as e:
      if read or e.found:  # a file of rows without the column; else one without rows, said below
        raise
    if not read:
      raise ValueError(f"{where!r} holds no rows; give a file of prompts in data.prompt_column={column!r}, or remove "
                       "it from data.train_files / data.eval_files")
  return rows, skipped


def _is_conversational(rows: list[_Row]) -> bool:
  """True when the prompts are message lists, False when strings; a mix is an error naming the first odd row."""
  first = rows[0]
  conversational = as_messages(first.prompt, first.where, first.row, "data.prompt_column") is not None
  for r in rows:
    if (as_messages(r.prompt, r.where, r.row, "data.prompt_column") is not None) != conversational:
      kinds = ("a string", "messages") if conversational else ("messages", "a string")
      raise ValueError(f"row {r.row} of {r.where!r}: data.prompt_column holds {kinds[0]} where row {first.row} of "
                       f"{first.where!r} holds {kinds[1]}; give every prompt as a string or every one as messages")
  return conversational


def read_prompt_splits(d: DataConfig, seed: int) -> tuple[list[_Row], list[_Row], bool, int]:
  """(train rows, eval rows, conversational, rows skipped as empty): the prompts read, validated and split, before
  any tokenizer or chat template; every error of the data itself is raised here."""
  with naming_the_setting():
    train, skipped = read_prompts(d, "train")
    eval_, eval_skipped = read_prompts(d, "eval")
  skipped += eval_skipped
  if not train:
    raise ValueError(f"the training data holds no non-empty prompt in data.prompt_column={d.prompt_column!r} "
                     f"({skipped} rows skipped); check the files and data.prompt_column")
  conversational = _is_conversational(train + eval_)
  if not eval_:
    train, eval_ = hold_out(train, d.eval_fraction, seed, what="prompts")
  return train, eval_, conversational, skipped


def build_prompt_data(d: DataConfig, tokenizer: tokenizers.Tokenizer, seed: int, max_prompt_len: int,
                      chat_folder: str | None = None) -> PromptData:
  """Reads, splits (`read_prompt_splits`) and tokenizes the prompts described by `d` (module docstring);
  `chat_folder` is the checkpoint's tokenizer folder, whose chat template renders conversational prompts."""
  train, eval_, conversational, skipped = read_prompt_splits(d, seed)
  template = chat.load(chat_folder) if chat_folder else None
  if conversational and template is None:
    raise ValueError(f"the prompts in data.prompt_column={d.prompt_column!r} are conversations, which need the "
                     "checkpoint's chat template, and the tokenizer's folder has none (chat_template.jinja or "
                     "tokenizer_config.json's chat_template); use a checkpoint with one, or give the prompts as text")

  # Every split lists the same columns, so a reward reads at eval what it reads in training (None where absent).
  names = list(dict.fromkeys(name for r in train + eval_ for name in r.columns))

  def encode(rows: list[_Row]) -> tuple[PromptRows, list[int], int]:
    texts = [chat.render(template, r.prompt, add_generation_prompt=True) if conversational else r.prompt
             for r in rows]
    ids = prompt_ids(tokenizer, texts)
    kept = [i for i, p in enumerate(ids) if len(p) <= max_prompt_len]
    columns = {name: [rows[i].columns.get(name) for i in kept] for name in names}
    prompts = PromptRows([ids[i] for i in kept], [rows[i].prompt for i in kept], columns)
    return prompts, [len(p) for p in ids], len(rows) - len(kept)

  (train_rows, train_lengths, train_dropped), (eval_rows, eval_lengths, eval_dropped) = encode(train), encode(eval_)
  dropped, read = train_dropped + eval_dropped, len(train_lengths) + len(eval_lengths)
  advice = ("raise rl.max_prompt_length (0: what the model's positions leave after rl.max_completion_length) or "
            "shorten the prompts")
  for split, rows, lengths in (("training", train_rows, train_lengths), ("held-out", eval_rows, eval_lengths)):
    if not rows:
      raise ValueError(f"every {split} prompt is longer than max_prompt_len={max_prompt_len} tokens (the shortest "
                       f"is {min(lengths)}); {advice}")
  if dropped / read > seq_lengths.TRUNCATION_WARNING_RATE and jax.process_index() == 0:
    print(f"warning: {dropped / read:.1%} of the prompts ({dropped} of {read}) are longer than "
          f"max_prompt_len={max_prompt_len} tokens and are dropped; {advice}", flush=True)

  lengths = np.array([len(p) for p in train_rows.ids + eval_rows.ids])  # of the prompts kept
  stats: dict[str, Any] = {
      "train_prompts": len(train_rows), "eval_prompts": len(eval_rows),
      "prompt_tokens_min": int(lengths.min()), "prompt_tokens_mean": float(lengths.mean()),
      "prompt_tokens_max": int(lengths.max()), "max_prompt_len": max_prompt_len, "dropped_long_prompts": dropped,
      "drop_rate": dropped / read, "skipped_empty_prompts": skipped,
  }
  eos = response_end_id(tokenizer, chat_folder)
  stop_ids = sorted({*chat.end_of_turn_ids(chat_folder), eos}) if conversational else [eos]
  return PromptData(train_rows, eval_rows, conversational, stop_ids, stats)
