"""The shard store: a prepared corpus (jaxlm/data/prepare.py) read as fixed windows of seq_len + 1 tokens.

Shards stay on disk, memory-mapped; nothing is read until a batch asks for its windows, so memory and start-up time
do not grow with the corpus. Shard s of n tokens holds floor((n - 1) / T) windows with stride T that overlap by one
token (the target of a window's last input is the next window's first input), as jaxlm/data/packing.py cuts rows;
the shard's last partial window is not used. Segment ids come from the document ends at batch time:

  window w of shard s = tokens_s[w * T : w * T + T + 1],  segment = document number within the window, from 1

so `packing.make_examples` gives the same inputs, targets, positions and loss mask as packed rows: attention and
loss stop at document boundaries, and a document's EOS is its last target.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxlm.data import prepare
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
    self._tokens: list[np.ndarray] = []
    self._ends: list[np.ndarray] = []
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
        if count == 0:
          continue
        self._tokens.append(_open_tokens(folder, shard, manifest["dtype"]))
        ends_path = _path(folder, shard["ends_file"])
        self._ends.append(np.load(ends_path, mmap_mode="r", allow_pickle=False))
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
    span = np.arange(width, dtype=np.int64)
    for row, (index, shard) in enumerate(zip(indices, shard_of)):
      start = int(index - self._first[shard]) * self.seq_len
      tokens[row] = self._tokens[shard][start:start + width]
      ends = self._ends[shard]
      # Search with the ends' own dtype: a mixed uint64/int64 search converts the whole array to float64.
      first, last = np.searchsorted(ends, np.array([start, start + width - 1], ends.dtype), side="right")
      near = np.asarray(ends[first:last + 1], np.int64)  # the few ends inside the window
      document = np.searchsorted(near, start + span, side="right")  # 0 = the window's first
      segments[row] = document + 1
    return tokens, segments

  def batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
    return make_examples(*self.rows(indices))


def _path(folder: str, name: str) -> str:
  return name if os.path.isabs(name) else os.path.join(folder, name)


def _open_tokens(folder: str, shard: dict[str, Any], dtype: str) -> np.ndarray:
  path = _path(folder, shard["tokens_file"])
  if not os.path.isfile(path):
    raise FileNotFoundError(f"shard {path!r} listed in {folder}/{prepare.MANIFEST} is missing; prepare the corpus "
                            f"again")
  if path.endswith(".npy"):
    tokens = np.load(path, mmap_mode="r", allow_pickle=False)
  else:  # a file another tool wrote: raw tokens after a header of `offset` bytes (jaxlm/data/foreign_shards.py)
    needed = shard.get("offset", 0) + shard["tokens"] * np.dtype(dtype).itemsize
    if os.path.getsize(path) < needed:
      raise ValueError(f"shard {path!r} holds {os.path.getsize(path)} bytes but the manifest needs {needed}; the file "
                       f"changed since it was indexed: index it again with experiments/prepare_data.py")
    tokens = np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", offset=shard.get("offset", 0),
                       shape=(shard["tokens"],))
  if tokens.shape != (shard["tokens"],):
    raise ValueError(f"shard {path!r} holds {tokens.shape} tokens but the manifest says {shard['tokens']}; prepare "
                     f"the corpus again")
  return tokens
