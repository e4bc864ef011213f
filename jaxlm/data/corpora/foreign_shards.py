"""Foreign shards: index token files that another tool already wrote (llm.c, datatrove) as a prepared folder.

Tokenizing a corpus again that llm.c or datatrove already tokenized costs hours and a second copy on disk, so
`index_prepared` leaves the files where they are and writes a prepared folder (prepare.py's format) that points at
them: manifest.json lists each file by absolute path with the byte `offset` of its first token (shards.py reads it
from there), and only the document ends are written, into the folder:

  llm.c (.bin)       a header of 256 little-endian int32 (magic, version, token count), the tokens from byte 1024.
                     llm.c writes two formats (its HEADERS_INFO): gpt-2, magic 20240520 version 1, uint16
                     tokens, every document preceded by <|endoftext|> (50256); llama-3, magic 20240801 version 7,
                     uint32 tokens, every document preceded by <|begin_of_text|> (128000). The separator joins the
                     document its name says it belongs to, so that each segment reads as a prepared document does:
                     gpt-2's end-of-text closes the document before it (`EOT a b EOT c d EOT e` is [EOT] [a b EOT]
                     [c d EOT] [e]: the leading EOT is a one-token document), llama-3's begin-of-text opens the one
                     after it (`BOS a b BOS c` is [BOS a b] [BOS c]). A document that llm.c cut at a file's end is
                     two documents, one in each file. A .bin with another header is an error naming its magic and
                     version, never taken for text.
  datatrove (.ds)    the raw tokens (uint16, or uint32 when .ds.metadata's first line ends in "|4"; without it, the
                     file's size over the index's token count says which) beside .ds.index, the documents' ends as
                     little-endian uint64 token positions (DocumentTokenizer's TokenizedFile), used as they are.
                     DocumentTokenizer appends an EOS to each document only when it was given `eos_token`, so the
                     manifest's eos_id is --eos_id; else the one token every document ends with (that eos_token)
                     when the tokenizer, if given, calls it special; else the tokenizer's EOS; else that common
                     token all the same; else an error asking for --eos_id or --tokenizer.

Indexing reads each file once, in chunks (memory stays flat for multi-GB files), for the document ends, the largest
id (the vocabulary size, without a tokenizer) and a sha256 of the token bytes; `verify` re-reads any prepared folder
against those checksums. Text bytes are unknown here, so the manifest's `bytes` are 0.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from jaxlm.data import tokenizer as tokenizer_lib
from jaxlm.data.corpora import prepare, shards

LLMC_HEADER_BYTES = 256 * 4


@dataclasses.dataclass(frozen=True)
class LlmcFormat:
  """One of llm.c's shard formats: its name, token dtype, the separator written before every document, and whether
  that separator ends the document before it (end-of-text) or starts the one after it (begin-of-text)."""
  name: str
  dtype: np.dtype
  separator: int
  separator_ends: bool


# (magic, version) of llm.c's headers (its HEADERS_INFO) -> the format.
LLMC_FORMATS = {
    (20240520, 1): LlmcFormat("gpt-2", np.dtype("<u2"), 50256, separator_ends=True),  # <|endoftext|>
    (20240801, 7): LlmcFormat("llama-3", np.dtype("<u4"), 128000, separator_ends=False),  # <|begin_of_text|>
}
_CHUNK = 64 << 20  # tokens read at a time


def detect(path: str) -> str | None:
  """"llmc" for an llm.c token shard, "datatrove" for a datatrove .ds file beside its .ds.index, else None (text).
  A .bin file, or one with an llm.c magic, whose header is not a format here raises a one-line error."""
  if path.endswith(".ds") and os.path.isfile(path) and os.path.isfile(f"{path}.index"):
    return "datatrove"
  if not os.path.isfile(path):
    return None
  magic, version = _llmc_header(path)
  if (magic, version) in LLMC_FORMATS:
    return "llmc"
  if path.endswith(".bin") or magic in {m for m, _ in LLMC_FORMATS}:
    if version is None:
      raise ValueError(f"{path!r} holds {os.path.getsize(path)} bytes, too few for an llm.c shard header")
    known = ", ".join(f"{f.name} (magic {m}, version {v})" for (m, v), f in LLMC_FORMATS.items())
    raise ValueError(f"{path!r}: magic {magic}, version {version}: not an llm.c shard header this jaxlm reads; it "
                     f"reads llm.c's {known}")
  return None


def _llmc_header(path: str) -> tuple[int | None, int | None]:
  """The first two int32 of `path` (llm.c's magic and version); None for what the file is too short to hold."""
  with open(path, "rb") as f:
    head = f.read(8)
  values = [int(v) for v in np.frombuffer(head[:len(head) // 4 * 4], "<i4")]
  return (values + [None, None])[0], (values + [None, None])[1]


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

  separator, llmc = eos_id, None
  if kind == "llmc":
    llmc = next(iter(layouts.values()))["format"]
    separator = llmc.separator if eos_id is None else eos_id
  listed, last_tokens, max_id = [], set(), -1
  for split, paths in (("train", train_paths), ("eval", eval_paths)):
    for number, path in enumerate(paths):
      layout = layouts[path]
      scan = _scan(path, layout, separator, separator_ends=llmc is None or llmc.separator_ends)
      name = f"{split}-{number:05d}"
      prepare._save_npy(os.path.join(out, f"{name}.ends.npy"), scan["ends"])
      listed.append({"name": name, "split": split, "tokens_file": os.path.abspath(path), "offset": layout["offset"],
                     "ends_file": f"{name}.ends.npy", "tokens": layout["tokens"], "documents": int(scan["ends"].size),
                     "bytes": 0, "sha256": scan["sha256"]})
      last_tokens |= scan["last_tokens"]
      max_id = max(max_id, scan["max_id"])
  if separator is None:
    separator = _datatrove_eos(last_tokens, loaded if tokenizer_json is not None else None)
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


def _datatrove_eos(last_tokens: set[int], tokenizer: Any) -> int:
  """The end-of-document id of datatrove files. DocumentTokenizer appends its eos_token only when given one, so the
  token every document ends with is taken when the tokenizer (if given) calls it special; else the tokenizer's EOS;
  else that common token all the same; else an error."""
  common = next(iter(last_tokens)) if len(last_tokens) == 1 else None
  special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special} if tokenizer else set()
  if common is not None and (tokenizer is None or common in special):
    return common
  if tokenizer is not None:
    try:
      return tokenizer_lib.eos_id(tokenizer)
    except ValueError:
      if common is None:
        raise
  if common is None:
    raise ValueError("the documents do not all end with one token (datatrove appends one only when DocumentTokenizer "
                     "was given eos_token), so their end-of-document id is unknown; give --eos_id or --tokenizer")
  return common


def _layout(path: str, kind: str) -> dict[str, Any]:
  """Where the tokens of `path` lie: dtype, byte offset, token count (and llm.c's format, datatrove's ends)."""
  size = os.path.getsize(path)
  if kind == "llmc":
    if size < LLMC_HEADER_BYTES:
      raise ValueError(f"{path!r} holds {size} bytes, fewer than llm.c's {LLMC_HEADER_BYTES}-byte header; it is "
                       f"truncated")
    magic, version, tokens = (int(v) for v in np.fromfile(path, "<i4", count=3))
    llmc = LLMC_FORMATS[magic, version]
    dtype = llmc.dtype
    if size != LLMC_HEADER_BYTES + tokens * dtype.itemsize:
      raise ValueError(f"{path!r}: its header says {tokens} {dtype.name} tokens, which take "
                       f"{LLMC_HEADER_BYTES + tokens * dtype.itemsize} bytes, but the file has {size}; it is "
                       f"truncated or was not written by llm.c")
    return {"dtype": dtype, "offset": LLMC_HEADER_BYTES, "tokens": tokens, "format": llmc}
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


def _scan(path: str, layout: dict[str, Any], separator: int | None, separator_ends: bool = True) -> dict[str, Any]:
  """One pass over a file: its document ends, sha256, largest id and the distinct tokens documents end with (at
  most two are kept: more than one is enough to know that they differ). Without the layout's ends (llm.c) a
  document ends after each separator (`separator_ends`) or before each one (the separator starts a document)."""
  digest, max_id, found = hashlib.sha256(), -1, []
  ends = layout.get("ends")
  last_tokens: set[int] = set()
  for start, chunk in _chunks(path, layout["dtype"], layout["offset"], layout["tokens"]):
    digest.update(chunk)
    max_id = max(max_id, int(chunk.max()))
    if ends is None:
      found.append(np.flatnonzero(chunk == separator).astype(np.uint64) + np.uint64(start + separator_ends))
    elif len(last_tokens) < 2:
      inside = ends[(ends > start) & (ends <= start + chunk.size)].astype(np.int64) - start - 1
      last_tokens.update(int(t) for t in np.unique(chunk[inside])[:2])
  if ends is None:
    ends = np.concatenate(found) if found else np.zeros(0, np.uint64)
    ends = ends[ends > 0]  # a file that opens with a begin-of-text separator: no empty document before it
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
