"""The shared cache of prepared corpora: `data.source=demo|files|hf` is prepared once and trained from shards.

Each entry is a prepared folder (prepare.py) named by a hash of (the inputs, the tokenizer, the split): the files' paths, sizes and modification times (or the dataset's name, config and split), the text column, the caps,
the eval fraction or eval files, and the tokenizer's bytes. Every run on the same data and tokenizer, in any workdir,
reads the same shards; a changed input file gets a new entry. The cache is `data.cache_dir`, else
$JAXLM_DATA_CACHE, else ~/.cache/jaxlm/corpora. A file lock lets one process prepare while the others (the other
processes of a job, or other runs) wait for it; an interrupted prepare resumes in place.

Without `data.tokenizer` (and no tokenizer.json in the workdir), a byte-level BPE of `model.vocab_size` is trained on
the train documents once and kept in the cache beside the corpora (`bpe-<hash>/tokenizer.json`).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

from jaxlm.config import DataConfig
from jaxlm.data import files
from jaxlm.data import tokenizer as tokenizer_lib
from jaxlm.data.corpora import prepare, sources

_CACHE_VERSION = 1  # bump when what a key covers changes


def cache_root(config: DataConfig) -> str:
  return config.cache_dir or os.environ.get("JAXLM_DATA_CACHE") or os.path.join(
      os.path.expanduser("~"), ".cache", "jaxlm", "corpora")


def prepared_folder(config: DataConfig, vocab_size: int, workdir: str | None, progress: bool = True) -> str:
  """The prepared folder for `config`'s documents and tokenizer, preparing it first if the cache lacks it."""
  root = cache_root(config)
  os.makedirs(root, exist_ok=True)
  inputs = describe_inputs(config)
  tokenizer_json = _tokenizer_json(config, vocab_size, workdir, inputs, root, progress)
  key = _key({"inputs": inputs, "tokenizer": hashlib.sha256(tokenizer_json.encode()).hexdigest()})
  folder = os.path.join(root, f"corpus-{key}")
  if os.path.isfile(os.path.join(folder, prepare.MANIFEST)):
    return folder
  with _locked(folder + ".lock"):
    if os.path.isfile(os.path.join(folder, prepare.MANIFEST)):  # another process prepared it while we waited
      return folder
    print(f"preparing {inputs['source']} data into the shared cache {folder}")
    tokenizer = tokenizer_lib.tokenizer_from_json(tokenizer_json)
    train = sources.stream_documents(config, "train")
    held = sources.stream_documents(config, "eval") if config.eval_files else None
    prepare.prepare(train, folder, tokenizer_json, tokenizer_lib.eos_id(tokenizer),
                    tokenizer.get_vocab_size(with_added_tokens=True), eval_documents=held,
                    eval_fraction=0.0 if held is not None else config.eval_fraction, workers=config.workers,
                    inputs=inputs, read_stats=train, progress=progress)
  return folder


def describe_inputs(config: DataConfig) -> dict[str, Any]:
  """What identifies the documents of `config`: a changed file or option gives another cache entry."""
  stat = lambda paths: [{"path": os.path.abspath(p), "size": os.path.getsize(p), "mtime_ns": os.stat(p).st_mtime_ns}
                         for p in files.check_files(paths)]
  described: dict[str, Any] = {"source": config.source, "max_documents": config.max_documents,
                               "max_bytes": config.max_bytes, "version": _CACHE_VERSION}
  if config.source == "demo":
    paths = sources.demo_files()
    described.update(python=sys.version, files=len(paths), size=sum(os.path.getsize(p) for p in paths),
                     root=os.path.dirname(paths[0]))
  elif config.source == "files":
    if not config.train_files:
      raise ValueError("data.source=files needs data.train_files (comma-separated paths)")
    described.update(train_files=stat(config.train_files), text_column=config.text_column)
  elif config.source == "hf":
    if not config.hf_name:
      raise ValueError("data.source=hf needs data.hf_name (a dataset name or a local folder)")
    local = os.path.exists(config.hf_name)
    described.update(hf_name=os.path.abspath(config.hf_name) if local else config.hf_name,
                     hf_config=config.hf_config, hf_split=config.hf_split, text_column=config.text_column,
                     mtime_ns=os.stat(config.hf_name).st_mtime_ns if local else 0)
  else:
    raise ValueError(f"data.source={config.source!r} is not one of demo, files, hf, prepared")
  if config.eval_files:
    described.update(eval_files=stat(config.eval_files), text_column=config.text_column)
  else:
    described.update(eval_fraction=config.eval_fraction)
  return described


def _tokenizer_json(config: DataConfig, vocab_size: int, workdir: str | None, inputs: dict[str, Any], root: str,
                    progress: bool) -> str:
  in_workdir = None if workdir is None else os.path.join(workdir, tokenizer_lib.TOKENIZER_FILE)
  if config.tokenizer or (in_workdir and os.path.isfile(in_workdir)):
    tokenizer = tokenizer_lib.get_tokenizer(config, [], vocab_size, workdir)
    return tokenizer.to_str()
  # A new byte-level BPE on the train documents, trained once per (inputs, vocabulary) and kept in the cache.
  folder = os.path.join(root, f"bpe-{_key({'inputs': inputs, 'vocab_size': vocab_size})}")
  path = os.path.join(folder, tokenizer_lib.TOKENIZER_FILE)
  if not os.path.isfile(path):
    with _locked(folder + ".lock"):
      if not os.path.isfile(path):
        if progress:
          print(f"training a byte-level BPE of {vocab_size} tokens on the train documents into {folder}")
        stream = sources.stream_documents(config, "train")
        fraction = 0.0 if config.eval_files else config.eval_fraction
        texts = (t for i, t in enumerate(stream) if not prepare.held_out(i, fraction))
        tokenizer_lib.train_bpe(texts, vocab_size, path)
  with open(path, encoding="utf-8") as f:
    return f.read()


def _key(value: dict[str, Any]) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:20]


@contextlib.contextmanager
def _locked(path: str) -> Iterator[None]:
  with open(path, "a+") as handle:
    fcntl.flock(handle, fcntl.LOCK_EX)  # blocks while another process prepares the same entry
    try:
      yield
    finally:
      fcntl.flock(handle, fcntl.LOCK_UN)
