"""Prepare: stream documents, tokenize them in worker processes, write token shards and one manifest.

A prepared folder (read by jaxlm/data/corpora/shards.py):

  manifest.json              what is here: dtype, eos_id, vocab_size, tokenizer hash, documents, tokens, shards
  tokenizer.json             the tokenizer that wrote the shards
  train-00000.tokens.npy     uint16 (vocabulary <= 65,536) or uint32 [n]: each document's tokens, then EOS
  train-00000.ends.npy       uint64 [documents]: where each document ends (exclusive), so document i is
                             tokens[ends[i-1]:ends[i]]
  eval-00000.tokens.npy ...  the held-out documents, in shards of their own

The reader cuts the document stream into batches of about `shard_bytes` characters of text, in reading order; batch
i becomes shard i (train-i and, with an eval fraction, eval-i). The cut depends on the documents alone, so 1 and N
workers write the same files. Memory follows neither the corpus nor the shard size: the documents go to the workers
in pieces of about 1 MB of text, a few pieces in flight per worker, and each piece's tokens come back to this
process, which appends them to the shard's files in reading order. With an eval fraction f, every 1/f-th document of
the stream is held out (`held_out`), decided by its place in reading order: reproducible, and the same for any number
of workers. An interrupted prepare,
run again, skips the shards it finished (each is written to a temporary name, renamed, then recorded in `.done/`);
the manifest is written last.

Why not datatrove's tokenization step, which HF prepares FineWeb with: its shards follow its tasks (one output per
task and input file), so the files depend on how the job was split; here they depend on the documents alone.
"""

from __future__ import annotations

import collections
import concurrent.futures as futures
import dataclasses
import hashlib
import io
import itertools
import json
import math
import multiprocessing
import os
import shutil
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

FORMAT = "jaxlm-tokens"
VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER = "tokenizer.json"
_DONE = ".done"
JOB_FILE = ".prepare.json"  # present while a prepare is unfinished
_PIECE_BYTES = 1 << 20  # text per encode_batch call and per task sent to a worker: the call's Encoding objects take
                       # many times the size of its text, so a worker's memory follows this
_AHEAD_PER_WORKER = 2  # pieces in flight per worker: one it tokenizes, one queued for it
DEFAULT_SHARD_BYTES = 32_000_000  # characters of text per shard (prepare_data.py --shard_mb)


@dataclasses.dataclass(frozen=True)
class Spec:
  """What a prepare writes, apart from its documents: a rerun with another spec may not reuse the folder."""
  tokenizer_sha256: str
  eos_id: int
  dtype: str
  eval_fraction: float
  inputs: dict[str, Any]  # a description of where the documents came from (paths, dataset names, caps)


def token_dtype(vocab_size: int) -> np.dtype:
  """uint16 when every id fits (the vocabulary has <= 65,536 entries), else uint32."""
  return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def held_out(index: int, eval_fraction: float) -> bool:
  """True when the `index`-th document of the stream belongs to the eval split: the first document, then one in every
  1 / eval_fraction, evenly spaced (so even a small corpus has one). Decided by the place in reading order, so any
  number of workers holds out the same documents."""
  if eval_fraction <= 0:
    return False
  phase = 1 - eval_fraction  # puts the first held-out document at index 0
  return math.floor((index + 1) * eval_fraction + phase) > math.floor(index * eval_fraction + phase)


def prepare(documents: Iterable[str], out: str, tokenizer_json: str, eos_id: int, vocab_size: int, *,
            eval_documents: Iterable[str] | None = None, eval_fraction: float = 0.0, workers: int = 0,
            shard_bytes: int = DEFAULT_SHARD_BYTES, inputs: dict[str, Any] | None = None,
            read_stats: Any = None, progress: bool = True) -> dict[str, Any]:
  """Tokenizes `documents` (and `eval_documents`, all held out) into shards under `out`; returns the manifest.

  `tokenizer_json` is the tokenizer's JSON text; `workers` processes tokenize (0 = one per core; 1 = in this
  process). A finished `out` with the same spec is returned as it is; an interrupted one resumes. `read_stats` is
  an object whose `stats` dict counts what the reader read and skipped (a sources.DocumentStream), recorded in the
  manifest.
  """
  if eval_documents is not None and eval_fraction > 0:
    raise ValueError("give held-out documents or an eval fraction, not both")
  spec = Spec(hashlib.sha256(tokenizer_json.encode()).hexdigest(), eos_id, token_dtype(vocab_size).name,
              float(eval_fraction), inputs or {})
  manifest_path = os.path.join(out, MANIFEST)
  if os.path.isfile(manifest_path):
    manifest = read_json(manifest_path)
    if manifest.get("spec") == dataclasses.asdict(spec):
      return manifest
    raise ValueError(f"{out!r} holds a corpus prepared with other inputs or another tokenizer; choose another "
                     f"output folder or delete it")
  os.makedirs(os.path.join(out, _DONE), exist_ok=True)
  job_path = os.path.join(out, JOB_FILE)
  if os.path.isfile(job_path) and read_json(job_path) != dataclasses.asdict(spec):
    raise ValueError(f"{out!r} holds an unfinished prepare of other inputs or another tokenizer; choose another "
                     f"output folder or delete it")
  write_json(job_path, dataclasses.asdict(spec))
  with open(os.path.join(out, TOKENIZER), "w", encoding="utf-8") as f:
    f.write(tokenizer_json)

  streams = [("main", documents)] + ([("eval", eval_documents)] if eval_documents is not None else [])
  workers = workers or os.cpu_count() or 1
  results = _run(streams, out, spec, workers, shard_bytes, progress)
  shards = sorted((s for r in results for s in r["shards"]), key=lambda s: (s["split"] != "train", s["name"]))
  if not any(s["documents"] for s in shards if s["split"] == "train"):
    held = sum(s["documents"] for s in shards if s["split"] == "eval")
    raise ValueError(f"no documents to train on were read ({held} held out for eval); check the inputs, the text "
                     f"column and the caps" + ("; a corpus this small needs eval files" if held else ""))
  splits = {split: {k: sum(s[k] for s in shards if s["split"] == split) for k in ("documents", "tokens", "bytes")}
            for split in ("train", "eval")}
  manifest = {
      "format": FORMAT, "version": VERSION, "dtype": spec.dtype, "eos_id": eos_id, "vocab_size": vocab_size,
      "tokenizer": TOKENIZER, "tokenizer_sha256": spec.tokenizer_sha256,
      "documents": sum(v["documents"] for v in splits.values()), "tokens": sum(v["tokens"] for v in splits.values()),
      "bytes": sum(v["bytes"] for v in splits.values()), "splits": splits, "eval_fraction": eval_fraction,
      "read": dict(getattr(read_stats, "stats", {}) or {}), "capped": getattr(read_stats, "capped", ""),
      "spec": dataclasses.asdict(spec), "shards": shards,
  }
  write_json(manifest_path, manifest)  # last: a folder with a manifest is complete
  shutil.rmtree(os.path.join(out, _DONE), ignore_errors=True)
  os.remove(job_path)
  return manifest


def _pieces(streams, shard_bytes: int) -> Iterator[dict[str, Any]]:
  """The documents in reading order, in pieces of about _PIECE_BYTES characters that never span two shards. A shard
  ends after the document that brings it to `shard_bytes` characters (a cheap, deterministic proxy for bytes), so
  the cut depends on the documents alone; piece i of shard k carries `first`, its first document's place in its
  stream."""
  for stream, documents in streams:
    index, first, count = 0, 0, 0
    piece, piece_size, shard_size = [], 0, 0
    for text in documents:
      piece.append(text)
      count += 1
      piece_size += len(text)
      shard_size += len(text)
      if shard_size >= shard_bytes or piece_size >= _PIECE_BYTES:
        yield {"stream": stream, "index": index, "first": first, "documents": piece}
        first, piece, piece_size = count, [], 0
        if shard_size >= shard_bytes:
          index, shard_size = index + 1, 0
    if piece:
      yield {"stream": stream, "index": index, "first": first, "documents": piece}


def _shard_of(piece: dict[str, Any]) -> tuple[str, int]:
  return piece["stream"], piece["index"]


def _run(streams, out: str, spec: Spec, workers: int, shard_bytes: int, progress: bool) -> list[dict[str, Any]]:
  from tqdm import tqdm

  bar = tqdm(desc="prepare", unit="MB", unit_scale=False, disable=not progress, smoothing=0, dynamic_ncols=True,
             bar_format="{desc}: {n:.1f} MB of text [{elapsed}, {rate_fmt}{postfix}]")
  totals = {"documents": 0, "tokens": 0}
  started = time.time()
  results: list[dict[str, Any]] = []

  def finished(result: dict[str, Any]) -> None:
    results.append(result)
    totals["documents"] += sum(s["documents"] for s in result["shards"])
    totals["tokens"] += sum(s["tokens"] for s in result["shards"])
    rate = totals["tokens"] / max(time.time() - started, 1e-9)
    bar.set_postfix_str(f"{totals['documents']:,} documents, {totals['tokens']:,} tokens, {rate:,.0f} tokens/s",
                        refresh=False)
    bar.update(sum(s["bytes"] for s in result["shards"]) / 1e6)

  pieces = _pieces(streams, shard_bytes)
  ahead = list(itertools.islice(pieces, 2))
  shards = itertools.groupby(itertools.chain(ahead, pieces), key=_shard_of)
  if workers == 1 or len(ahead) < 2:  # one piece: worker processes would only add their start-up
    tokenizer = _load_tokenizer(out)
    for (stream, index), group in shards:
      writer = ShardWriter(out, spec, stream, index)
      group = (writer.read(_work(piece, spec)) for piece in group)
      if writer.record is None:
        finished(tokenize_shard({"stream": stream, "index": index, "writer": writer, "pieces": group}, tokenizer))
      else:  # finished by an earlier, interrupted prepare: its documents are read only to check them
        collections.deque(group, maxlen=0)
        finished(writer.finish())
      _release_reader_memory()
    bar.close()
    return results
  context = multiprocessing.get_context("spawn")  # no fork: the parent may hold JAX's threads
  threads = max(1, (os.cpu_count() or 1) // workers)
  with futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                                   initargs=(os.path.join(out, TOKENIZER), threads)) as pool:
    # In reading order: (writer, a piece's future) and (writer, None) once the shard's pieces are all sent.
    pending: collections.deque = collections.deque()

    def drain(keep: int) -> None:
      while len(pending) > keep:
        oldest, future = pending.popleft()
        if future is None:
          finished(oldest.finish())
        else:
          oldest.append(future.result())

    for (stream, index), group in shards:
      writer = ShardWriter(out, spec, stream, index)
      for piece in group:
        writer.read(piece)
        if writer.record is None:
          pending.append((writer, pool.submit(tokenize_piece, _work(piece, spec))))
          drain(keep=_AHEAD_PER_WORKER * workers)  # bounded: the reader runs ahead by a few pieces, not shards
      pending.append((writer, None))
      _release_reader_memory()
    drain(keep=0)
  bar.close()
  return results


def _work(piece: dict[str, Any], spec: Spec) -> dict[str, Any]:
  return {**piece, "dtype": spec.dtype, "eos_id": spec.eos_id, "eval_fraction": spec.eval_fraction}


def _release_reader_memory() -> None:
  """Hands back what pyarrow's allocator kept of the Parquet reader's freed buffers (its pool keeps them per thread,
  and the reading process's RSS would creep up file after file)."""
  pyarrow = sys.modules.get("pyarrow")
  if pyarrow is not None:
    pyarrow.default_memory_pool().release_unused()


class ShardWriter:
  """One shard's files, written piece by piece in reading order: each split's tokens stream into a temporary .npy
  (its header, which numpy pads to a fixed size whatever the length, rewritten at the end), its document ends are
  kept (8 bytes a document). `record` is the `.done/` record of a shard an interrupted prepare finished, else None."""

  def __init__(self, out: str, spec: Spec, stream: str, index: int):
    self.out, self.stream, self.dtype = out, stream, np.dtype(spec.dtype)
    self.name = f"{stream}-{index:05d}"
    self._digest = hashlib.blake2b(digest_size=16)
    done = os.path.join(out, _DONE, f"{self.name}.json")
    self.record = read_json(done) if os.path.isfile(done) else None
    self._splits: dict[str, dict[str, Any]] = {}
    if self.record is not None:
      return
    splits = ("eval",) if stream == "eval" else ("train", "eval") if spec.eval_fraction > 0 else ("train",)
    prefix = "" if stream == "main" else "held-"
    for split in splits:
      name = f"{split}-{prefix}{index:05d}"
      file = open(os.path.join(out, f"{name}.tokens.npy.tmp"), "wb")
      header = file.write(_npy_header(self.dtype, 0))
      self._splits[split] = {"name": name, "file": file, "header": header, "sha256": hashlib.sha256(), "tokens": 0,
                             "bytes": 0, "ends": []}

  def read(self, piece: dict[str, Any]) -> dict[str, Any]:
    """Adds the piece's documents to the shard's digest (which a rerun checks a finished shard against)."""
    for text in piece["documents"]:
      data = text.encode("utf-8")
      self._digest.update(len(data).to_bytes(8, "little"))  # length prefix: ["ab", "c"] and ["a", "bc"] differ
      self._digest.update(data)
    return piece

  def append(self, result: dict[str, Any]) -> None:
    """Appends a tokenized piece (tokenize_piece's result)."""
    for split, (tokens, lengths, size) in result.items():
      target = self._splits[split]
      target["file"].write(memoryview(tokens))
      target["sha256"].update(memoryview(tokens))
      target["ends"].append(target["tokens"] + np.cumsum(lengths, dtype=np.uint64))
      target["tokens"] += int(tokens.size)
      target["bytes"] += size

  def finish(self) -> dict[str, Any]:
    """Renames the files into place and records the shard in `.done/`; returns the record."""
    digest = self._digest.hexdigest()
    if self.record is not None:
      if self.record["digest"] != digest:
        raise ValueError(f"shard {self.name} of {self.out!r} was prepared from other documents; the inputs changed "
                         f"since the interrupted prepare: delete {self.out!r} and prepare again")
      return self.record
    shards = []
    for split, target in self._splits.items():
      name, file = target["name"], target["file"]
      header = _npy_header(self.dtype, target["tokens"])
      if len(header) != target["header"]:  # numpy pads a 1-D header to one size whatever the length
        raise RuntimeError(f"numpy's .npy header for {target['tokens']} tokens changed size; use numpy >= 1.26")
      file.seek(0)
      file.write(header)
      file.close()
      tokens_path = os.path.join(self.out, f"{name}.tokens.npy")
      os.replace(f"{tokens_path}.tmp", tokens_path)
      ends = np.concatenate(target["ends"]) if target["ends"] else np.zeros(0, np.uint64)
      _save_npy(os.path.join(self.out, f"{name}.ends.npy"), ends)
      shards.append({"name": name, "split": split, "tokens_file": f"{name}.tokens.npy",
                     "ends_file": f"{name}.ends.npy", "tokens": target["tokens"], "documents": int(ends.size),
                     "bytes": target["bytes"], "sha256": target["sha256"].hexdigest()})
    self.record = {"digest": digest, "shards": shards}
    write_json(os.path.join(self.out, _DONE, f"{self.name}.json"), self.record)
    return self.record


def _npy_header(dtype: np.dtype, length: int) -> bytes:
  """The header np.save writes for a 1-D array of `length` elements of `dtype`."""
  header = io.BytesIO()
  np.lib.format.write_array_header_1_0(header, {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
                                                "shape": (length,)})
  return header.getvalue()


_WORKER_TOKENIZER = None


def _start_worker(tokenizer_path: str, threads: int) -> None:
  global _WORKER_TOKENIZER
  os.environ["RAYON_NUM_THREADS"] = str(threads)  # the tokenizer's thread pool starts on first use, after this
  _WORKER_TOKENIZER = _load_tokenizer_file(tokenizer_path)


def _load_tokenizer(out: str):
  return _load_tokenizer_file(os.path.join(out, TOKENIZER))


def _load_tokenizer_file(path: str):
  import tokenizers

  return tokenizers.Tokenizer.from_file(path)


def tokenize_shard(job: dict[str, Any], tokenizer: Any) -> dict[str, Any]:
  """Tokenizes one shard in this process: its `job["pieces"]` (`_work` dicts) into `job["writer"]` (a ShardWriter);
  returns the record kept in `.done/` and the manifest."""
  for piece in job["pieces"]:
    job["writer"].append(tokenize_piece(piece, tokenizer))
  return job["writer"].finish()


def tokenize_piece(piece: dict[str, Any], tokenizer: Any = None) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
  """One piece's documents tokenized: per split, (each document's tokens then EOS, one array; each document's length
  with its EOS; the documents' UTF-8 bytes)."""
  tokenizer = tokenizer or _WORKER_TOKENIZER
  encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # fast: no character offsets
  dtype, eos, fraction = np.dtype(piece["dtype"]), piece["eos_id"], piece["eval_fraction"]
  documents = piece["documents"]
  ids = [encoding.ids for encoding in encode(documents, add_special_tokens=False)]  # the Encodings go at once
  splits: dict[str, list[int]] = {}
  for number in range(len(documents)):
    split = "eval" if piece["stream"] == "eval" or held_out(piece["first"] + number, fraction) else "train"
    splits.setdefault(split, []).append(number)
  result = {}
  for split, numbers in splits.items():
    lengths = np.asarray([len(ids[n]) + 1 for n in numbers], dtype=np.uint64)
    tokens = np.empty(int(lengths.sum()), dtype=dtype)
    position = 0
    for n in numbers:
      tokens[position:position + len(ids[n])] = ids[n]
      position += len(ids[n])
      tokens[position] = eos
      position += 1
    result[split] = (tokens, lengths, sum(len(documents[n].encode("utf-8")) for n in numbers))
  return result


def _save_npy(path: str, array: np.ndarray) -> None:
  tmp = f"{path}.tmp"
  with open(tmp, "wb") as f:
    np.save(f, array, allow_pickle=False)
  os.replace(tmp, path)


def read_json(path: str) -> Any:
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def write_json(path: str, value: Any) -> None:
  """Writes JSON atomically (a temporary file renamed into place), so a reader never sees half a file."""
  tmp = f"{path}.tmp-{os.getpid()}"
  with open(tmp, "w", encoding="utf-8") as f:
    json.dump(value, f, indent=1)
  os.replace(tmp, path)
