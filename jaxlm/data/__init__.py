"""The data pipeline: documents -> tokenizer workers -> token shards on disk -> windows -> step-keyed batches.

  datasets = build_datasets(config.data, config.model.vocab_size, workdir, seed=config.train.seed)
  train_iter = make_pretraining_batches(datasets, batch_size_per_process, seed, config.data.shuffle)
  batch = next(train_iter)  # inputs, targets, segment_ids, positions: int32 [B, T]; loss_mask: float32 [B, T]
  state = get_loader_state(train_iter)  # JSON dict stored with the checkpoint; set_loader_state restores it

Pretraining reads prepared corpora (jaxlm/data/corpora/prepare.py, shards.py): `data.source=prepared` names them, and
`demo`, `files` and `hf` are prepared once into the shared cache (corpora/corpus_cache.py). The run keeps its
tokenizer as `<workdir>/tokenizer.json`, so a resumed run, the evaluation scripts and generation read the same
vocabulary. Fine-tuning sets (tuning/) stay in memory as packed rows (packing.py) behind the grain iterator of
corpora/loader.py.

Two flows, a sub-package each: corpora/ (pretraining: sources, prepare, shards, cache, mixture, loader) and tuning/
(fine-tuning rows: classification, instructions, conversations, preferences, RL prompts, chat templates). The modules
at this level (files, tokenizer, packing) serve both; tuning may import corpora, never the reverse.
"""

from __future__ import annotations

import importlib
from typing import Any

# Where each name lives. The package loads a module on first use rather than on import: the tokenizer worker
# processes import jaxlm.data.corpora.prepare, and importing JAX and grain there would cost each worker seconds and
# hundreds of MB.
_MODULES = {
    "Datasets": "corpora.datasets", "build_datasets": "corpora.datasets", "corpus_folders": "corpora.datasets",
    "make_pretraining_batches": "corpora.datasets",
    "eval_batches": "corpora.loader", "get_loader_state": "corpora.loader", "make_train_iterator": "corpora.loader",
    "set_loader_state": "corpora.loader",
    "PretrainingBatches": "corpora.mixture", "PackedSequences": "packing", "TokenWindows": "corpora.shards",
    "read_manifest": "corpora.shards", "read_documents": "corpora.sources", "stream_documents": "corpora.sources",
    "eos_id": "tokenizer", "get_tokenizer": "tokenizer", "load_tokenizer": "tokenizer",
    "save_tokenizer": "tokenizer", "train_bpe": "tokenizer",
}
__all__ = sorted(_MODULES)


def __getattr__(name: str) -> Any:
  if name not in _MODULES:
    raise AttributeError(f"module 'jaxlm.data' has no attribute {name!r}")
  value = getattr(importlib.import_module(f"jaxlm.data.{_MODULES[name]}"), name)
  globals()[name] = value
  return value
