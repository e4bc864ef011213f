"""Reading local data files as a stream: documents for pretraining, rows of named columns for fine-tuning.

`iter_files(paths, text_column)` yields each document's text (jaxlm/data/corpora/sources.py counts and caps them);
`iter_rows(paths, columns)` yields each row as a dict of the wanted columns (of every column with
`every_column`, for RL prompts, whose other columns go to the reward functions). Text files are read in chunks, never
whole (except a .json file that is one array), and may be compressed; Parquet is read in Arrow batches.

The fine-tuning sets (jaxlm/data/tuning/classification.py, instructions.py, conversations.py) read their rows here,
uncapped. Their files (`TABLE_KINDS`) may also be `.csv` and `.tsv` (compressed too), whose cells are strings (""
when empty, None past a short row's end). A wanted column that the data lacks is a `MissingColumn` naming the column,
the file, the columns found and the setting to change.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from typing import Any

_COMPRESSIONS = (".gz", ".zst", ".bz2", ".lz4")  # decompressed by pyarrow's input streams, which ship with datasets
_TEXT_SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".tsv")
DOCUMENT_KINDS = ("txt", "jsonl", "json", "parquet")  # pretraining's files: documents
TABLE_KINDS = ("csv", "tsv", "jsonl", "json", "parquet")  # fine-tuning's files: rows with named columns
ROWS_PER_READ = 1024  # rows pulled per Arrow batch from a datasets.Dataset
# Parquet is decoded a few rows at a time from a buffered stream of each column chunk, not a row group at once: a
# row group of long documents (FineWeb's) holds tens of MB of text, and the reader's peak followed it.
PARQUET_ROWS_PER_READ = 64
PARQUET_READ_BUFFER = 1 << 20
_CHUNK = 1 << 22  # bytes read at a time from a text file
_ROWS_TO_FIND_A_COLUMN = 10_000  # JSON rows read before a column that none of them has is an error
_SNIFF_BYTES = 65536  # leading bytes searched for a NUL, the mark of a binary file


class MissingColumn(ValueError):
  """A wanted column that a file or dataset lacks; its fields let a caller word the error its own way."""

  def __init__(self, column: str, setting: str, where: str, found: list[str]):
    super().__init__(f"column {column!r} not found in {where!r}; columns are {found}; set {setting}")
    self.column, self.setting, self.where, self.found = column, setting, where, found


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


def iter_rows(paths: Iterable[str], columns: dict[str, str], every_column: bool = False) -> Iterator[dict[str, Any]]:
  """The rows of checked table files (TABLE_KINDS) in order, each a dict of `columns`' values (None where a row lacks
  one), and with `every_column` of the row's other columns too. `columns` maps each wanted column to the setting that
  names it, for the `MissingColumn` error."""
  for path in paths:
    kind = file_kind(path)
    if kind == "parquet":
      yield from _iter_parquet(path, columns, every_column)
    elif kind in ("csv", "tsv"):
      yield from _iter_csv(path, kind, columns, every_column)
    elif kind in ("jsonl", "json"):
      yield from _iter_json(path, kind, columns, every_column)
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


def _iter_json(path: str, kind: str, columns: dict[str, str], every_column: bool) -> Iterator[dict[str, Any]]:
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
    yield {**{column: row.get(column) for column in columns}, **(row if every_column else {})}
    if unseen and number >= _ROWS_TO_FIND_A_COLUMN:  # a wrong column name fails early, not after a 40 GB file
      break
  if unseen:
    column, setting = next(iter(unseen.items()))
    raise MissingColumn(column, setting, path, list(found))


def _iter_csv(path: str, kind: str, columns: dict[str, str], every_column: bool) -> Iterator[dict[str, Any]]:
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
        at = {column: header.index(column) for column in (header if every_column else columns)}
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


def _iter_parquet(path: str, columns: dict[str, str], every_column: bool) -> Iterator[dict[str, Any]]:
  import pyarrow.parquet as pq

  try:
    parquet = pq.ParquetFile(path, buffer_size=PARQUET_READ_BUFFER, pre_buffer=False)
  except Exception as e:  # noqa: BLE001 (pyarrow raises its own types)
    raise ValueError(f"data file {path!r} could not be read as parquet ({type(e).__name__}: "
                     f"{str(e).splitlines()[0][:200]}); fix the file or remove it from the data files") from None
  check_columns(parquet.schema_arrow.names, columns, path)
  for batch in parquet.iter_batches(batch_size=PARQUET_ROWS_PER_READ, columns=None if every_column else list(columns)):
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


def check_columns(names: list[str], columns: dict[str, str], where: str) -> None:
  for column, setting in columns.items():
    if column not in names:
      raise MissingColumn(column, setting, where, names)
