"""Packing documents into fixed-length training rows, with document-boundary masking.

Every document is tokenized, followed by EOS, and concatenated into one token stream with a parallel segment-id
stream (document number, from 1; 0 marks padding). The stream is cut into N rows of T + 1 tokens that overlap by one
token, so every stream token after the first is a target exactly once:

  row i = stream[i * T : i * T + T + 1]     tokens [N, T+1], segments [N, T+1]   (last row padded with segment 0)

Example i (every array has length T = seq_len):
  inputs       int32    tokens[i, :-1]
  targets      int32    tokens[i, 1:]
  segment_ids  int32    segments[i, :-1]; attention may only look at keys with the same id; 0 = padding
  positions    int32    position inside its document segment of this row (restarts at 0 at each segment start)
  loss_mask    float32  1 where segments[i, :-1] == segments[i, 1:] != 0: no target crosses a document boundary
                        or lands on padding. A document's EOS is a target; the next document's first token is not.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import tokenizers


_DOCS_PER_ENCODE = 4096  # documents per encode_batch call, bounding the memory of Encoding objects


class PackedSequences:
  """Random-access packed rows; `self[i]` is one example dict, `batch(indices)` a dict of [B, T] arrays."""

  def __init__(self, tokens: np.ndarray, segments: np.ndarray):
    if tokens.shape != segments.shape or tokens.ndim != 2 or tokens.shape[1] < 2:
      raise ValueError(f"tokens {tokens.shape} and segments {segments.shape} must both be [N, seq_len + 1]")
    self.tokens = np.ascontiguousarray(tokens, dtype=np.int32)  # [N, T+1]
    self.segments = np.ascontiguousarray(segments, dtype=np.int32)  # [N, T+1]
    self.seq_len = tokens.shape[1] - 1
    self.num_tokens = int(_loss_mask(self.segments).sum())  # loss targets in all rows
    self.num_padding = int((self.segments[:, 1:] == 0).sum())  # target slots that are padding

  def __len__(self) -> int:
    return self.tokens.shape[0]

  def __getitem__(self, index: int) -> dict[str, np.ndarray]:
    index = int(index)
    if not -len(self) <= index < len(self):
      raise IndexError(f"row {index} out of range for {len(self)} packed sequences")
    return {k: v[0] for k, v in self.batch(np.array([index % len(self)])).items()}

  def batch(self, indices: Sequence[int] | np.ndarray) -> dict[str, np.ndarray]:
    """The examples at `indices` stacked into [B, T] arrays (one vectorised gather, no per-row Python)."""
    indices = np.asarray(indices, dtype=np.int64)
    return make_examples(self.tokens[indices], self.segments[indices])

  def save(self, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    np.save(os.path.join(directory, "tokens.npy"), self.tokens, allow_pickle=False)
    np.save(os.path.join(directory, "segments.npy"), self.segments, allow_pickle=False)

  @classmethod
  def load(cls, directory: str) -> PackedSequences:
    paths = [os.path.join(directory, f"{name}.npy") for name in ("tokens", "segments")]
    for path in paths:
      if not os.path.isfile(path):
        raise FileNotFoundError(f"packed data file {path!r} does not exist; delete {directory!r} to rebuild it")
    return cls(*(np.load(path, allow_pickle=False) for path in paths))


def make_examples(tokens: np.ndarray, segments: np.ndarray) -> dict[str, np.ndarray]:
  """Rows [B, T+1] of tokens and segment ids -> the example dict of [B, T] arrays (see module docstring)."""
  seg = segments[:, :-1]  # [B, T]
  batch, length = seg.shape
  # A segment starts at column 0 and wherever the id changes; position = column - column of the latest start.
  starts = np.ones((batch, length), dtype=bool)
  starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
  columns = np.arange(length, dtype=np.int32)  # [T]
  last_start = np.maximum.accumulate(np.where(starts, columns, 0), axis=1)  # [B, T]
  return {
      "inputs": tokens[:, :-1],
      "targets": tokens[:, 1:],
      "segment_ids": seg,
      "positions": (columns - last_start).astype(np.int32),
      "loss_mask": _loss_mask(segments).astype(np.float32),
  }


def _loss_mask(segments: np.ndarray) -> np.ndarray:
  # [N, T+1] -> [N, T] bool: the target is in the input's document and is not padding.
  return (segments[:, :-1] == segments[:, 1:]) & (segments[:, :-1] != 0)


def pack(tokenizer: tokenizers.Tokenizer, documents: Sequence[str], seq_len: int, eos_id: int) -> PackedSequences:
  """Tokenizes `documents` (EOS after each), concatenates them and cuts rows of seq_len + 1 (see module docstring)."""
  if seq_len < 1:
    raise ValueError(f"data.seq_len={seq_len} must be >= 1")
  token_chunks, segment_chunks = [], []
  # encode_batch_fast skips offset tracking; older tokenizers only have encode_batch.
  encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
  for start in range(0, len(documents), _DOCS_PER_ENCODE):
    encodings = encode(list(documents[start:start + _DOCS_PER_ENCODE]), add_special_tokens=False)
    for number, encoding in enumerate(encodings, start=start + 1):
      ids = np.empty(len(encoding.ids) + 1, dtype=np.int32)
      ids[:-1] = encoding.ids
      ids[-1] = eos_id
      token_chunks.append(ids)
      segment_chunks.append(np.full(ids.shape, number, dtype=np.int32))
  if not token_chunks:
    return PackedSequences(np.zeros((0, seq_len + 1), np.int32), np.zeros((0, seq_len + 1), np.int32))
  stream = np.concatenate(token_chunks)  # [L]
  stream_segments = np.concatenate(segment_chunks)  # [L]
  num_rows = -(-(len(stream) - 1) // seq_len)  # ceil: the first token is never a target
  padded = num_rows * seq_len + 1
  tokens = np.full(padded, eos_id, dtype=np.int32)  # padding carries a valid id but segment 0 masks it out
  segments = np.zeros(padded, dtype=np.int32)
  tokens[:len(stream)] = stream
  segments[:len(stream)] = stream_segments
  # Overlapping windows of T + 1 with stride T: a strided view, copied once into contiguous rows.
  rows = lambda a: np.lib.stride_tricks.sliding_window_view(a, seq_len + 1)[::seq_len].copy()
  return PackedSequences(rows(tokens), rows(segments))
