"""The data pipeline: documents -> tokenizer -> packed rows -> sharded, resumable batches.

  datasets = build_datasets(config.data, config.model.vocab_size, workdir, seed=config.train.seed)
  train_iter = make_train_iterator(datasets.train, batch_size_per_process, seed, config.data.shuffle)
  batch = next(train_iter)  # inputs, targets, segment_ids, positions: int32 [B, T]; loss_mask: float32 [B, T]
  state = get_loader_state(train_iter)  # JSON dict stored with the checkpoint; set_loader_state restores it

Everything a run derives from its data is kept in the workdir: `tokenizer.json` (so a resumed run tokenizes
identically) and `data_cache/packed-<hash>/` (so it does not tokenize again).
"""

from __future__ import annotations

import dataclasses
import os

import tokenizers

from jaxlm.config import DataConfig
from jaxlm.data.loader import eval_batches, get_loader_state, make_train_iterator, set_loader_state
from jaxlm.data.packing import PackedSequences, build_packed
from jaxlm.data.sources import read_documents
from jaxlm.data.tokenizer import eos_id, get_tokenizer, load_tokenizer, train_bpe

__all__ = [
    "Datasets", "PackedSequences", "build_datasets", "eos_id", "eval_batches", "get_loader_state",
    "get_tokenizer", "load_tokenizer", "make_train_iterator", "read_documents", "set_loader_state", "train_bpe",
]

CACHE_FOLDER = "data_cache"


@dataclasses.dataclass
class Datasets:
  tokenizer: tokenizers.Tokenizer
  eos_id: int
  train: PackedSequences
  eval: PackedSequences
  stats: dict[str, float]  # flat numbers, logged at startup so an empty or mostly-padding pipeline is visible


def build_datasets(config: DataConfig, vocab_size: int, workdir: str | None, seed: int) -> Datasets:
  """Reads, tokenizes and packs the train and eval data described by `config`.

  Without `data.eval_files`, the last max(1, round(eval_fraction * n)) documents are held out for eval (the split
  is by reading order, so it is the same in every process and every resumed run). `seed` is accepted so that
  future sources that sample documents stay reproducible; the current ones are deterministic without it.
  """
  del seed  # reading, tokenizing and packing are deterministic; only the train iterator shuffles
  hf_cache = None if workdir is None else os.path.join(workdir, CACHE_FOLDER, "hf")  # keeps datasets' cache inside
  documents, read_stats = read_documents(config, "train", hf_cache)
  if not documents:
    raise ValueError(f"data.source={config.source} produced no documents ({read_stats['skipped_documents']} "
                     f"skipped as empty or non-text); check the files, data.text_column and data.max_documents")
  if config.eval_files:
    train_documents = documents
    eval_documents, eval_read_stats = read_documents(config, "eval", hf_cache)
    if not eval_documents:
      raise ValueError(f"data.eval_files produced no documents ({eval_read_stats['skipped_documents']} skipped); "
                       f"check the files and data.text_column")
  else:
    if len(documents) < 2:
      raise ValueError(f"data.source={config.source} produced 1 document; holding one out for eval needs >= 2; "
                       f"add data or give data.eval_files")
    held_out = min(len(documents) - 1, max(1, round(config.eval_fraction * len(documents))))
    train_documents, eval_documents = documents[:-held_out], documents[-held_out:]
    eval_read_stats = {"documents": 0, "bytes": 0, "skipped_documents": 0}

  tokenizer = get_tokenizer(config, train_documents, vocab_size, workdir)  # trained on train documents only
  cache_dir = None if workdir is None else os.path.join(workdir, CACHE_FOLDER)
  train = build_packed(config, tokenizer, train_documents, cache_dir)
  eval_ = build_packed(config, tokenizer, eval_documents, cache_dir)
  if len(train) == 0:
    raise ValueError(f"no train sequences from {len(train_documents)} documents; add data or check data.source")

  stats = {
      "documents": read_stats["documents"] + eval_read_stats["documents"],
      "bytes": read_stats["bytes"] + eval_read_stats["bytes"],
      "skipped_documents": read_stats["skipped_documents"] + eval_read_stats["skipped_documents"],
      "train_documents": len(train_documents),
      "eval_documents": len(eval_documents),
      "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True),
      "seq_len": config.seq_len,
      "train_sequences": len(train),
      "eval_sequences": len(eval_),
      "train_tokens": train.num_tokens,
      "eval_tokens": eval_.num_tokens,
      "train_padding_fraction": train.num_padding / max(1, len(train) * config.seq_len),
  }
  return Datasets(tokenizer=tokenizer, eos_id=eos_id(tokenizer), train=train, eval=eval_, stats=stats)
