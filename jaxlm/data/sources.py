"""Where documents come from: the embedded demo corpus, local files, or an HF dataset.

`read_documents(config, split)` returns `(documents, stats)`: a list of non-empty strings in a deterministic order
and flat counts (`documents`, `bytes`, `skipped_documents`) so that a pipeline that silently read nothing is visible.

Sources (`data.source`):
  demo   the Python standard library's own `.py` files, one document per file; needs no network.
  files  `data.train_files` / `data.eval_files`: `.txt` (each non-empty line is a document, like the HF `datasets`
         "text" builder), `.jsonl`/`.json` and `.parquet` (the `data.text_column` of each row is a document).
  hf     `datasets.load_dataset(data.hf_name, data.hf_config, split=data.hf_split)`; `hf_name` may be a hub name,
         a local folder of data files, or a folder written by `Dataset.save_to_disk`.

Caps: `data.max_documents` and `data.max_bytes` (UTF-8 bytes; 0 = no cap). The document that crosses the byte cap
is truncated so the cap holds exactly.
"""

from __future__ import annotations

import os
import sysconfig
from collections.abc import Iterable, Iterator
from typing import Any

from jaxlm.config import DataConfig

# Standard-library folders that are tests, GUIs or vendored code rather than representative library source.
_DEMO_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "__pycache__",
                             "lib2to3", "turtledemo", "tkinter", "ensurepip", "config-3", "lib-dynload"})
_LOADER_BY_SUFFIX = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_ROWS_PER_READ = 1024  # rows pulled per Arrow batch when iterating a datasets.Dataset column
_SNIFF_BYTES = 65536  # leading bytes searched for a NUL, the mark of a binary file


def read_documents(config: DataConfig, split: str, cache_dir: str | None = None) -> tuple[list[str], dict[str, int]]:
  """Reads the documents of `split` ("train" or "eval"; "eval" needs `data.eval_files`).

  `cache_dir` is where `datasets` writes its Arrow cache (JSONL, Parquet, HF sources); training passes a folder
  inside the workdir so that a run writes nothing outside it. None = the `datasets` default (~/.cache).
  """
  if split not in ("train", "eval"):
    raise ValueError(f"split={split!r} is not one of train, eval")
  if split == "eval" and not config.eval_files:
    raise ValueError("split='eval' needs data.eval_files; without them hold out data.eval_fraction of train")
  if split == "eval":
    texts = _iter_files(config.eval_files, config.text_column, cache_dir)
  elif config.source == "demo":
    texts = _iter_demo()
  elif config.source == "files":
    if not config.train_files:
      raise ValueError("data.source=files needs data.train_files (comma-separated paths)")
    texts = _iter_files(config.train_files, config.text_column, cache_dir)
  elif config.source == "hf":
    if not config.hf_name:
      raise ValueError("data.source=hf needs data.hf_name (a dataset name or a local folder)")
    texts = _iter_hf(config, cache_dir)
  else:
    raise ValueError(f"data.source={config.source!r} is not one of demo, files, hf")
  return _collect(texts, config.max_documents, config.max_bytes)


def _collect(texts: Iterable[Any], max_documents: int, max_bytes: int) -> tuple[list[str], dict[str, int]]:
  # Filters empty and non-string values (counted, never silent) and applies the caps in reading order.
  documents: list[str] = []
  total_bytes = skipped = 0
  for text in texts:
    if not isinstance(text, str) or not text.strip():
      skipped += 1
      continue
    size = len(text.encode("utf-8"))
    if max_bytes and total_bytes + size > max_bytes:
      # Cut at a byte boundary and drop a split multi-byte character, so the cap holds exactly.
      text = text.encode("utf-8")[: max_bytes - total_bytes].decode("utf-8", errors="ignore")
      size = len(text.encode("utf-8"))
      if text.strip():
        documents.append(text)
        total_bytes += size
      break
    documents.append(text)
    total_bytes += size
    if (max_documents and len(documents) >= max_documents) or (max_bytes and total_bytes >= max_bytes):
      break
  stats = {"documents": len(documents), "bytes": total_bytes, "skipped_documents": skipped}
  return documents, stats


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


def _iter_demo() -> Iterator[Any]:
  for path in demo_files():
    with open(path, "rb") as f:
      raw = f.read()
    try:
      yield raw.decode("utf-8")
    except UnicodeDecodeError:
      yield None  # counted as a skipped document by _collect


def _iter_files(paths: Iterable[str], text_column: str, cache_dir: str | None = None) -> Iterator[Any]:
  paths = list(paths)
  for path in paths:  # check all paths first so a typo in the last file fails before minutes of reading
    if not os.path.isfile(path):
      raise FileNotFoundError(f"data file {path!r} does not exist; fix data.train_files / data.eval_files")
    if os.path.getsize(path) == 0:
      raise ValueError(f"data file {path!r} is empty; remove it from data.train_files / data.eval_files")
  for path in paths:
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".txt":
      # Same split as the HF "text" builder (str.splitlines); empty lines become skipped documents.
      with open(path, "rb") as f:
        yield from _decode_text(f.read(), path).splitlines()
    elif suffix in _LOADER_BY_SUFFIX:
      import datasets  # imported lazily: it is slow to import and only these sources need it

      if suffix != ".parquet":
        with open(path, "rb") as f:
          _check_not_binary(f.read(_SNIFF_BYTES), path)
      try:
        dataset = datasets.load_dataset(_LOADER_BY_SUFFIX[suffix], data_files=[path], split="train",
                                        cache_dir=cache_dir)
      except Exception as e:  # noqa: BLE001 (pyarrow, json and datasets each raise their own types)
        cause = e.__cause__ or e
        detail = (str(cause).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"data file {path!r} could not be read as {suffix[1:]} ({type(cause).__name__}: "
                         f"{detail}); fix the file or remove it from the data files") from e
      try:
        yield from _iter_column(dataset, text_column, path)
      except UnicodeDecodeError as e:  # Arrow keeps the bytes; decoding fails only when a value is read
        raise ValueError(f"data file {path!r} is not UTF-8 (a value holds byte 0x{e.object[e.start]:02x}); "
                         f"re-encode it, e.g. iconv -f latin1 -t utf-8") from None
    else:
      raise ValueError(f"data file {path!r} has unsupported suffix {suffix!r}; use .txt, .jsonl, .json or .parquet")


def _check_not_binary(head: bytes, path: str) -> None:
  nul = head.find(b"\0")
  if nul != -1:
    raise ValueError(f"data file {path!r} looks binary (a NUL byte at offset {nul}); give UTF-8 text "
                     f"(.txt, .jsonl) or .parquet")


def _decode_text(raw: bytes, path: str) -> str:
  _check_not_binary(raw[:_SNIFF_BYTES], path)
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise ValueError(f"data file {path!r} is not UTF-8 (byte 0x{raw[e.start]:02x} at offset {e.start}); "
                     f"re-encode it, e.g. iconv -f latin1 -t utf-8") from None


def _iter_hf(config: DataConfig, cache_dir: str | None = None) -> Iterator[Any]:
  import datasets

  name = config.hf_name
  saved_to_disk = any(os.path.isfile(os.path.join(name, f)) for f in ("state.json", "dataset_dict.json"))
  if saved_to_disk:  # a folder written by Dataset.save_to_disk / DatasetDict.save_to_disk
    dataset = datasets.load_from_disk(name)
    if isinstance(dataset, datasets.DatasetDict):
      if config.hf_split not in dataset:
        raise ValueError(f"data.hf_split={config.hf_split!r} is not in {name!r}; splits: {', '.join(dataset)}")
      dataset = dataset[config.hf_split]
  else:
    dataset = datasets.load_dataset(name, config.hf_config or None, split=config.hf_split, cache_dir=cache_dir)
  yield from _iter_column(dataset, config.text_column, name)


def _iter_column(dataset: Any, column: str, where: str) -> Iterator[Any]:
  if column not in dataset.column_names:
    raise ValueError(f"column {column!r} not found in {where!r}; columns are {dataset.column_names}; "
                     f"set data.text_column")
  # Iterating one column in Arrow batches is far faster than dataset[i] row by row.
  for batch in dataset.select_columns([column]).iter(batch_size=_ROWS_PER_READ):
    yield from batch[column]
