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
workers write the same files. With an eval fraction f, every 1/f-th document of the stream is held out (`held_out`),
decided by its place in reading order: reproducible, and the same for any number of workers. An interrupted prepare,
run again, skips the shards it finished (each is written to a temporary name, renamed, then recorded in `.done/`);
the manifest is written last.

Why not datatrove's tokenization step, which HF prepares FineWeb with: its shards follow its tasks (one output per
task and input file), so the files depend on how the job was split; here they depend on the documents alone.
"""

from __future__ import annotations

import concurrent.futures as futures
import dataclasses
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import shutil
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
_ENCODE_BYTES = 4 << 20  # text per encode_batch call: big enough to keep its threads busy, small enough to bound
                        # the memory of its Encoding objects
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


def _batches(documents: Iterable[str], shard_bytes: int) -> Iterator[list[str]]:
  batch, size = [], 0
  for text in documents:
    batch.append(text)
    size += len(text)  # characters: a cheap, deterministic proxy for bytes
    if size >= shard_bytes:
      yield batch
      batch, size = [], 0
  if batch:
    yield batch


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

  jobs = _jobs(streams, out, spec, shard_bytes)
  ahead = list(itertools.islice(jobs, 2))
  jobs = itertools.chain(ahead, jobs)
  if workers == 1 or len(ahead) < 2:  # one shard: worker processes would only add their start-up
    tokenizer = _load_tokenizer(out)
    for job in jobs:
      finished(job if "shards" in job else tokenize_shard(job, tokenizer))
  else:
    context = multiprocessing.get_context("spawn")  # no fork: the parent may hold JAX's threads
    threads = max(1, (os.cpu_count() or 1) // workers)
    with futures.ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker,
                                     initargs=(os.path.join(out, TOKENIZER), threads)) as pool:
      pending: list[futures.Future] = []
      for job in jobs:
        if "shards" in job:  # finished by an earlier, interrupted prepare
          finished(job)
          continue
        pending.append(pool.submit(tokenize_shard, job))
        while len(pending) >= 2 * workers:  # bounded: the reader never runs ahead by more than a few shards
          finished(pending.pop(0).result())
      for future in pending:
        finished(future.result())
  bar.close()
  return results


def _jobs(streams, out: str, spec: Spec, shard_bytes: int) -> Iterator[dict[str, Any]]:
  for stream, documents in streams:
    first = 0  # the stream's index of the batch's first document
    for index, batch in enumerate(_batches(documents, shard_bytes)):
      first += len(batch)
      digest = _digest(batch)
      name = f"{stream}-{index:05d}"
      done = os.path.join(out, _DONE, f"{name}.json")
      if os.path.isfile(done):
        record = read_json(done)
        if record["digest"] == digest:
          yield record
          continue
        raise ValueError(f"shard {name} of {out!r} was prepared from other documents; the inputs changed since the "
                         f"interrupted prepare: delete {out!r} and prepare again")
      yield {"stream": stream, "index": index, "documents": batch, "first": first - len(batch), "digest": digest,
             "out": out,
             "dtype": spec.dtype, "eos_id": spec.eos_id, "eval_fraction": spec.eval_fraction}


def _digest(batch: list[str]) -> str:
  digest = hashlib.blake2b(digest_size=16)
  for text in batch:
    data = text.encode("utf-8")
    digest.update(len(data).to_bytes(8, "little"))  # length prefix: ["ab", "c"] and ["a", "bc"] differ
    digest.update(data)
  return digest.hexdigest()


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


def tokenize_shard(job: dict[str, Any], tokenizer: Any = None) -> dict[str, Any]:
  """Tokenizes one batch of documents into its shard files; returns the record kept in `.done/` and the manifest."""
  tokenizer = tokenizer or _WORKER_TOKENIZER
  encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # fast: no character offsets
  dtype, eos = np.dtype(job["dtype"]), job["eos_id"]
  outputs: dict[str, dict[str, list]] = {}
  splits = ("eval",) if job["stream"] == "eval" else ("train", "eval") if job["eval_fraction"] > 0 else ("train",)
  for split in splits:
    outputs[split] = {"tokens": [], "lengths": [], "bytes": [0]}
  documents = job["documents"]
  start = 0
  while start < len(documents):
    stop, size = start, 0
    while stop < len(documents) and (size < _ENCODE_BYTES or stop == start):
      size += len(documents[stop])
      stop += 1
    texts = documents[start:stop]
    encodings = encode(texts, add_special_tokens=False)
    for number, (text, encoding) in enumerate(zip(texts, encodings), job["first"] + start):
      split = "eval" if job["stream"] == "eval" or held_out(number, job["eval_fraction"]) else "train"
      ids = np.empty(len(encoding.ids) + 1, dtype=dtype)
      ids[:-1] = encoding.ids
      ids[-1] = eos
      target = outputs[split]
      target["tokens"].append(ids)
      target["lengths"].append(len(ids))
      target["bytes"][0] += len(text.encode("utf-8"))
    start = stop
  number = f"{job['index']:05d}"
  prefix = "" if job["stream"] == "main" else "held-"
  shards = []
  for split, target in outputs.items():
    tokens = np.concatenate(target["tokens"]) if target["tokens"] else np.zeros(0, dtype)
    ends = np.cumsum(np.asarray(target["lengths"], dtype=np.uint64), dtype=np.uint64)
    name = f"{split}-{prefix}{number}"
    _save_npy(os.path.join(job["out"], f"{name}.tokens.npy"), tokens)
    _save_npy(os.path.join(job["out"], f"{name}.ends.npy"), ends)
    shards.append({"name": name, "split": split, "tokens_file": f"{name}.tokens.npy", "ends_file": f"{name}.ends.npy",
                   "tokens": int(tokens.size), "documents": int(ends.size), "bytes": target["bytes"][0],
                   "sha256": hashlib.sha256(tokens.tobytes()).hexdigest()})
  record = {"digest": job["digest"], "shards": shards}
  write_json(os.path.join(job["out"], _DONE, f"{job['stream']}-{number}.json"), record)
  return record


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
