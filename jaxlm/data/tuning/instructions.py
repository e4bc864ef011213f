"""Prompt/response pairs and conversations for decoder instruction tuning: rows -> token ids with a loss weight per
token -> rows of whole examples, packed apart.

  data = build_instruction_data(config.data, tokenizer, seed, max_positions, chat_folder)
  loader = make_train_iterator(data.train, batch_size_per_process, seed, shuffle)   # jaxlm.data's grain loader
  batch = next(loader)  # inputs, targets, segment_ids, positions: int32 [B, T]; loss_mask: float32 [B, T]

The examples are TRL 1.16's SFTTrainer's (its prepared dataset's input_ids and labels), and the batches have the
layout of pretraining's packed rows (jaxlm/data/packing.py), so the decoder's loss and eval steps are pretraining's:
  * a pair is SFTTrainer's prompt/completion row (completion_only_loss), tokenized by completions.py: prompt +
    response (+ the checkpoint's EOS) tokenized whole, the loss on what follows the prompt's ids; with a chat
    template in `chat_folder` (the checkpoint's tokenizer folder) the pair is one user turn and one assistant turn,
    rendered by the template, and the response ends with the template's end of turn (no EOS);
  * a `data.messages_column` conversation (conversations.py) is SFTTrainer's messages row with assistant_only_loss:
    the loss on each assistant turn (chat.encode_conversation); without a template it is a one-line error;
  * an example's inputs are its tokens without the last, its targets without the first, and loss_mask is the weight
    of each target's token: no loss on a prompt token;
  * examples are packed whole into rows of data.seq_len (first fit, longest first), each with its own segment id and
    positions from 0, so no token attends to another example (models/masks.py) and each is computed as if alone:
    every target's loss is the one SFTTrainer computes for it.
Sources: `.csv`/`.tsv`/`.jsonl`/`.json`/`.parquet` files or an HF dataset, read as for classification
(data.train_files, data.eval_files or a seeded data.eval_fraction held out), columns `data.prompt_column` and
`data.response_column`.
Bad input: a missing column or a prompt that fills data.seq_len by itself is a one-line error naming the key or the
row; a row with an empty prompt or response is skipped and counted; a pair longer than data.seq_len keeps its prompt
and the start of its response (counted, and warned about above `seq_lengths.TRUNCATION_WARNING_RATE`); a longer
conversation keeps its first data.seq_len + 1 tokens, the same way. data.seq_len=0 chooses the length from the
training examples (`seq_lengths.choose_seq_len`), long enough for every prompt.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import tokenizers

from jaxlm.config import DataConfig
from jaxlm.data import files
from jaxlm.data.tuning import chat, completions, conversations, seq_lengths
from jaxlm.data.tuning import classification as cls_data


@dataclasses.dataclass
class Example:
  """One tokenized example (a pair or a conversation), cut to data.seq_len + 1 tokens."""
  tokens: np.ndarray  # int32 [N]
  weights: np.ndarray  # float32 [N]: 1 on the tokens the model learns to write (responses and what closes them)
  prompt: list[int]  # what the model continues in report.md: the example before its (last) reply
  text: tuple[str, str]  # (prompt, reference reply) as text, for report.md


class RowTable:
  """Arrays with one row per example; `batch(indices)` gathers rows of each (what the grain loader takes)."""

  def __init__(self, rows: dict[str, np.ndarray]):
    self.rows = rows

  def __len__(self) -> int:
    return self.rows["inputs"].shape[0]

  def batch(self, indices) -> dict[str, np.ndarray]:
    indices = np.asarray(indices, dtype=np.int64)
    return {k: v[indices] for k, v in self.rows.items()}


class PackedPairs(RowTable):
  """Rows of whole examples; `batch(indices)` is a dict of [B, T] arrays in pretraining's example layout."""

  def __init__(self, rows: dict[str, np.ndarray]):
    super().__init__(rows)
    self.seq_len = rows["inputs"].shape[1]
    self.num_tokens = int(rows["loss_mask"].sum())  # response targets in all rows
    self.num_slots = rows["inputs"].size
    self.num_used = int((rows["segment_ids"] > 0).sum())  # slots holding a token of some pair


@dataclasses.dataclass
class InstructionData:
  train: PackedPairs
  eval: PackedPairs
  eval_examples: list[Example]  # the held-out examples, unpacked (generation in the report)
  train_prompts: list[list[int]]  # each training example's tokens before its first loss token (on-policy sampling)
  seq_len: int  # data.seq_len, or the one chosen from the data
  eos_id: int
  stop_ids: tuple[int, ...]  # the tokens that end a reply: EOS, or the chat template's end-of-turn tokens
  stats: dict[str, Any]  # flat numbers for the report


def pair_example(tokenizer: tokenizers.Tokenizer, eos: int, template: chat.ChatTemplate | None, prompt: str,
                 response: str) -> Example:
  """A prompt/response pair as TRL 1.16's SFTTrainer tokenizes a prompt/completion row (completions.py): as text,
  the response ending with EOS; under `template`, one user turn and one assistant turn. Weights 1 on the completion,
  the ids after the longest start that the prompt's ids share with the whole's."""
  if template is None:
    prompt_ids, (completion,) = completions.text_completions(tokenizer, tokenizer.id_to_token(eos), prompt, [response])
    text = (prompt, response)
  else:
    user, reply = conversations.pair_messages(prompt, response)
    prompt_ids, (completion,) = completions.chat_completions(template, [user], [[reply]])
    text = (chat.render(template, [user], add_generation_prompt=True), response)
  tokens = np.array([*prompt_ids, *completion], np.int32)
  weights = np.zeros(len(tokens), np.float32)
  weights[len(prompt_ids):] = 1.0
  return Example(tokens, weights, list(prompt_ids), text)


def pack_examples(examples: list[Example], seq_len: int, eos_id: int) -> PackedPairs:
  """First-fit decreasing: each example (whole) goes into the first row with room, longest first. An example's
  inputs are its tokens without the last, its targets without the first, and each target weighs what its token
  does, so the loss of an example is on the tokens it writes."""
  lengths = [len(e.tokens) - 1 for e in examples]
  order = sorted(range(len(examples)), key=lambda i: (-lengths[i], i))
  room = np.zeros(len(examples), np.int64)  # free slots per row (at most one row per example)
  placed: list[list[int]] = []  # example indices per row
  for i in order:
    fits = np.flatnonzero(room[:len(placed)] >= lengths[i])
    row = int(fits[0]) if len(fits) else len(placed)
    if row == len(placed):
      placed.append([])
      room[row] = seq_len
    room[row] -= lengths[i]
    placed[row].append(i)
  n = len(placed)
  rows = {"inputs": np.full((n, seq_len), eos_id, np.int32), "targets": np.full((n, seq_len), eos_id, np.int32),
          "segment_ids": np.zeros((n, seq_len), np.int32), "positions": np.zeros((n, seq_len), np.int32),
          "loss_mask": np.zeros((n, seq_len), np.float32)}
  for row, members in enumerate(placed):
    start = 0
    for segment, i in enumerate(sorted(members), start=1):
      tokens, weights = examples[i].tokens, examples[i].weights
      end = start + lengths[i]
      rows["inputs"][row, start:end], rows["targets"][row, start:end] = tokens[:-1], tokens[1:]
      rows["segment_ids"][row, start:end], rows["positions"][row, start:end] = segment, np.arange(lengths[i])
      rows["loss_mask"][row, start:end] = weights[1:]
      start = end
  return PackedPairs(rows)


def eval_batches(packed: RowTable, global_batch: int, process_index: int, process_count: int,
                 weight: str = "loss_mask") -> list[dict[str, np.ndarray]]:
  """Every held-out row once, as this process's slices of global batches; the last batch is filled with copies of
  row 0 whose `weight` (loss_mask; preference pairs: pair_weight) is 0, so the eval means are over held-out rows."""
  local = slice(process_index * global_batch // process_count, (process_index + 1) * global_batch // process_count)
  filler = (-len(packed)) % global_batch
  indices = np.concatenate([np.arange(len(packed)), np.zeros(filler, np.int64)])
  batches = []
  for start in range(0, len(indices), global_batch):
    batch = packed.batch(indices[start:start + global_batch])
    real = np.arange(start, start + global_batch) < len(packed)
    batch[weight] = batch[weight] * real.reshape(-1, *[1] * (batch[weight].ndim - 1))
    batches.append({k: v[local] for k, v in batch.items()})
  return batches


# ----------------------------------------------------------------------------------------------- reading pairs


def read_pairs(config: DataConfig, split: str) -> tuple[list[tuple[str, int, str, str]], int]:
  """[(where, row, prompt, response)] of `split` and the number of rows skipped for an empty prompt or response."""
  rows, skipped = [], 0
  columns = {config.prompt_column: "data.prompt_column", config.response_column: "data.response_column"}
  for where, table, _ in cls_data.read_rows(config, split, columns):
    for i, row in enumerate(table):
      prompt, response = row[config.prompt_column], row[config.response_column]
      if not (isinstance(prompt, str) and prompt.strip() and isinstance(response, str) and response.strip()):
        skipped += 1
        continue
      rows.append((where, i + 1, prompt, response))
  return rows, skipped


def hold_out(rows: list, eval_fraction: float, seed: int, what: str = "pairs") -> tuple[list, list]:
  """(train, eval) of `rows`, a seeded random `eval_fraction` of them held out (at least one, and one left to train),
  each part in the rows' order."""
  if len(rows) < 2:
    raise ValueError(f"holding out eval {what} needs >= 2 training {what}; add data or give data.eval_files")
  order = np.random.default_rng(seed).permutation(len(rows))
  held_out = min(len(rows) - 1, max(1, round(eval_fraction * len(rows))))
  return [rows[i] for i in sorted(order[held_out:])], [rows[i] for i in sorted(order[:held_out])]


@contextlib.contextmanager
def naming_the_setting() -> Iterator[None]:
  """Instruction data's wording of a missing column (`files.MissingColumn`): the setting first, as it is written."""
  try:
    yield
  except files.MissingColumn as e:
    raise ValueError(f"{e.setting}={e.column!r} is not a column of {e.where!r}; its columns are {e.found}") from None


def build_instruction_data(config: DataConfig, tokenizer: tokenizers.Tokenizer, seed: int, max_positions: int,
                           chat_folder: str | None = None) -> InstructionData:
  """Reads, splits, tokenizes and packs the pairs or conversations described by `config` (module docstring);
  `chat_folder` is the checkpoint's tokenizer folder, whose chat template (if any) formats every example."""
  eos = completions.eos_id(tokenizer, chat_folder)
  template = chat.load(chat_folder) if chat_folder is not None else None
  if config.messages_column and template is None:
    raise ValueError(f"data.messages_column={config.messages_column!r} needs a chat template, and "
                     f"{chat_folder or 'the tokenizer'!r} has none (chat_template.jinja or tokenizer_config.json's "
                     "chat_template); use a checkpoint with one, or prompt/response pairs (data.messages_column='')")
  read = conversations.read_conversations if config.messages_column else read_pairs
  with naming_the_setting():
    train_rows, skipped = read(config, "train")
    eval_rows, eval_skipped = read(config, "eval")
  skipped += eval_skipped
  if not train_rows:
    columns = (repr(config.messages_column) + " with an assistant turn" if config.messages_column else
               f"{config.prompt_column!r} and {config.response_column!r}")
    raise ValueError(f"the training data holds no example with a non-empty {columns} ({skipped} rows skipped); "
                     "check the files and data.*_column")
  if not eval_rows:
    train_rows, eval_rows = hold_out(train_rows, config.eval_fraction, seed)

  def encode(rows) -> list[Example]:
    if config.messages_column:
      return [Example(*conversations.encode(chat_folder, r[2])) for r in rows]
    return [pair_example(tokenizer, eos, template, r[2], r[3]) for r in rows]

  encoded = {"train": encode(train_rows), "eval": encode(eval_rows)}
  # The tokens before the first one with a loss: the prompt, or the turns before the first reply.
  reading = {split: [int(np.argmax(e.weights > 0)) for e in examples] for split, examples in encoded.items()}
  seq_len = config.seq_len
  if seq_len == 0:
    lengths = np.array([len(e.tokens) - 1 for e in encoded["train"]])  # an example's inputs
    seq_len = seq_lengths.choose_seq_len(lengths, max_positions, at_least=max(reading["train"]) + 1)
  examples, full_lengths = {}, []
  for split, rows in (("train", train_rows), ("eval", eval_rows)):
    for (where, row, *_), prompt_length in zip(rows, reading[split]):
      if prompt_length >= seq_len:
        prompt, reply = (("the turns before the first assistant reply", "a reply") if config.messages_column else
                         ("the prompt", "its response"))
        raise ValueError(f"{prompt} of row {row} of {where!r} is {prompt_length} tokens, which leaves no room for "
                         f"{reply} in data.seq_len={seq_len}; raise data.seq_len (the model has {max_positions} "
                         f"positions) or shorten the {'conversation' if config.messages_column else 'prompt'}")
    full_lengths.extend(len(e.tokens) - 1 for e in encoded[split])
    # An example fits when its inputs do; a longer one keeps what fills seq_len (a pair loses its EOS, a
    # conversation the end of the turn it is cut in and every later turn).
    examples[split] = [dataclasses.replace(e, tokens=e.tokens[:seq_len + 1], weights=e.weights[:seq_len + 1])
                       for e in encoded[split]]
  train, eval_ = pack_examples(examples["train"], seq_len, eos), pack_examples(examples["eval"], seq_len, eos)
  lengths = np.array(full_lengths)
  truncated = int((lengths > seq_len).sum())
  stats: dict[str, Any] = {
      "train_pairs": len(examples["train"]), "eval_pairs": len(examples["eval"]), "skipped_empty_pairs": skipped,
      "seq_len": seq_len, **{f"tokens_p{q}": float(np.percentile(lengths, q)) for q in (50, 90, 99)},
      "tokens_max": int(lengths.max()), "truncated_pairs": truncated, "truncation_rate": truncated / len(lengths),
      "train_rows": len(train), "eval_rows": len(eval_), "train_response_tokens": train.num_tokens,
      "eval_response_tokens": eval_.num_tokens, "packing_efficiency": train.num_used / max(1, train.num_slots),
  }
  stop_ids = tuple(sorted({*chat.end_of_turn_ids(chat_folder), eos})) if template else (eos,)
  prompts = [e.tokens[:k].tolist() for e, k in zip(examples["train"], reading["train"])]
  return InstructionData(train, eval_, examples["eval"], prompts, seq_len, eos, stop_ids, stats)
