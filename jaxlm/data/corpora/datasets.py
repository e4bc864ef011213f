"""The corpora a pretraining run reads: prepared folders (from data.source=prepared, or prepared into the shared
cache from demo, files or hf), their train windows, held-out windows and mixture weights, and the step-keyed batches
over them (see jaxlm/data/__init__.py for the pipeline)."""

from __future__ import annotations

import dataclasses
import os

import jax
import tokenizers

from jaxlm.config import DataConfig
from jaxlm.data.corpora import corpus_cache
from jaxlm.data.corpora.mixture import PretrainingBatches
from jaxlm.data.corpora.shards import TokenWindows, read_manifest
from jaxlm.data.tokenizer import load_tokenizer, save_tokenizer


@dataclasses.dataclass
class Datasets:
  tokenizer: tokenizers.Tokenizer | None  # None for a corpus another tool tokenized without a tokenizer.json
  eos_id: int
  train: list[TokenWindows]  # one per corpus of the mixture
  weights: list[float]  # the mixture's weights in tokens, one per corpus
  eval: TokenWindows  # the held-out windows of every corpus
  folders: list[str]  # the prepared folders
  stats: dict[str, float | str]  # flat, logged at startup and in report.md's data table


def build_datasets(config: DataConfig, vocab_size: int, workdir: str | None, seed: int) -> Datasets:
  """The prepared corpora of `config` (preparing `demo`, `files` or `hf` data into the shared cache first)."""
  del seed  # the corpora are fixed; only the batches depend on the seed
  folders, weights = corpus_folders(config, vocab_size, workdir)
  manifests = [read_manifest(f) for f in folders]
  hashes = {m.get("tokenizer_sha256") for m in manifests}
  if len(hashes) > 1:
    raise ValueError(f"the corpora in data.mixture were tokenized by different tokenizers; prepare them all with "
                     f"one --tokenizer ({', '.join(folders)})")
  corpus_vocab = max(m["vocab_size"] for m in manifests)
  if corpus_vocab > vocab_size:
    raise ValueError(f"the corpus in {folders[0]!r} has token ids up to {corpus_vocab - 1} but "
                     f"model.vocab_size={vocab_size}; set model.vocab_size >= {corpus_vocab}")
  tokenizer = None
  path = os.path.join(folders[0], manifests[0].get("tokenizer") or "tokenizer.json")
  if os.path.isfile(path):
    tokenizer = load_tokenizer(path)
    if workdir is not None:  # the run's own copy, for resuming, evaluation and generation
      save_tokenizer(tokenizer, os.path.join(workdir, "tokenizer.json"))
  train = [TokenWindows(f, "train", config.seq_len) for f in folders]
  eval_ = TokenWindows(folders, "eval", config.seq_len)
  if len(eval_) == 0:
    raise ValueError(f"the held-out split of {', '.join(folders)} has no window of data.seq_len + 1 = "
                     f"{config.seq_len + 1} tokens ({eval_.corpus_tokens} tokens); raise data.eval_fraction, give "
                     f"data.eval_files (prepare_data.py --eval_input) or lower data.seq_len")
  read = lambda key: sum(m.get("read", {}).get(key, 0) for m in manifests)
  stats: dict[str, float | str] = {
      "prepared": ", ".join(folders),
      "documents": sum(m["documents"] for m in manifests),
      "bytes": sum(m.get("bytes", 0) for m in manifests),
      "skipped_documents": read("skipped_documents"),
      "train_documents": sum(t.documents for t in train),
      "eval_documents": eval_.documents,
      "vocab_size": corpus_vocab,
      "seq_len": config.seq_len,
      "train_tokens": sum(t.corpus_tokens for t in train),
      "eval_tokens": eval_.corpus_tokens,
      "train_windows": sum(len(t) for t in train),
      "eval_windows": len(eval_),
  }
  capped = [m["capped"] for m in manifests if m.get("capped")]
  if capped:
    stats["capped_by"] = ", ".join(capped)
  if len(folders) > 1:
    stats["mixture"] = ", ".join(f"{os.path.basename(f.rstrip(os.sep))}={w:.4g}" for f, w in zip(folders, weights))
  eos = manifests[0]["eos_id"]
  return Datasets(tokenizer=tokenizer, eos_id=eos, train=train, weights=weights, eval=eval_, folders=folders,
                  stats=stats)


def corpus_folders(config: DataConfig, vocab_size: int, workdir: str | None) -> tuple[list[str], list[float]]:
  """The prepared folders of a run and their mixture weights."""
  if config.source != "prepared":
    return [corpus_cache.prepared_folder(config, vocab_size, workdir)], [1.0]
  if not config.mixture:
    return [config.prepared], [1.0]
  folders, weights = [], []
  for entry in config.mixture.split(","):
    folder, _, weight = entry.strip().rpartition("=")
    try:
      weights.append(float(weight))
    except ValueError:
      folder = ""
    if not folder:
      raise ValueError(f"data.mixture entry {entry!r} is not folder=weight; give data.mixture=a=0.7,b=0.3")
    folders.append(folder)
  return folders, weights


def make_pretraining_batches(datasets: Datasets, batch_size_per_process: int, seed: int, shuffle: bool = True,
                             process_index: int | None = None, process_count: int | None = None
                             ) -> PretrainingBatches:
  """The endless, step-keyed train batches of this process (see jaxlm/data/corpora/mixture.py)."""
  return PretrainingBatches(
      datasets.train, datasets.weights, batch_size_per_process, seed, shuffle,
      jax.process_index() if process_index is None else process_index,
      jax.process_count() if process_count is None else process_count)
