"""Labelled examples for sequence classification: rows -> class ids -> token ids -> padded, resumable batches.

  data = build_classification_data(config.data, tokenizer, seed)
  loader = ClassificationLoader(data.train, global_batch, seed, config.data.batching)  # endless, resumable
  batch = next(loader)  # input_ids, attention_mask, token_type_ids: int32 [B_local, L]; labels int32 [B_local];
                        # weights float32 [B_local] (0 marks a filler row of a last, partial eval batch)

Sources (read by jaxlm/data/files.py's and corpora/sources.py's streaming readers, held in memory, never capped): local
`.csv`/`.tsv`/`.jsonl`/`.json`/`.parquet` files (`data.train_files`, `data.eval_files`), or `data.hf_name` (a hub name
when online or a local folder of data files, streamed; a `save_to_disk` folder, memory-mapped) with `data.hf_split`
and `data.hf_eval_split`. Without eval files or an eval split, a seeded random `data.eval_fraction` of the rows is
held out (random, not the last rows: labelled files are often sorted by class).

Rows: `data.text_column` (and `data.text_pair_column` for pairs) and `data.label_column`. Labels are integer ids or
strings (a CSV/TSV label column whose every non-empty cell is a number holds numbers). Class names are `data.labels`
when given, else the names of an HF `ClassLabel` column, else the sorted training labels (strings) or 0..max (ints).
Handling of bad rows, every case counted in the statistics or raised as a one-line error:
  * empty, missing or non-string text, missing label: the row is skipped and counted (`skipped_empty_text`,
    `skipped_missing_label`);
  * a label outside the classes (negative id, id >= number of classes, a name not in `data.labels`, an eval label
    never seen in training, a fractional number): an error naming the file, row and value;
  * a text longer than `data.seq_len` tokens: cut (longest-first for pairs) and counted (`truncated_examples`,
    `truncation_rate`); data.seq_len=0 chooses the length from the training texts (jaxlm/data/tuning/seq_lengths.py);
  * a file that is missing, empty, binary or not UTF-8: an error naming the file (and the byte offset).

Batching (`data.batching`): each batch is padded to its longest example rounded up to a power of two (>= 16, at
most `data.seq_len`), so short texts do not pay for long ones and at most log2(seq_len / 16) + 1 shapes compile;
`bucket` also groups examples of similar length (sorted inside windows of 16 batches, then batches shuffled);
`max` pads every batch to `data.seq_len` (one compiled shape).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
import tokenizers

from jaxlm.config import DataConfig
from jaxlm.data import files
from jaxlm.data.corpora import sources
from jaxlm.data.tuning import seq_lengths

_MIN_PAD = 16  # smallest padded length; batch lengths are powers of two from here up to data.seq_len
_BUCKET_WINDOW = 16  # batches per window whose examples are sorted by length (bucket batching)


@dataclasses.dataclass
class Examples:
  """Tokenized examples, padded to `seq_len` for storage; `lengths` gives the real number of tokens."""
  input_ids: np.ndarray  # int32 [N, seq_len]
  token_type_ids: np.ndarray  # int32 [N, seq_len]
  lengths: np.ndarray  # int32 [N]
  labels: np.ndarray  # int32 [N]
  pad_id: int = 0  # the tokenizer's padding token (RoBERTa's <pad> is 1; its positions count the others)

  def __len__(self) -> int:
    return len(self.labels)

  def batch(self, indices: np.ndarray, pad_to: int, weights: np.ndarray | None = None) -> dict[str, np.ndarray]:
    positions = np.arange(pad_to)[None, :]
    mask = (positions < self.lengths[indices][:, None]).astype(np.int32)
    return {
        "input_ids": np.where(mask == 1, self.input_ids[indices, :pad_to], self.pad_id).astype(np.int32),
        "attention_mask": mask,
        "token_type_ids": self.token_type_ids[indices, :pad_to] * mask,
        "labels": self.labels[indices],
        "weights": np.ones(len(indices), np.float32) if weights is None else weights.astype(np.float32),
    }


@dataclasses.dataclass
class ClassificationData:
  class_names: list[str]
  train: Examples
  eval: Examples
  stats: dict[str, Any]  # flat numbers for the report: counts, label distribution, token-length percentiles
  seq_len: int = 0  # the length the examples were cut to: data.seq_len, or the one chosen from the data


# ----------------------------------------------------------------------------------------------- reading rows


def read_rows(config: DataConfig, split: str, columns: dict[str, str],
              every_column: bool = False) -> list[tuple[str, Iterator[dict], Any]]:
  """[(where, rows, features)] of `split` ("train" or "eval"): `rows` streams dicts of `columns` (each wanted column
  -> the setting that names it, for the `files.MissingColumn` error), and with `every_column` of the other columns
  too; `where` names the file or dataset in errors; `features` are an HF dataset's (a ClassLabel names the classes),
  else {}.

  Returns an empty list for eval when no eval files or eval split are configured."""
  paths = config.train_files if split == "train" else config.eval_files
  if paths:
    return [(path, files.iter_rows([path], columns, every_column), {})
            for path in files.check_files(paths, files.TABLE_KINDS)]
  if config.source == "hf" and (split == "train" or config.hf_eval_split):
    hf_split, setting = ((config.hf_split, "data.hf_split") if split == "train" else
                         (config.hf_eval_split, "data.hf_eval_split"))
    dataset = sources.open_hf(config.hf_name, config.hf_config, hf_split, setting)
    where = f"{config.hf_name}[{hf_split}]"
    rows = sources.iter_hf_rows(dataset, columns, where, every_column)
    return [(where, rows, getattr(dataset, "features", None) or {})]
  if split == "train":
    raise ValueError("fine-tuning needs data.train_files (.csv, .tsv, .jsonl, .parquet) or data.source=hf with "
                     "data.hf_name")
  return []


def _numbers(cells: list[Any]) -> list[Any]:
  """A CSV column's cells as ints, else floats, when every non-empty one reads as such (as pandas types a column),
  so that label ids 0..K-1 are ids, not names sorted as text; else the cells as they are."""
  filled = {c.strip() for c in cells if isinstance(c, str) and c.strip()}
  for kind in (int, float):
    try:
      values = {c: kind(c) for c in filled}
    except ValueError:
      continue
    return [values.get(c.strip()) if isinstance(c, str) else c for c in cells]
  return cells


# ----------------------------------------------------------------------------------------------- labels


def _as_label(value: Any) -> int | str | float | None:
  """An int id, a string name, or None (missing). Floats appear where an int column has gaps (pandas, Arrow) or a
  file writes ids as 1.0."""
  if value is None or isinstance(value, bool):
    return None if value is None else int(value)
  if isinstance(value, (int, np.integer)):
    return int(value)
  if isinstance(value, (float, np.floating)):
    if math.isnan(value):
      return None
    return int(value) if float(value).is_integer() else float(value)  # a fraction: refused by the caller
  text = str(value).strip()
  return text or None


def class_names_for(labels: list[int | str], configured: tuple[str, ...]) -> list[str]:
  if configured:
    return list(configured)
  if all(isinstance(label, int) for label in labels):
    return [str(i) for i in range(max(labels) + 1)]
  return sorted({str(label) for label in labels})


def _label_id(label: int | str, names: list[str], index: dict[str, int], where: str, row: int, split: str) -> int:
  if isinstance(label, int):
    if not 0 <= label < len(names):
      raise ValueError(f"{split} label {label} (row {row} of {where!r}) is outside the class range 0..{len(names) - 1}"
                       f"{' of data.labels' if split == 'train' else ' seen in training'}; fix the row, or set "
                       f"data.labels to all class names")
    return label
  if label not in index:
    seen = "is not one of data.labels" if split == "train" else "never occurs in the training labels"
    raise ValueError(f"{split} label {label!r} (row {row} of {where!r}) {seen} {names[:20]}; fix the row, add "
                     f"training examples of it, or set data.labels to all class names")
  return index[label]


# ----------------------------------------------------------------------------------------------- tokenizing


def load_checkpoint_tokenizer(folder_or_file: str) -> tokenizers.Tokenizer:
  """The tokenizer of an HF checkpoint folder: tokenizer.json, else a WordPiece vocab.txt (BERT's)."""
  path = folder_or_file
  if os.path.isdir(path):
    if os.path.isfile(os.path.join(path, "tokenizer.json")):
      path = os.path.join(path, "tokenizer.json")
    elif os.path.isfile(os.path.join(path, "vocab.txt")):
      lowercase = True
      config_path = os.path.join(path, "tokenizer_config.json")
      if os.path.isfile(config_path):
        with open(config_path) as f:
          lowercase = bool(json.load(f).get("do_lower_case", True))
      tokenizer = tokenizers.BertWordPieceTokenizer(os.path.join(path, "vocab.txt"), lowercase=lowercase)
      return _plain(tokenizer._tokenizer)  # noqa: SLF001 (the underlying tokenizers.Tokenizer)
    else:
      raise ValueError(f"{path!r} has no tokenizer.json or vocab.txt; put the checkpoint's tokenizer there or set "
                       f"data.tokenizer")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"tokenizer file {path!r} does not exist; fix data.tokenizer or init_from")
  return _plain(tokenizers.Tokenizer.from_file(path))


def _plain(tokenizer: tokenizers.Tokenizer) -> tokenizers.Tokenizer:
  # HF tokenizer.json files often carry fixed padding/truncation (MiniLM: pad to 128); batching is done here.
  tokenizer.no_padding()
  tokenizer.no_truncation()
  return tokenizer


# Padding tokens of the HF tokenizers (BERT and DistilBERT, ModernBERT: [PAD]; RoBERTa, XLM-R: <pad>), for a
# tokenizer.json that does not pad by itself.
PAD_TOKENS = ("[PAD]", "<pad>", "<|padding|>", "<|pad|>")


def pad_token_id(tokenizer: tokenizers.Tokenizer) -> int:
  """The id a batch is padded with: the tokenizer's own padding id, else the first of PAD_TOKENS it holds, else 0."""
  if tokenizer.padding:
    return int(tokenizer.padding["pad_id"])
  ids = (tokenizer.token_to_id(token) for token in PAD_TOKENS)
  return next((int(i) for i in ids if i is not None), 0)


def tokenize(tokenizer: tokenizers.Tokenizer, texts: list[str], pairs: list[str] | None, seq_len: int
             ) -> tuple[Examples, np.ndarray]:
  """Examples (labels left 0; padded with the tokenizer's `pad_token_id`) and the untruncated token counts [N].
  Longer examples are cut to `seq_len` (longest-first for pairs) with the special tokens kept."""
  inputs = list(zip(texts, pairs)) if pairs is not None else texts
  encodings = tokenizer.encode_batch(inputs) if inputs else []
  full_lengths = np.array([len(e.ids) for e in encodings], np.int64)
  long_rows = np.flatnonzero(full_lengths > seq_len)
  if len(long_rows):  # encode again with truncation only the rows that need it
    tokenizer.enable_truncation(seq_len, strategy="longest_first")
    try:
      for row, encoding in zip(long_rows, tokenizer.encode_batch([inputs[i] for i in long_rows])):
        encodings[row] = encoding
    finally:
      tokenizer.no_truncation()
  n, pad_id = len(encodings), pad_token_id(tokenizer)
  input_ids, type_ids = np.full((n, seq_len), pad_id, np.int32), np.zeros((n, seq_len), np.int32)
  lengths = np.zeros(n, np.int32)
  for i, encoding in enumerate(encodings):
    length = len(encoding.ids)
    input_ids[i, :length], type_ids[i, :length], lengths[i] = encoding.ids, encoding.type_ids, length
  return Examples(input_ids, type_ids, lengths, np.zeros(n, np.int32), pad_id), full_lengths


# ----------------------------------------------------------------------------------------------- the datasets


@dataclasses.dataclass
class LabelledRows:
  """The rows kept after reading and validation, before any tokenizer: (where, row, text, pair or None) per split,
  each split's class ids, and the class names."""
  class_names: list[str]
  train: list[tuple[str, int, str, str | None]]
  eval: list[tuple[str, int, str, str | None]]
  train_labels: np.ndarray  # int32 [N_train]
  eval_labels: np.ndarray  # int32 [N_eval]
  skipped: dict[str, int]  # skipped_empty_text, skipped_missing_label


def read_labelled_rows(config: DataConfig, seed: int) -> LabelledRows:
  """Reads, validates and splits the labelled rows described by `config` (module docstring): every error of the data
  itself (files, columns, parsing, labels, too few rows) is raised here, before a tokenizer or model is needed."""
  skipped = {"skipped_empty_text": 0, "skipped_missing_label": 0}
  label_feature_names: list[str] = []  # an HF ClassLabel column names its classes (e.g. glue/sst2)
  columns = {config.text_column: "data.text_column", config.label_column: "data.label_column"}
  if config.text_pair_column:
    columns[config.text_pair_column] = "data.text_pair_column"

  def rows_of(split: str) -> list[tuple[str, int, str, str | None, int | str]]:
    rows = []
    for where, table, features in read_rows(config, split, columns):
      feature = features.get(config.label_column)
      if split == "train" and getattr(feature, "names", None) and not label_feature_names:
        label_feature_names.extend(str(n) for n in feature.names)
      table = list(table)
      labels = [row[config.label_column] for row in table]
      if files.file_kind(where) in ("csv", "tsv"):  # `where` is the file's path
        labels = _numbers(labels)
      for i, (row, raw_label) in enumerate(zip(table, labels)):
        text = row[config.text_column]
        pair = row[config.text_pair_column] if config.text_pair_column else None
        if not _is_text(text) or (config.text_pair_column and not _is_text(pair)):
          skipped["skipped_empty_text"] += 1
          continue
        label = _as_label(raw_label)
        if label is None:
          skipped["skipped_missing_label"] += 1
          continue
        if isinstance(label, float):
          raise ValueError(f"{split} label {label} (row {i + 1} of {where!r}) is neither a class id nor a class "
                           f"name; fine-tuning classifies (regression targets are not supported)")
        rows.append((where, i + 1, text, pair, label))
    return rows

  train_rows, eval_rows = rows_of("train"), rows_of("eval")
  if not train_rows:
    raise ValueError(f"the training data holds no usable rows ({skipped['skipped_empty_text']} with empty text, "
                     f"{skipped['skipped_missing_label']} without a label); check the files and data.*_column")
  if not eval_rows and (config.eval_files or (config.source == "hf" and config.hf_eval_split)):
    raise ValueError(f"the eval data (data.eval_files / data.hf_eval_split) holds no usable rows "
                     f"({skipped['skipped_empty_text']} with empty text, {skipped['skipped_missing_label']} without "
                     "a label in all data); check those files, or leave them empty to hold out data.eval_fraction")
  if not eval_rows:  # hold out a seeded random fraction
    if len(train_rows) < 2:
      raise ValueError("holding out eval rows needs >= 2 training rows; add data or give data.eval_files")
    order = np.random.default_rng(seed).permutation(len(train_rows))
    held_out = min(len(train_rows) - 1, max(1, round(config.eval_fraction * len(train_rows))))
    eval_rows = [train_rows[i] for i in sorted(order[:held_out])]
    train_rows = [train_rows[i] for i in sorted(order[held_out:])]

  for where, row, _, _, label in train_rows:
    if isinstance(label, int) and label < 0:
      raise ValueError(f"train label {label} (row {row} of {where!r}) is negative; class ids must be 0..K-1")
  names = class_names_for([r[4] for r in train_rows], config.labels or tuple(label_feature_names))
  if len(names) < 2:
    raise ValueError(f"the training data holds a single class ({names}); classification needs >= 2 (set "
                     f"data.labels to all class names if some are missing from this data)")
  index = {name: i for i, name in enumerate(names)}
  ids = {split: np.array([_label_id(r[4], names, index, r[0], r[1], split) for r in rows], np.int32)
         for split, rows in (("train", train_rows), ("eval", eval_rows))}
  return LabelledRows(names, [r[:4] for r in train_rows], [r[:4] for r in eval_rows], ids["train"], ids["eval"],
                      skipped)


def build_classification_data(config: DataConfig, tokenizer: tokenizers.Tokenizer, seed: int,
                              vocab_size: int | None = None, max_positions: int = 512) -> ClassificationData:
  """Reads, validates, splits (`read_labelled_rows`) and tokenizes the labelled rows described by `config` (module
  docstring). data.seq_len=0 chooses the length from the training rows' tokenized lengths (`seq_lengths.
  choose_seq_len`, at most `max_positions`)."""
  if vocab_size is not None and tokenizer.get_vocab_size(with_added_tokens=True) > vocab_size:
    raise ValueError(f"the tokenizer has {tokenizer.get_vocab_size(with_added_tokens=True)} tokens but the model's "
                     f"vocabulary holds {vocab_size}; use the tokenizer that came with init_from")
  rows = read_labelled_rows(config, seed)
  pairs_of = lambda split_rows: [r[3] for r in split_rows] if config.text_pair_column else None
  if config.seq_len == 0:
    texts, pairs = [r[2] for r in rows.train], pairs_of(rows.train)
    encode_inputs = list(zip(texts, pairs)) if pairs is not None else texts
    lengths = np.array([len(e.ids) for e in tokenizer.encode_batch(encode_inputs)], np.int64)
    config = dataclasses.replace(config, seq_len=seq_lengths.choose_seq_len(lengths, max_positions))
  splits, full_lengths = {}, []
  for split, split_rows, labels in (("train", rows.train, rows.train_labels), ("eval", rows.eval, rows.eval_labels)):
    examples, lengths = tokenize(tokenizer, [r[2] for r in split_rows], pairs_of(split_rows), config.seq_len)
    examples.labels = labels
    splits[split] = examples
    full_lengths.append(lengths)
  return ClassificationData(rows.class_names, splits["train"], splits["eval"],
                            data_statistics(splits["train"], splits["eval"], np.concatenate(full_lengths),
                                            rows.class_names, config.seq_len, rows.skipped), config.seq_len)


def _is_text(value: Any) -> bool:
  return isinstance(value, str) and bool(value.strip())


def data_statistics(train: Examples, eval_: Examples, full_lengths: np.ndarray, names: list[str], seq_len: int,
                    skipped: dict[str, int]) -> dict[str, Any]:
  """Counts, label distribution per split, token-length percentiles (before truncation) and truncation rate."""
  truncated = int((full_lengths > seq_len).sum())
  stats: dict[str, Any] = {"train_examples": len(train), "eval_examples": len(eval_), **skipped,
                           "num_classes": len(names), "seq_len": seq_len}
  for q in (50, 90, 95, 99):
    stats[f"tokens_p{q}"] = float(np.percentile(full_lengths, q))
  stats["tokens_max"] = int(full_lengths.max())
  stats["truncated_examples"] = truncated
  stats["truncation_rate"] = truncated / max(1, len(full_lengths))
  for split, examples in (("train", train), ("eval", eval_)):
    counts = np.bincount(examples.labels, minlength=len(names))
    stats.update({f"{split}_label/{name}": int(c) for name, c in zip(names, counts)})
  return stats


# ----------------------------------------------------------------------------------------------- batching


def pad_length(longest: int, seq_len: int, batching: str) -> int:
  if batching == "max":
    return seq_len
  return min(seq_len, max(_MIN_PAD, 1 << max(0, int(longest) - 1).bit_length()))


def check_batch_fits(examples: int, global_batch: int) -> None:
  if examples < global_batch:
    raise ValueError(f"the training data holds {examples} examples but one global batch needs {global_batch}; lower "
                     f"train.batch_size or add data")


class ClassificationLoader:
  """An endless, seeded iterator of this process's slice of each global batch; `get_state`/`set_state` resume it.

  Epoch e visits every example once in an order seeded by (seed, e); its last batch is filled up with examples from
  the epoch's start, so every batch is full. The state is {"epoch": e, "batch": i}: the epoch's plan is rebuilt
  from the seed, so resuming needs the same data, batch size, batching and seed."""

  def __init__(self, examples: Examples, global_batch: int, seed: int, batching: str, seq_len: int,
               shuffle: bool = True, process_index: int | None = None, process_count: int | None = None):
    check_batch_fits(len(examples), global_batch)
    self.examples, self.global_batch, self.seed, self.batching = examples, global_batch, seed, batching
    self.seq_len, self.shuffle = seq_len, shuffle
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    self.local = slice(process_index * global_batch // process_count,
                       (process_index + 1) * global_batch // process_count)
    self.epoch, self.batch_index, self._plan = 0, 0, None

  def _epoch_plan(self, epoch: int) -> list[np.ndarray]:
    n, b = len(self.examples), self.global_batch
    rng = np.random.default_rng([self.seed % (2**32), epoch])
    order = rng.permutation(n) if self.shuffle else np.arange(n)
    order = np.concatenate([order, order[: (-n) % b]])  # fill the last batch
    if self.batching == "bucket":
      lengths = self.examples.lengths
      window = b * _BUCKET_WINDOW
      order = np.concatenate([chunk[np.argsort(lengths[chunk], kind="stable")]
                              for chunk in np.split(order, range(window, len(order), window))])
      batches = order.reshape(-1, b)
      return list(batches[rng.permutation(len(batches))] if self.shuffle else batches)
    return list(order.reshape(-1, b))

  def __iter__(self) -> ClassificationLoader:
    return self

  def __next__(self) -> dict[str, np.ndarray]:
    if self._plan is None or self._plan[0] != self.epoch:
      self._plan = (self.epoch, self._epoch_plan(self.epoch))
    indices = self._plan[1][self.batch_index]
    self.batch_index += 1
    if self.batch_index == len(self._plan[1]):
      self.epoch, self.batch_index = self.epoch + 1, 0
    length = pad_length(self.examples.lengths[indices].max(), self.seq_len, self.batching)
    return self.examples.batch(indices[self.local], length)  # one length for the global batch, all processes

  def get_state(self) -> dict[str, int]:
    return {"epoch": int(self.epoch), "batch": int(self.batch_index)}

  def set_state(self, state: dict[str, int]) -> None:
    if set(state) != {"epoch", "batch"}:
      raise ValueError(f"loader state {state} was not written by ClassificationLoader (another data pipeline?)")
    self.epoch, self.batch_index = int(state["epoch"]), int(state["batch"])


def eval_batches(examples: Examples, global_batch: int, seq_len: int, batching: str,
                 process_index: int | None = None, process_count: int | None = None) -> list[dict[str, np.ndarray]]:
  """Every eval example once, in length order (least padding), as this process's slices of global batches; the
  last batch is filled with weight-0 copies of example 0. Row k of the concatenated global batches is example
  `order[k]`; `eval_order` returns that order."""
  process_index = jax.process_index() if process_index is None else process_index
  process_count = jax.process_count() if process_count is None else process_count
  local = slice(process_index * global_batch // process_count, (process_index + 1) * global_batch // process_count)
  order = eval_order(examples)
  filler = (-len(order)) % global_batch
  padded = np.concatenate([order, np.zeros(filler, np.int64)])
  weights = np.concatenate([np.ones(len(order)), np.zeros(filler)])
  batches = []
  for start in range(0, len(padded), global_batch):
    indices, w = padded[start:start + global_batch], weights[start:start + global_batch]
    length = pad_length(examples.lengths[indices].max(), seq_len, batching)
    batches.append(examples.batch(indices[local], length, w[local]))
  return batches


def eval_order(examples: Examples) -> np.ndarray:
  return np.argsort(examples.lengths, kind="stable")
