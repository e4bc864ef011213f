"""Foreign shards: index token files that another tool already wrote (llm.c, datatrove) as a prepared folder.

Tokenizing a corpus again that llm.c or datatrove already tokenized costs hours and a second copy on disk, so
`index_prepared` leaves the files where they are and writes a prepared folder (prepare.py's format) that points at
them: manifest.json lists each file by absolute path with the byte `offset` of its first token (shards.py reads it
from there), and only the document ends are written, into the folder:

  llm.c (.bin)       a header of 256 little-endian int32 (magic 20240520, version 1: uint16 GPT-2 tokens, version 2:
                     uint32 tokens such as Llama 3's, then the token count), the tokens from byte 1024. llm.c writes
                     every document as [separator, its tokens...] (50256 <|endoftext|> for version 1, 128000
                     <|begin_of_text|> for version 2), so the separator stands between documents. Here a document
                     ends right after each separator, and the file's last tokens end one too: `EOT a b EOT c d EOT e`
                     is [EOT] [a b EOT] [c d EOT] [e]. Each document then ends with the separator, as a prepared
                     document ends with its EOS; the leading separator is a one-token document, and a document that
                     llm.c cut at the file's end is two documents, one in each file.
  datatrove (.ds)    the raw tokens (uint16, or uint32 when .ds.metadata's first line ends in "|4"; without it, the
                     file's size over the index's token count says which) beside .ds.index, the documents' ends as
                     little-endian uint64 token positions (DocumentTokenizer's TokenizedFile), used as they are.
                     DocumentTokenizer appends the EOS to every document, so the token they all end with is the EOS.

Indexing reads each file once, in chunks (memory stays flat for multi-GB files), for the document ends, the largest
id (the vocabulary size, without a tokenizer) and a sha256 of the token bytes; `verify` re-reads any prepared folder
against those checksums. Text bytes are unknown here, so the manifest's `bytes` are 0.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jaxlm.data import tokenizer as tokenizer_lib
from jaxlm.data.corpora import prepare, shards

LLMC_MAGIC = 20240520
LLMC_HEADER_BYTES = 256 * 4
LLMC_SEPARATORS = {1: 50256, 2: 128000}  # GPT-2's <|endoftext|>, Llama 3's <|begin_of_text|>
_LLMC_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
_CHUNK = 64 << 20  # tokens read at a time


def detect(path: str) -> str | None:
  """"llmc" for an llm.c token shard, "datatrove" for a datatrove .ds file beside its .ds.index, else None."""
  if path.endswith(".ds") and os.path.isfile(path) and os.path.isfile(f"{path}.index"):
    return "datatrove"
  if os.path.isfile(path) and os.path.getsize(path) >= LLMC_HEADER_BYTES:
    header = np.fromfile(path, "<i4", count=3)
    if header[0] == LLMC_MAGIC and int(header[1]) in _LLMC_DTYPES:
      return "llmc"
  return None


def index_prepared(train_paths: Sequence[str], eval_paths: Sequence[str], out: str, tokenizer: str = "",
                   eos_id: int | None = None) -> dict[str, Any]:
  """Writes the prepared folder `out` over the llm.c or datatrove files, in place; returns its manifest.

  `tokenizer` (a tokenizer.json or a folder holding one) is copied into `out` and gives the vocabulary size;
  without it the vocabulary is the largest id + 1. `eos_id` replaces the format's separator (llm.c) or the token
  every document ends with (datatrove; where they differ, the tokenizer's EOS). A finished `out` indexed from the
  same inputs is returned as it is.
  """
  if not train_paths:
    raise ValueError("no pre-tokenized files to train on: give --input=<.bin or .ds files>")
  if not eval_paths:
    raise ValueError("pre-tokenized inputs need held-out files of their own: give --eval_input (e.g. llm.c's "
                     "fineweb_val_000000.bin)")
  kinds = {path: detect(path) for path in [*train_paths, *eval_paths]}
  unknown = [path for path, kind in kinds.items() if kind is None]
  if unknown:
    raise ValueError(f"{unknown[0]!r} is neither an llm.c .bin shard nor a datatrove .ds file beside its .ds.index")
  if len(set(kinds.values())) > 1:
    raise ValueError(f"the inputs mix formats ({', '.join(sorted(set(kinds.values())))}); index one format per folder")
  kind = next(iter(kinds.values()))
  layouts = {path: _layout(path, kind) for path in kinds}
  dtypes = {layout["dtype"].name for layout in layouts.values()}
  if len(dtypes) > 1:
    raise ValueError(f"the inputs mix token sizes ({', '.join(sorted(dtypes))}); index one tokenizer's files per "
                     f"folder")
  tokenizer_json = None
  if tokenizer:
    loaded = tokenizer_lib.load_tokenizer(tokenizer)
    tokenizer_json = loaded.to_str()  # as prepare_data.py writes it, so both folders hash one tokenizer alike
  spec = {"tokenizer_sha256": tokenizer_json and hashlib.sha256(tokenizer_json.encode()).hexdigest(),
          "eos_id": eos_id, "dtype": dtypes.pop(), "eval_fraction": 0.0,
          "inputs": {"format": kind, "inputs": [os.path.abspath(p) for p in train_paths],
                     "eval_inputs": [os.path.abspath(p) for p in eval_paths]}}
  manifest_path = os.path.join(out, prepare.MANIFEST)
  if os.path.isfile(manifest_path):
    manifest = prepare.read_json(manifest_path)
    if manifest.get("spec") == spec:
      return manifest
    raise ValueError(f"{out!r} holds a corpus prepared from other inputs; choose another output folder or delete it")
  os.makedirs(out, exist_ok=True)

  separator = eos_id
  if separator is None and kind == "llmc":
    separator = LLMC_SEPARATORS[next(iter(layouts.values()))["version"]]
  listed, last_tokens, max_id = [], set(), -1
  for split, paths in (("train", train_paths), ("eval", eval_paths)):
    for number, path in enumerate(paths):
      layout = layouts[path]
      scan = _scan(path, layout, separator)
      name = f"{split}-{number:05d}"
      prepare._save_npy(os.path.join(out, f"{name}.ends.npy"), scan["ends"])
      listed.append({"name": name, "split": split, "tokens_file": os.path.abspath(path), "offset": layout["offset"],
                     "ends_file": f"{name}.ends.npy", "tokens": layout["tokens"], "documents": int(scan["ends"].size),
                     "bytes": 0, "sha256": scan["sha256"]})
      last_tokens |= scan["last_tokens"]
      max_id = max(max_id, scan["max_id"])
  if separator is None:  # datatrove appends the tokenizer's EOS to every document: the one token they all end with
    if len(last_tokens) == 1:
      separator = last_tokens.pop()
    elif tokenizer_json is not None:
      separator = tokenizer_lib.eos_id(loaded)
    else:
      raise ValueError("the documents do not all end with one token, so their end-of-document id is unknown; give "
                       "--eos_id or --tokenizer")
  vocab_size = max_id + 1
  if tokenizer_json is not None:
    vocab_size = loaded.get_vocab_size(with_added_tokens=True)
    if max_id >= vocab_size:
      raise ValueError(f"the files hold token id {max_id} but the tokenizer {tokenizer!r} has {vocab_size} ids; "
                       f"give the tokenizer that wrote them")
    with open(os.path.join(out, prepare.TOKENIZER), "w", encoding="utf-8") as f:
      f.write(tokenizer_json)
  splits = {split: {"documents": sum(s["documents"] for s in listed if s["split"] == split),
                    "tokens": sum(s["tokens"] for s in listed if s["split"] == split), "bytes": 0}
            for split in ("train", "eval")}
  manifest = {
      "format": prepare.FORMAT, "version": prepare.VERSION, "dtype": spec["dtype"], "eos_id": int(separator),
      "vocab_size": int(vocab_size), "tokenizer": prepare.TOKENIZER if tokenizer_json is not None else None,
      "tokenizer_sha256": spec["tokenizer_sha256"], "documents": sum(v["documents"] for v in splits.values()),
      "tokens": sum(v["tokens"] for v in splits.values()), "bytes": 0, "splits": splits, "eval_fraction": 0.0,
      "read": {}, "capped": "", "spec": spec, "shards": listed,
  }
  prepare.write_json(manifest_path, manifest)  # last: a folder with a manifest is complete
  return manifest


def verify(folder: str) -> list[str]:
  """Re-reads every shard of a prepared folder (prepared or indexed); one line per shard whose token count, sha256
  or document ends differ from its manifest. Empty: every shard is as it was prepared."""
  manifest = shards.read_manifest(folder)
  problems = []
  for shard in manifest["shards"]:
    path = shards._path(folder, shard["tokens_file"])
    label = f"{folder}: shard {shard['name']} ({path})"
    if not os.path.isfile(path):
      problems.append(f"{label} is missing")
      continue
    if path.endswith(".npy"):
      array = np.load(path, mmap_mode="r", allow_pickle=False)
      dtype, offset, count = array.dtype, int(array.offset), int(array.size)
      del array
    else:
      dtype, offset = np.dtype(manifest["dtype"]).newbyteorder("<"), int(shard.get("offset", 0))
      count = (os.path.getsize(path) - offset) // dtype.itemsize
    if count != shard["tokens"]:
      problems.append(f"{label} holds {count} tokens; the manifest says {shard['tokens']}")
      continue
    digest = hashlib.sha256()
    for _, chunk in _chunks(path, dtype, offset, count):
      digest.update(chunk)
    if digest.hexdigest() != shard["sha256"]:
      problems.append(f"{label} has changed since it was prepared: its sha256 differs from the manifest's")
      continue
    ends_path = shards._path(folder, shard["ends_file"])
    ends = np.load(ends_path, allow_pickle=False) if os.path.isfile(ends_path) else None
    if ends is None or ends.size != shard["documents"] or (ends.size and int(ends[-1]) != count):
      problems.append(f"{label}: its document ends {shard['ends_file']} are missing or do not match the manifest")
  return problems


def _layout(path: str, kind: str) -> dict[str, Any]:
  """Where the tokens of `path` lie: dtype, byte offset, token count (and llm.c's version, datatrove's ends)."""
  size = os.path.getsize(path)
  if kind == "llmc":
    version, tokens = (int(v) for v in np.fromfile(path, "<i4", count=3)[1:])
    dtype = _LLMC_DTYPES[version]
    if size != LLMC_HEADER_BYTES + tokens * dtype.itemsize:
      raise ValueError(f"{path!r}: its header says {tokens} {dtype.name} tokens, which take "
                       f"{LLMC_HEADER_BYTES + tokens * dtype.itemsize} bytes, but the file has {size}; it is "
                       f"truncated or was not written by llm.c")
    return {"dtype": dtype, "offset": LLMC_HEADER_BYTES, "tokens": tokens, "version": version}
  ends = np.fromfile(f"{path}.index", "<u8")
  tokens = int(ends[-1]) if ends.size else 0
  itemsize = _datatrove_token_size(path) or (size // tokens if tokens else 2)
  if itemsize not in (2, 4) or size != tokens * itemsize or np.any(np.diff(ends.astype(np.int64)) < 0):
    raise ValueError(f"{path!r} ({size} bytes) does not match its .index ({ends.size} documents, {tokens} tokens of "
                     f"{itemsize} bytes); the pair is incomplete or was not written by datatrove")
  return {"dtype": np.dtype(f"<u{itemsize}"), "offset": 0, "tokens": tokens, "ends": ends.astype(np.uint64)}


def _datatrove_token_size(path: str) -> int | None:
  """The token size that .ds.metadata names ("<tokenizer>|<bytes>" on its first line; older datatrove wrote only
  the tokenizer's name, and uint16 tokens), or None."""
  metadata = f"{path}.metadata"
  if not os.path.isfile(metadata):
    return None
  with open(metadata, encoding="utf-8") as f:
    first = f.readline().strip()
  size = first.rsplit("|", 1)[-1] if "|" in first else ""
  return int(size) if size in ("2", "4") else None


def _scan(path: str, layout: dict[str, Any], separator: int | None) -> dict[str, Any]:
  """One pass over a file: its document ends, sha256, largest id and the distinct tokens documents end with (at
  most two are kept: more than one is enough to know that they differ)."""
  digest, max_id, found = hashlib.sha256(), -1, []
  ends = layout.get("ends")
  last_tokens: set[int] = set()
  for start, chunk in _chunks(path, layout["dtype"], layout["offset"], layout["tokens"]):
    digest.update(chunk)
    max_id = max(max_id, int(chunk.max()))
    if ends is None:
      found.append(np.flatnonzero(chunk == separator).astype(np.uint64) + np.uint64(start + 1))
    elif len(last_tokens) < 2:
      inside = ends[(ends > start) & (ends <= start + chunk.size)].astype(np.int64) - start - 1
      last_tokens.update(int(t) for t in np.unique(chunk[inside])[:2])
  if ends is None:
    ends = np.concatenate(found) if found else np.zeros(0, np.uint64)
    if layout["tokens"] and (not ends.size or int(ends[-1]) != layout["tokens"]):
      ends = np.append(ends, np.uint64(layout["tokens"]))  # the file's last document has no separator after it
  return {"ends": ends, "sha256": digest.hexdigest(), "max_id": max_id, "last_tokens": last_tokens}


def _chunks(path: str, dtype: np.dtype, offset: int, count: int) -> Iterator[tuple[int, np.ndarray]]:
  """(first token's index, tokens) for the `count` tokens of `path` from byte `offset`, _CHUNK at a time."""
  with open(path, "rb") as f:
    f.seek(offset)
    for start in range(0, count, _CHUNK):
      want = min(_CHUNK, count - start)
      data = f.read(want * dtype.itemsize)
      if len(data) != want * dtype.itemsize:
        raise ValueError(f"{path!r} ended after {start + len(data) // dtype.itemsize} of {count} tokens")
      yield start, np.frombuffer(data, dtype)
