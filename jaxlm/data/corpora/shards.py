"""The shard store: a prepared corpus (jaxlm/data/corpora/prepare.py) read as fixed windows of seq_len + 1 tokens.

Shards stay on disk and a batch reads only its windows, with positioned reads (os.pread) rather than a memory map:
a map counts every page a run has touched toward the process's RSS, which would then grow as training sweeps the
corpus; read pages stay in the kernel's page cache either way. Memory and start-up time do not grow with the corpus.

Shard s of n tokens holds floor((n - 1) / T) windows with stride T that overlap by one token (the target of a
window's last input is the next window's first input), as jaxlm/data/packing.py cuts rows; the shard's last partial
window is not used. Segment ids come from the document ends at batch time:

  window w of shard s = tokens_s[w * T : w * T + T + 1],  segment = document number within the window, from 1

so `packing.make_examples` gives the same inputs, targets, positions and loss mask as packed rows: attention and
loss stop at document boundaries, and a document's EOS is its last target.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxlm.data.corpora import prepare
from jaxlm.data.packing import make_examples


def read_manifest(folder: str) -> dict[str, Any]:
  path = os.path.join(folder, prepare.MANIFEST)
  if not os.path.isfile(path):
    partial = os.path.isfile(os.path.join(folder, prepare.JOB_FILE))
    hint = ("its prepare did not finish: run experiments/prepare_data.py again with the same flags to complete it"
            if partial else "prepare one with experiments/prepare_data.py --out=<folder>")
    raise FileNotFoundError(f"{folder!r} is not a prepared corpus (no {prepare.MANIFEST}); {hint}")
  manifest = prepare.read_json(path)
  if manifest.get("format") != prepare.FORMAT or manifest.get("version", 0) > prepare.VERSION:
    raise ValueError(f"{path!r} is format {manifest.get('format')!r} version {manifest.get('version')}; this jaxlm "
                     f"reads {prepare.FORMAT!r} up to version {prepare.VERSION}")
  return manifest


class TokenWindows:
  """Random access to the windows of one split of one or more prepared folders (a grain RandomAccessDataSource).

  `self[i]` is {"tokens", "segments"}: [T + 1] int32 arrays; `batch(indices)` is the example dict of [B, T] arrays.
  """

  def __init__(self, folders: str | Sequence[str], split: str, seq_len: int):
    if seq_len < 1:
      raise ValueError(f"data.seq_len={seq_len} must be >= 1")
    folders = [folders] if isinstance(folders, str) else list(folders)
    self.seq_len = seq_len
    self._shards: list[_Shard] = []
    windows = []
    self.documents = self.corpus_tokens = 0
    for folder in folders:
      manifest = read_manifest(folder)
      for shard in manifest["shards"]:
        if shard["split"] != split:
          continue
        self.documents += shard["documents"]
        self.corpus_tokens += shard["tokens"]
        count = (shard["tokens"] - 1) // seq_len if shard["tokens"] > seq_len else 0
        if count:
          self._shards.append(_Shard(folder, shard, manifest["dtype"]))
          windows.append(count)
    self._first = np.concatenate([[0], np.cumsum(windows, dtype=np.int64)])  # [shards + 1] first window of each
    self.num_tokens = len(self) * seq_len  # target slots; every one holds a real token

  def __len__(self) -> int:
    return int(self._first[-1])

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if not 0 <= index < len(self):
      raise IndexError(f"window {index} out of range for {len(self)} windows")
    tokens, segments = self.rows(np.array([index]))
    return {"tokens": tokens[0], "segments": segments[0]}

  def rows(self, indices: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Windows at `indices` -> (tokens, segments), each int32 [B, T + 1]."""
    indices = np.asarray(indices, dtype=np.int64)
    width = self.seq_len + 1
    tokens = np.empty((len(indices), width), np.int32)
    segments = np.empty((len(indices), width), np.int32)
    shard_of = np.searchsorted(self._first, indices, side="right") - 1
    for row, (index, shard) in enumerate(zip(indices, shard_of)):
      start = int(index - self._first[shard]) * self.seq_len
      tokens[row] = self._shards[shard].tokens(start, width)
      document = self._shards[shard].documents(start, width)
      segments[row] = document - document[0] + 1
    return tokens, segments

  def batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
    return make_examples(*self.rows(indices))


_BLOCK = 512  # document ends per block of the in-memory index: 8 bytes kept per 512 documents


class _Shard:
  """One shard's tokens and document ends on disk, read by position."""

  def __init__(self, folder: str, shard: dict[str, Any], dtype: str):
    self.tokens_path = _path(folder, shard["tokens_file"])
    self.dtype = np.dtype(dtype).newbyteorder("<")
    if not os.path.isfile(self.tokens_path):
      raise FileNotFoundError(f"shard {self.tokens_path!r} listed in {folder}/{prepare.MANIFEST} is missing; "
                              f"prepare the corpus again")
    if self.tokens_path.endswith(".npy"):
      self.tokens_offset = _npy_data_offset(self.tokens_path, self.dtype, shard["tokens"])
    else:  # a file another tool wrote: raw tokens after a header of `offset` bytes (foreign_shards.py)
      self.tokens_offset = shard.get("offset", 0)
      needed = self.tokens_offset + shard["tokens"] * self.dtype.itemsize
      if os.path.getsize(self.tokens_path) < needed:
        raise ValueError(f"shard {self.tokens_path!r} holds {os.path.getsize(self.tokens_path)} bytes but the "
                         f"manifest needs {needed}; the file changed since it was indexed: index it again with "
                         f"experiments/prepare_data.py")
    self.ends_path = _path(folder, shard["ends_file"])
    self.documents_count = shard["documents"]
    self.ends_offset = _npy_data_offset(self.ends_path, np.dtype("<u8"), self.documents_count)
    self._index: np.ndarray | None = None  # every _BLOCK-th document end, built on first use

  def tokens(self, start: int, count: int) -> np.ndarray:
    size = self.dtype.itemsize
    return np.frombuffer(_read(self.tokens_path, self.tokens_offset + start * size, count * size), self.dtype)

  def documents(self, start: int, count: int) -> np.ndarray:
    """The document number of each of tokens start ... start + count - 1 (numbered from the shard's first)."""
    if self._index is None:
      self._index = self._block_index()
    positions = np.arange(start, start + count, dtype=np.int64)
    first, last = np.searchsorted(self._index, positions[[0, -1]], side="right")  # blocks of the first, last token
    begin, end = first * _BLOCK, min((last + 1) * _BLOCK, self.documents_count)
    ends = np.frombuffer(_read(self.ends_path, self.ends_offset + begin * 8, (end - begin) * 8), "<u8")
    return begin + np.searchsorted(ends.astype(np.int64), positions, side="right")

  def _block_index(self) -> np.ndarray:
    chunk = _BLOCK * 8192  # entries per read: a multiple of the block, so every chunk starts on a block
    index = []
    for begin in range(0, self.documents_count, chunk):
      count = min(chunk, self.documents_count - begin)
      ends = np.frombuffer(_read(self.ends_path, self.ends_offset + begin * 8, count * 8), "<u8")
      index.append(ends[_BLOCK - 1::_BLOCK].astype(np.int64))
    return np.concatenate(index) if index else np.zeros(0, np.int64)


def _read(path: str, offset: int, size: int) -> bytes:
  fd = os.open(path, os.O_RDONLY)
  try:
    data = os.pread(fd, size, offset)
  finally:
    os.close(fd)
  if len(data) != size:
    raise ValueError(f"{path!r} ended early (read {len(data)} of {size} bytes at offset {offset}); the shard is "
                     f"truncated: prepare the corpus again")
  return data


def _npy_data_offset(path: str, dtype: np.dtype, count: int) -> int:
  """Where the data of a 1-D .npy file starts, after checking its dtype and length (never unpickles)."""
  with open(path, "rb") as f:
    version = np.lib.format.read_magic(f)
    read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, found = read_header(f)
    if found.newbyteorder("<") != dtype.newbyteorder("<") or shape != (count,):
      raise ValueError(f"{path!r} holds {found} {shape}, the manifest says {dtype} ({count},); prepare the corpus "
                       f"again")
    return f.tell()


def _path(folder: str, name: str) -> str:
  return name if os.path.isabs(name) else os.path.join(folder, name)
