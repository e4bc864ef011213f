"""Where documents come from, streamed: the embedded demo corpus, local files, or an HF dataset.

`stream_documents(config, split)` returns a `DocumentStream`: iterating it yields non-empty strings in a
deterministic order, one at a time (nothing holds the corpus), and its `stats` count what was read (`documents`,
`bytes`, `skipped_documents`) so that a pipeline that silently read nothing is visible. `read_documents` collects a
stream into a list, for data sets that fit in memory.

Sources (`data.source`):
  demo   the Python standard library's own `.py` files, one document per file; needs no network.
  files  `data.train_files` / `data.eval_files`: `.txt` (each non-empty line is a document, split as str.splitlines),
         `.jsonl` (the `data.text_column` of each line's object), `.json` (JSON lines, or one array of objects) and
         `.parquet`; `.txt`, `.jsonl` and `.json` may be compressed (`.gz`, `.zst`, `.bz2`, `.lz4`).
  hf     an HF dataset: a folder written by `Dataset.save_to_disk` (memory-mapped), else
         `datasets.load_dataset(data.hf_name, data.hf_config, split=data.hf_split, streaming=True)`: a hub name or a
         local folder of data files, read without writing an Arrow copy.

Caps: `data.max_documents` and `data.max_bytes` (UTF-8 bytes of document text; 0 = no cap). The document that
crosses the byte cap is cut so the cap holds exactly; when a cap cuts the data the console says how much was read.

Rows: the fine-tuning sets (jaxlm/data/classification.py, instructions.py, conversations.py) read through the same
readers, uncapped: `iter_rows(paths, columns)` streams each row of local files as a dict of the wanted columns
(`iter_files` reads its text column), `open_hf` and `iter_hf_rows` an HF dataset's. Their files (`TABLE_KINDS`) may
also be `.csv` and `.tsv` (compressed too), whose cells are strings ("" when empty, None past a short row's end). A
wanted column that the data lacks is a `MissingColumn` naming the column, the file, the columns found and the setting
to change.
"""

from __future__ import annotations

import json
import os
import sysconfig
from collections.abc import Iterable, Iterator
from typing import Any

from jaxlm.config import DataConfig

# Standard-library folders that are tests, GUIs or vendored code rather than representative library source.
_DEMO_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "idlelib", "__pycache__",
                             "lib2to3", "turtledemo", "tkinter", "ensurepip", "config-3", "lib-dynload"})
_COMPRESSIONS = (".gz", ".zst", ".bz2", ".lz4")  # decompressed by pyarrow's input streams, which ship with datasets
_TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".tsv")
DOCUMENT_KINDS = ("txt", "jsonl", "json", "parquet")  # pretraining's files: documents
TABLE_KINDS = ("csv", "tsv", "jsonl", "json", "parquet")  # fine-tuning's files: rows with named columns
_ROWS_PER_READ = 1024  # rows pulled per Arrow batch from Parquet and datasets
_CHUNK = 1 << 22  # bytes read at a time from a text file
_ROWS_TO_FIND_A_COLUMN = 10_000  # JSON rows read before a column that none of them has is an error
_SNIFF_BYTES = 65536  # leading bytes searched for a NUL, the mark of a binary file


class MissingColumn(ValueError):
  """A wanted column that a file or dataset lacks; its fields let a caller word the error its own way."""

  def __init__(self, column: str, setting: str, where: str, found: list[str]):
    super().__init__(f"column {column!r} not found in {where!r}; columns are {found}; set {setting}")
    self.column, self.setting, self.where, self.found = column, setting, where, found


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


def check_files(paths: Iterable[str], kinds: tuple[str, ...] = DOCUMENT_KINDS) -> list[str]:
  """Checks every path before any is read, so a typo in the last file fails before minutes of reading; `kinds`
  are the `file_kind`s the reader takes (DOCUMENT_KINDS or TABLE_KINDS)."""
  paths = list(paths)
  for path in paths:
    if not os.path.isfile(path):
      raise FileNotFoundError(f"data file {path!r} does not exist; fix data.train_files / data.eval_files")
    if os.path.getsize(path) == 0:
      raise ValueError(f"data file {path!r} is empty; remove it from data.train_files / data.eval_files")
    if file_kind(path) not in kinds:
      suffixes = [f".{kind}" for kind in kinds]
      raise ValueError(f"data file {path!r} has unsupported suffix {_suffix(path)!r}; use {', '.join(suffixes[:-1])} "
                       f"or {suffixes[-1]} (the text ones may end in {', '.join(_COMPRESSIONS)})")
  return paths


def _suffix(path: str) -> str:
  root, suffix = os.path.splitext(path.lower())
  if suffix in _COMPRESSIONS:
    suffix = os.path.splitext(root)[1] + suffix
  return suffix


def file_kind(path: str) -> str | None:
  """txt, jsonl, json, csv, tsv or parquet by the file's suffix (a compression suffix after it allowed), else None."""
  root, suffix = os.path.splitext(path.lower())
  if suffix == ".parquet":
    return "parquet"
  if suffix in _COMPRESSIONS:
    root, suffix = os.path.splitext(root)
  return suffix[1:] if suffix in _TEXT_SUFFIXES else None


def iter_files(paths: Iterable[str], text_column: str) -> Iterator[Any]:
  """The texts of checked files in order (None or non-str values for rows without text: the stream skips them)."""
  columns = {text_column: "data.text_column"}
  for path in paths:
    if file_kind(path) == "txt":
      yield from _iter_lines(path, split_any=True)
    else:
      yield from (row[text_column] for row in iter_rows([path], columns))


def iter_rows(paths: Iterable[str], columns: dict[str, str]) -> Iterator[dict[str, Any]]:
  """The rows of checked table files (TABLE_KINDS) in order, each a dict of `columns`' values (None where a row lacks
  one). `columns` maps each wanted column to the setting that names it, for the `MissingColumn` error."""
  for path in paths:
    kind = file_kind(path)
    if kind == "parquet":
      yield from _iter_parquet(path, columns)
    elif kind in ("csv", "tsv"):
      yield from _iter_csv(path, kind, columns)
    elif kind in ("jsonl", "json"):
      yield from _iter_json(path, kind, columns)
    else:
      raise ValueError(f"data file {path!r} is not a table ({', '.join(TABLE_KINDS)}); give rows with named columns")


def _open_stream(path: str):
  import pyarrow as pa  # a dependency of datasets; reads compressed files by their suffix

  return pa.input_stream(path, compression="detect")


def _iter_lines(path: str, split_any: bool) -> Iterator[str]:
  """The lines of a (possibly compressed) UTF-8 file, read in chunks: str.splitlines' breaks if `split_any`
  (as the HF "text" builder), else only newlines (JSON lines, whose strings may hold other break characters)."""
  import codecs

  decoder = codecs.getincrementaldecoder("utf-8")()
  offset, carry, first = 0, "", True
  with _open_stream(path) as f:
    while True:
      raw = f.read(_CHUNK)
      if first:
        _check_not_binary(raw[:_SNIFF_BYTES], path)
        first = False
      try:
        text = carry + decoder.decode(raw, final=not raw)
      except UnicodeDecodeError as e:
        at = offset + e.start - (len(e.object) - len(raw))  # the decoder may hold bytes of the previous chunk
        raise ValueError(f"data file {path!r} is not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {at}); "
                         f"re-encode it, e.g. iconv -f latin1 -t utf-8") from None
      offset += len(raw)
      if not raw:
        if text:
          yield from (text.splitlines() if split_any else text.split("\n"))
        return
      if split_any:
        lines = text.splitlines(keepends=True)
        # The last piece is incomplete unless it ends with a break; a "\r" may be half of a "\r\n".
        complete = lines and lines[-1].splitlines()[0] != lines[-1] and not lines[-1].endswith("\r")
        carry = "" if complete else lines.pop() if lines else ""
        yield from (line.splitlines()[0] for line in lines)
      else:
        lines = text.split("\n")
        carry = lines.pop()
        yield from lines


def _iter_json(path: str, kind: str, columns: dict[str, str]) -> Iterator[dict[str, Any]]:
  if kind == "json" and _first_character(path) == "[":  # one JSON array: read whole (it cannot be streamed)
    with _open_stream(path) as f:
      raw = f.read()
    try:
      rows = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
      raise ValueError(f"data file {path!r} could not be read as json ({type(e).__name__}: "
                       f"{str(e).splitlines()[0][:200]}); fix the file or remove it from the data files") from None
    numbered = enumerate(rows, start=1)
  else:
    numbered = ((n, line) for n, line in enumerate(_iter_lines(path, split_any=False), start=1) if line.strip())
  # A column is there when some row has it (as in an Arrow table's schema); the keys are gathered until all are.
  unseen, found = dict(columns), {}
  for number, row in numbered:
    if isinstance(row, str):
      try:
        row = json.loads(row)
      except ValueError as e:
        raise ValueError(f"data file {path!r} could not be read as {kind} (line {number}: JSON parse error: "
                         f"{str(e)[:200]}); fix the file or remove it from the data files") from None
    if not isinstance(row, dict):
      row = {}
    if unseen:
      found.update(dict.fromkeys(row))
      unseen = {column: setting for column, setting in unseen.items() if column not in row}
    yield {column: row.get(column) for column in columns}
    if unseen and number >= _ROWS_TO_FIND_A_COLUMN:  # a wrong column name fails early, not after a 40 GB file
      break
  if unseen:
    column, setting = next(iter(unseen.items()))
    raise MissingColumn(column, setting, path, list(found))


def _iter_csv(path: str, kind: str, columns: dict[str, str]) -> Iterator[dict[str, Any]]:
  import csv

  # A long document in a cell is no error (the module's default limit is 128 KiB).
  csv.field_size_limit(max(csv.field_size_limit(), 2**31 - 1))
  # strict: an unclosed quote is an error, not the rest of the file read as one cell.
  reader = csv.reader((line + "\n" for line in _iter_lines(path, split_any=False)),
                      delimiter="\t" if kind == "tsv" else ",", strict=True)
  header, at = None, {}
  try:
    for cells in reader:
      if not cells:  # a blank line
        continue
      if header is None:
        header = [cells[0].removeprefix("\ufeff"), *cells[1:]]  # a byte-order mark, as spreadsheets write
        for column, setting in columns.items():
          if column not in header:
            raise MissingColumn(column, setting, path, header)
        at = {column: header.index(column) for column in columns}
        continue
      if len(cells) > len(header):
        raise ValueError(f"data file {path!r} could not be read as {kind} (line {reader.line_num}: {len(cells)} "
                         f"fields, the header has {len(header)}); fix the file or remove it from the data files")
      yield {column: cells[i] if i < len(cells) else None for column, i in at.items()}
  except csv.Error as e:
    raise ValueError(f"data file {path!r} could not be read as {kind} (line {reader.line_num}: {e}); fix the file "
                     f"or remove it from the data files") from None
  if header is None:
    column, setting = next(iter(columns.items()))
    raise MissingColumn(column, setting, path, [])


def _first_character(path: str) -> str:
  with _open_stream(path) as f:
    head = f.read(_SNIFF_BYTES).decode("utf-8", errors="ignore").lstrip()
  return head[:1]


def _iter_parquet(path: str, columns: dict[str, str]) -> Iterator[dict[str, Any]]:
  import pyarrow.parquet as pq

  try:
    parquet = pq.ParquetFile(path)
  except Exception as e:  # noqa: BLE001 (pyarrow raises its own types)
    raise ValueError(f"data file {path!r} could not be read as parquet ({type(e).__name__}: "
                     f"{str(e).splitlines()[0][:200]}); fix the file or remove it from the data files") from None
  _check_columns(parquet.schema_arrow.names, columns, path)
  for batch in parquet.iter_batches(batch_size=_ROWS_PER_READ, columns=list(columns)):
    try:
      rows = batch.to_pylist()
    except UnicodeDecodeError as e:  # Arrow keeps a string column's bytes; decoding fails only when a value is read
      raise ValueError(f"data file {path!r} is not UTF-8 (a value holds byte 0x{e.object[e.start]:02x}); re-encode "
                       f"it, e.g. iconv -f latin1 -t utf-8") from None
    yield from rows


def _check_not_binary(head: bytes, path: str) -> None:
  nul = head.find(b"\0")
  if nul != -1:
    raise ValueError(f"data file {path!r} looks binary (a NUL byte at offset {nul}); give UTF-8 text or .parquet")


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


def iter_hf_rows(dataset: Any, columns: dict[str, str], where: str) -> Iterator[dict[str, Any]]:
  """The rows of an `open_hf` dataset, each a dict of `columns` (as `iter_rows`)."""
  import datasets

  names = dataset.column_names  # None for a streamed dataset that does not know them: checked on its first row
  if names is not None:
    _check_columns(list(names), columns, where)
  if isinstance(dataset, datasets.Dataset):
    for batch in dataset.select_columns(list(columns)).iter(batch_size=_ROWS_PER_READ):
      yield from (dict(zip(batch, values)) for values in zip(*batch.values()))
    return
  for row in dataset:
    if names is None:
      names = list(row)
      _check_columns(names, columns, where)
    yield {column: row.get(column) for column in columns}


def _check_columns(names: list[str], columns: dict[str, str], where: str) -> None:
  for column, setting in columns.items():
    if column not in names:
      raise MissingColumn(column, setting, where, names)
