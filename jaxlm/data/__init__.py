"""The data pipeline: documents -> tokenizer workers -> token shards on disk -> windows -> step-keyed batches.

  datasets = build_datasets(config.data, config.model.vocab_size, workdir, seed=config.train.seed)
  train_iter = make_pretraining_batches(datasets, batch_size_per_process, seed, config.data.shuffle)
  batch = next(train_iter)  # inputs, targets, segment_ids, positions: int32 [B, T]; loss_mask: float32 [B, T]
  state = get_loader_state(train_iter)  # JSON dict stored with the checkpoint; set_loader_state restores it

Pretraining reads prepared corpora (jaxlm/data/prepare.py, shards.py): `data.source=prepared` names them, and
`demo`, `files` and `hf` are prepared once into the shared cache (corpus_cache.py). The run keeps its tokenizer as
`<workdir>/tokenizer.json`, so a resumed run, the evaluation scripts and generation read the same vocabulary.
Fine-tuning sets stay in memory as packed rows (packing.py) behind the grain iterator of loader.py.
"""

from __future__ import annotations

import importlib
from typing import Any

# Where each name lives. The package loads a module on first use rather than on import: the tokenizer worker
# processes import jaxlm.data.prepare, and importing JAX and grain there would cost each worker seconds and
# hundreds of MB.
_MODULES = {
    "Datasets": "corpora", "build_datasets": "corpora", "corpus_folders": "corpora",
    "make_pretraining_batches": "corpora",
    "eval_batches": "loader", "get_loader_state": "loader", "make_train_iterator": "loader",
    "set_loader_state": "loader",
    "PretrainingBatches": "mixture", "PackedSequences": "packing", "TokenWindows": "shards",
    "read_manifest": "shards", "read_documents": "sources", "stream_documents": "sources",
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
