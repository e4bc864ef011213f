"""Preference pairs for decoder preference tuning (DPO and its kin): rows of (prompt, chosen, rejected) in TRL's
formats -> token ids laid out as one [2, T] slot per pair, chosen first.

  data = build_preference_data(config.data, tokenizer, seed, max_positions, chat_folder)
  batch = data.train.batch(indices)  # inputs, targets, positions, segment_ids: int32 [B, 2, T];
                                     # loss_mask: float32 [B, 2, T]; ref_logp: float32 [B, 2]; pair_weight: [B]

Formats (TRL's preference datasets):
  * standard: `prompt`, `chosen`, `rejected` strings (data.prompt_column, data.chosen_column, data.rejected_column);
  * conversational: the same columns holding lists of {role, content} messages, written with the checkpoint's chat
    template; the prompt's turns ending where the responses begin;
  * implicit prompt: no prompt column; the prompt is what chosen and rejected share at their start (messages, or
    text for strings).
Tokens, as TRL 1.16's DPOTrainer makes them (completions.py): prompt + chosen and prompt + rejected are each tokenized
whole, the prompt alone too, and the responses start where the prompt's ids and both wholes diverge. Standard pairs
are tokenized with the tokenizer's special tokens (a Llama or Gemma tokenizer's BOS starts the prompt) and each
response ends with the checkpoint's EOS (tokenizer_config.json's eos_token); conversational pairs are rendered by
the template (prompt with the generation prompt) and tokenized without special tokens, and get no EOS: a response
ends with the template's end of turn and what follows it (TRL before 1.16 appended the EOS after it too). The loss is
on the response tokens only.
Too long: a pair whose prompt and longer response exceed data.seq_len + 1 tokens keeps the end of its prompt (at
least the last half of the row's tokens, or the whole prompt if shorter), then the start of each response; such
pairs are counted (`truncated_pairs`) and warned about above seq_lengths.TRUNCATION_WARNING_RATE. A row
with an empty prompt, chosen or rejected response is skipped and counted. data.seq_len=0 chooses the length from
the training pairs.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import tokenizers

from jaxlm.config import DataConfig
from jaxlm.data import files
from jaxlm.data.tuning import chat, completions, seq_lengths
from jaxlm.data.tuning import classification as cls_data
from jaxlm.data.tuning.instructions import RowTable, hold_out, naming_the_setting


@dataclasses.dataclass
class Pair:
  """One tokenized preference pair, before the layout: prompt ids and each response's ids (module docstring)."""
  prompt: list[int]
  chosen: list[int]
  rejected: list[int]
  text: tuple[str, str, str]  # prompt, chosen and rejected as text (report.md)


class PreferencePairs(RowTable):
  """[N, 2, T] rows of pairs (chosen at 0, rejected at 1); `batch(indices)` gathers B pairs. `rows["ref_logp"]`,
  the reference model's summed response log-probabilities, is filled in before training (the recipe's start)."""


@dataclasses.dataclass
class PreferenceData:
  train: PreferencePairs
  eval: PreferencePairs
  eval_pairs: list[Pair]  # the held-out pairs as tokenized (generation in report.md)
  seq_len: int
  stop_ids: tuple[int, ...]  # EOS, and the chat template's end-of-turn tokens
  stats: dict[str, Any]


def pair_sequences(pair: Pair, seq_len: int) -> tuple[tuple[np.ndarray, np.ndarray], int, bool]:
  """The pair's two sequences (the prompt then chosen, the prompt then rejected), each at most seq_len + 1 tokens, cut
  by the module's rule; the prompt's length in them; and whether the pair was cut."""
  length, prompt = seq_len + 1, pair.prompt  # tokens a row holds: its inputs and one more target
  longest = max(len(pair.chosen), len(pair.rejected))
  cut = len(prompt) + longest > length
  if cut:
    prompt = prompt[-max(length - longest, min(len(prompt), length // 2)):]
  sequences = tuple(np.array([*prompt, *response][:length], np.int32) for response in (pair.chosen, pair.rejected))
  return sequences, len(prompt), cut


def lay_out(pairs: list[Pair], seq_len: int, pad_id: int) -> tuple[PreferencePairs, int]:
  """The pairs as [N, 2, T] rows (`pair_sequences`); returns the rows and how many pairs were cut."""
  n = len(pairs)
  rows = {"inputs": np.full((n, 2, seq_len), pad_id, np.int32), "targets": np.full((n, 2, seq_len), pad_id, np.int32),
          "positions": np.zeros((n, 2, seq_len), np.int32), "segment_ids": np.zeros((n, 2, seq_len), np.int32),
          "loss_mask": np.zeros((n, 2, seq_len), np.float32), "ref_logp": np.zeros((n, 2), np.float32),
          "pair_weight": np.ones(n, np.float32)}
  cut = 0
  for i, pair in enumerate(pairs):
    sequences, prompt_length, was_cut = pair_sequences(pair, seq_len)
    cut += was_cut
    for j, tokens in enumerate(sequences):
      k = len(tokens) - 1
      rows["inputs"][i, j, :k], rows["targets"][i, j, :k] = tokens[:-1], tokens[1:]
      rows["positions"][i, j, :k], rows["segment_ids"][i, j, :k] = np.arange(k), 1
      rows["loss_mask"][i, j, prompt_length - 1:k] = 1.0  # targets from the first response token on
  return PreferencePairs(rows), cut


Layout = Callable[[dict[str, list[Pair]], int, int], dict[str, tuple[PreferencePairs, int]]]


def lay_out_splits(splits: dict[str, list[Pair]], seq_len: int, pad_id: int) -> dict[str, tuple[PreferencePairs, int]]:
  """`lay_out` of each split: the default `Layout`."""
  return {split: lay_out(pairs, seq_len, pad_id) for split, pairs in splits.items()}


# ----------------------------------------------------------------------------------------------- reading pairs


def read_rows(config: DataConfig, split: str) -> list[tuple[str, int, Any, Any, Any]]:
  """[(where, row, prompt or None, chosen, rejected)] of `split`; the prompt column is optional (implicit prompts)."""
  columns = {config.chosen_column: "data.chosen_column", config.rejected_column: "data.rejected_column"}
  out = []
  for where, table, _ in cls_data.read_rows(config, split, {config.prompt_column: "data.prompt_column", **columns}):
    try:
      for i, row in enumerate(table):
        out.append((where, i + 1, row[config.prompt_column], row[config.chosen_column], row[config.rejected_column]))
    except files.MissingColumn as e:
      if e.column != config.prompt_column:
        raise
      out = [r for r in out if r[0] != where]  # read the file again without the prompt: prompts are implicit
      again = next(table for w, table, _ in cls_data.read_rows(config, split, columns) if w == where)
      out.extend((where, i + 1, None, row[config.chosen_column], row[config.rejected_column])
                 for i, row in enumerate(again))
  return out


def as_messages(value: Any, where: str, row: int, setting: str) -> list[dict] | None:
  """A cell as {role, content} messages, or None when it is a string."""
  if isinstance(value, str) or value is None:
    return None
  if not isinstance(value, list) or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                            and isinstance(m.get("content"), str) for m in value):
    raise ValueError(f"row {row} of {where!r}: {setting} holds neither a string nor a list of {{role, content}} "
                     f"messages: {value!r}"[:300])
  return [{"role": m["role"], "content": m["content"]} for m in value]


def _shared_prefix(a, b):
  """TRL's implicit prompt: the longest common start of two sequences (strings or message lists); for strings, a
  space just before the split goes to the responses."""
  n = sum(1 for _ in itertools.takewhile(lambda xy: xy[0] == xy[1], zip(a, b)))
  if isinstance(a, str) and n and a[n - 1] == " ":
    n -= 1
  return a[:n], a[n:], b[n:]


def _parts(record: tuple, template: chat.ChatTemplate | None) -> tuple[Any, Any, Any] | None:
  """(prompt, chosen, rejected): three strings, or three message lists (a string prompt before message responses is
  one user turn); None for a row with an empty part."""
  where, row, prompt, chosen, rejected = record
  c, r = as_messages(chosen, where, row, "the chosen column"), as_messages(rejected, where, row, "the rejected column")
  if (c is None) != (r is None):
    raise ValueError(f"row {row} of {where!r}: chosen and rejected must both be strings or both be message lists")
  if c is None:  # standard: strings
    if prompt is None:
      prompt, chosen, rejected = _shared_prefix(chosen or "", rejected or "")
    parts = (prompt, chosen, rejected)
    return parts if all(isinstance(t, str) and t.strip() for t in parts) else None
  if template is None:
    raise ValueError(f"row {row} of {where!r} holds conversations, which need the checkpoint's chat template, and "
                     "the tokenizer's folder has none (chat_template.jinja or tokenizer_config.json's chat_template)")
  p = as_messages(prompt, where, row, "the prompt column") if prompt is not None else None
  if p is None and isinstance(prompt, str):
    p = [{"role": "user", "content": prompt}]
  if p is None:
    p, c, r = _shared_prefix(c, r)
  return (p, c, r) if p and c and r else None


def encode_pair(parts: tuple[Any, Any, Any], tokenizer: tokenizers.Tokenizer, eos: int,
                template: chat.ChatTemplate | None) -> Pair:
  """One pair's tokens as the module docstring makes them, with its text for the report (a conversational pair's
  as the template writes it)."""
  prompt, chosen, rejected = parts
  if isinstance(chosen, str):
    ids, (c, r) = completions.text_completions(tokenizer, tokenizer.id_to_token(eos), prompt, [chosen, rejected])
    return Pair(ids, c, r, parts)
  ids, (c, r) = completions.chat_completions(template, prompt, [chosen, rejected])
  prompt_text = chat.render(template, prompt, add_generation_prompt=True)
  with_chosen, with_rejected = chat.render(template, prompt + chosen), chat.render(template, prompt + rejected)
  # What the generation prompt adds may differ from how the template writes the reply's start: keep the shared part.
  prompt_text = "".join(x for x, _ in itertools.takewhile(lambda xy: xy[0] == xy[1], zip(prompt_text, with_chosen)))
  return Pair(ids, c, r, (prompt_text, with_chosen[len(prompt_text):], with_rejected[len(prompt_text):]))


def prompt_ids(tokenizer: tokenizers.Tokenizer, texts: list[str]) -> list[list[int]]:
  """RL prompts' ids (prompts.py): tokenized without special tokens, then the tokenizer's BOS in front where it has
  one and the text lacks it."""
  # The tokens the tokenizer puts before a text (a BOS for Llama and Gemma; none for GPT-2 and Qwen).
  prefix = tokenizer.encode("", add_special_tokens=True).ids
  ids = [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=False)]
  return [p if p[:len(prefix)] == prefix else [*prefix, *p] for p in ids]  # a template may write it already


response_end_id = completions.eos_id  # the EOS of a standard pair's responses (RL prompts read it too)


def build_preference_data(config: DataConfig, tokenizer: tokenizers.Tokenizer, seed: int, max_positions: int,
                          chat_folder: str | None = None, layout: Layout | None = None) -> PreferenceData:
  """Reads, splits, tokenizes and lays out the preference pairs described by `config` (module docstring); `layout`
  lays out both splits ({split: pairs}, seq_len, pad id) -> {split: (rows, pairs cut)}: `lay_out`'s [N, 2, T] rows
  when None, or padding-free rows (pair_packing.py)."""
  template = chat.load(chat_folder) if chat_folder else None
  eos = completions.eos_id(tokenizer, chat_folder)
  splits, skipped = {}, 0
  for split in ("train", "eval"):
    parts = []
    with naming_the_setting():
      records = read_rows(config, split)
    for record in records:
      t = _parts(record, template)
      skipped += t is None
      if t is not None:
        parts.append(t)
    splits[split] = parts
  if not splits["train"]:
    raise ValueError(f"the training data holds no pair with a non-empty prompt, chosen and rejected response "
                     f"({skipped} rows skipped); check the files and data.prompt_column / chosen_column / "
                     "rejected_column")
  if not splits["eval"]:
    splits["train"], splits["eval"] = hold_out(splits["train"], config.eval_fraction, seed)

  pairs = {split: [encode_pair(t, tokenizer, eos, template) for t in parts] for split, parts in splits.items()}
  lengths = {split: np.array([len(p.prompt) + max(len(p.chosen), len(p.rejected)) - 1 for p in ps])
             for split, ps in pairs.items()}
  seq_len = config.seq_len or seq_lengths.choose_seq_len(lengths["train"], max_positions, at_least=2)
  laid = (layout or lay_out_splits)(pairs, seq_len, eos)
  (train, train_cut), (eval_, eval_cut) = laid["train"], laid["eval"]
  every = np.concatenate(list(lengths.values()))
  stats: dict[str, Any] = {
      "train_pairs": len(pairs["train"]), "eval_pairs": len(pairs["eval"]), "skipped_empty_pairs": skipped,
      "seq_len": seq_len,
      **{f"tokens_p{q}": float(np.percentile(every, q)) for q in (50, 90, 99)}, "tokens_max": int(every.max()),
      "truncated_pairs": train_cut + eval_cut, "truncation_rate": (train_cut + eval_cut) / len(every),
      "train_response_tokens": int(train.rows["loss_mask"].sum()),
      "padding_fraction": float(1 - (train.rows["segment_ids"] > 0).mean()),
  }
  stop_ids = tuple(sorted({*chat.end_of_turn_ids(chat_folder), eos})) if template else (eos,)
  return PreferenceData(train, eval_, pairs["eval"], seq_len, stop_ids, stats)
