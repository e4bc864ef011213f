"""Where documents come from, streamed: the embedded demo corpus, local files, or an HF dataset.

`stream_documents(config, split)` returns a `DocumentStream`: iterating it yields non-empty strings in a
deterministic order, one at a time (nothing holds the corpus), and its `stats` count what was read (`documents`,
`bytes`, `skipped_documents`) so that a pipeline that silently read nothing is visible. `read_documents` collects a
stream into a list, for data sets that fit in memory.

Sources (`data.source`):
  demo   the Python standard library's own `.py` files, one document per file; needs no network.
  files  `data.train_files` / `data.eval_files`, read by jaxlm/data/files.py: `.txt` (each non-empty line is a
         document, split as str.splitlines), `.jsonl` (the `data.text_column` of each line's object), `.json` (JSON
         lines, or one array of objects) and `.parquet`; `.txt`, `.jsonl` and `.json` may be compressed (`.gz`,
         `.zst`, `.bz2`, `.lz4`).
  hf     an HF dataset: a folder written by `Dataset.save_to_disk` (memory-mapped), else
         `datasets.load_dataset(data.hf_name, data.hf_config, split=data.hf_split, streaming=True)`: a hub name or a
         local folder of data files, read without writing an Arrow copy.

Caps: `data.max_documents` and `data.max_bytes` (UTF-8 bytes of document text; 0 = no cap). The document that
crosses the byte cap is cut so the cap holds exactly; when a cap cuts the data the console says how much was read.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Iterator
from typing import Any

from jaxlm.config import DataConfig
from jaxlm.data.files import ROWS_PER_READ, check_columns, check_files, iter_files

# Standard-library folders that are tests, GUIs or vendored code rather than representative library source.
_DEMO_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "__pycache__",
                             "lib2to3", "turtledemo", "tkinter", "ensurepip", "config-3", "lib-dynload"})


class DocumentStream:
  """An iterable of documents (non-empty str) with running counts; caps applied in reading order."""

  def __init__(self, texts: Iterable[Any], max_documents: int = 0, max_bytes: int = 0, total_bytes: int = 0,
               where: str = "the data"):
    self._texts, self._max_documents, self._max_bytes = texts, max_documents, max_bytes
    self.total_bytes = total_bytes  # size of the inputs on disk when known (0 = unknown), for the cap message
    self.where = where
    self.stats = {"documents": 0, "bytes": 0, "skipped_documents": 0}
    self.capped = ""  # which cap cut the data, once one did

  def __iter__(self) -> Iterator[str]:
    stats, max_bytes = self.stats, self._max_bytes
    for text in self._texts:
      if not isinstance(text, str) or not text.strip():
        stats["skipped_documents"] += 1
        continue
      size = len(text.encode("utf-8"))
      if max_bytes and stats["bytes"] + size > max_bytes:
        # Cut at a byte boundary and drop a split multi-byte character, so the cap holds exactly.
        text = text.encode("utf-8")[: max_bytes - stats["bytes"]].decode("utf-8", errors="ignore")
        size = len(text.encode("utf-8"))
        if text.strip():
          stats["documents"] += 1
          stats["bytes"] += size
          yield text
        self._cut("data.max_bytes", max_bytes)
        return
      stats["documents"] += 1
      stats["bytes"] += size
      yield text
      if self._max_documents and stats["documents"] >= self._max_documents:
        self._cut("data.max_documents", self._max_documents)
        return
      if max_bytes and stats["bytes"] >= max_bytes:
        self._cut("data.max_bytes", max_bytes)
        return

  def _cut(self, key: str, value: int) -> None:
    of = f" of {self.total_bytes:,} bytes on disk" if self.total_bytes else ""
    self.capped = f"{key}={value:,}"
    print(f"{key}={value:,} cut {self.where}: read {self.stats['documents']:,} documents, "
          f"{self.stats['bytes']:,} bytes of text{of}; set {key}=0 to read everything")


def stream_documents(config: DataConfig, split: str) -> DocumentStream:
  """The documents of `split` ("train" or "eval"; "eval" needs `data.eval_files`), streamed with the caps."""
  if split not in ("train", "eval"):
    raise ValueError(f"split={split!r} is not one of train, eval")
  if split == "eval" and not config.eval_files:
    raise ValueError("split='eval' needs data.eval_files; without them hold out data.eval_fraction of train")
  if split == "eval":
    paths = check_files(config.eval_files)
    texts, size, where = iter_files(paths, config.text_column), _disk_bytes(paths), "data.eval_files"
  elif config.source == "demo":
    paths = demo_files()
    texts, size, where = _iter_demo(paths), _disk_bytes(paths), "the demo corpus"
  elif config.source == "files":
    if not config.train_files:
      raise ValueError("data.source=files needs data.train_files (comma-separated paths)")
    paths = check_files(config.train_files)
    texts, size, where = iter_files(paths, config.text_column), _disk_bytes(paths), "data.train_files"
  elif config.source == "hf":
    if not config.hf_name:
      raise ValueError("data.source=hf needs data.hf_name (a dataset name or a local folder)")
    texts, size, where = iter_hf(config.hf_name, config.hf_config, config.hf_split, config.text_column), 0, \
        f"data.hf_name={config.hf_name}"
  else:
    raise ValueError(f"data.source={config.source!r} is not one of demo, files, hf, prepared")
  return DocumentStream(texts, config.max_documents, config.max_bytes, size, where)


def read_documents(config: DataConfig, split: str) -> tuple[list[str], dict[str, int]]:
  """`stream_documents` collected into a list: for data sets that fit in memory (fine-tuning, samples)."""
  stream = stream_documents(config, split)
  documents = list(stream)
  return documents, dict(stream.stats)


def demo_files() -> list[str]:
  """The standard library's `.py` files in a deterministic (sorted walk) order."""
  root = sysconfig.get_paths()["stdlib"]
  paths = []
  for folder, dirs, files in os.walk(root):
    dirs[:] = sorted(d for d in dirs if d not in _DEMO_SKIP_DIRS and not d.startswith(("config-", ".")))
    paths.extend(os.path.join(folder, f) for f in sorted(files) if f.endswith(".py"))
  if not paths:
    raise FileNotFoundError(f"no .py files under the standard library folder {root}; use data.source=files")
  return paths


def demo_texts() -> list[str]:
  """The demo corpus's documents, those that are not UTF-8 left out (benchmarks build larger corpora from them)."""
  return [text for text in _iter_demo(demo_files()) if text is not None]


def _iter_demo(paths: list[str]) -> Iterator[Any]:
  for path in paths:
    with open(path, "rb") as f:
      raw = f.read()
    try:
      yield raw.decode("utf-8")
    except UnicodeDecodeError:
      yield None  # counted as a skipped document


def _disk_bytes(paths: Iterable[str]) -> int:
  return sum(os.path.getsize(p) for p in paths)


def iter_hf(name: str, config_name: str, split: str, text_column: str) -> Iterator[Any]:
  """The text column of an HF dataset, streamed (see the module docstring)."""
  dataset = open_hf(name, config_name, split)
  yield from (row[text_column] for row in iter_hf_rows(dataset, {text_column: "data.text_column"}, name))


def open_hf(name: str, config_name: str, split: str, setting: str = "data.hf_split") -> Any:
  """The `split` of an HF dataset: a `datasets.Dataset` (memory-mapped) for a folder written by `save_to_disk`, else
  a `datasets.IterableDataset` streamed by `load_dataset`; `setting` names the split in errors."""
  import datasets

  saved_to_disk = any(os.path.isfile(os.path.join(name, f)) for f in ("state.json", "dataset_dict.json"))
  if not saved_to_disk:
    return datasets.load_dataset(name, config_name or None, split=split, streaming=True)
  dataset = datasets.load_from_disk(name)
  if isinstance(dataset, datasets.DatasetDict):
    if split not in dataset:
      raise ValueError(f"{setting}={split!r} is not in {name!r}; splits: {', '.join(dataset)}")
    dataset = dataset[split]
  return dataset


def iter_hf_rows(dataset: Any, columns: dict[str, str], where: str,
                 every_column: bool = False) -> Iterator[dict[str, Any]]:
  """The rows of an `open_hf` dataset, each a dict of `columns` (of every column with `every_column`), as
  `iter_rows`."""
  import datasets

  names = dataset.column_names  # None for a streamed dataset that does not know them: checked on its first row
  if names is not None:
    check_columns(list(names), columns, where)
  if isinstance(dataset, datasets.Dataset):
    for batch in (dataset if every_column else dataset.select_columns(list(columns))).iter(batch_size=ROWS_PER_READ):
      yield from (dict(zip(batch, values)) for values in zip(*batch.values()))
    return
  for row in dataset:
    if names is None:
      names = list(row)
      check_columns(names, columns, where)
    yield {**{column: row.get(column) for column in columns}, **(row if every_column else {})}
