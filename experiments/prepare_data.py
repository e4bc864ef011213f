"""Prepare a corpus for pretraining: tokenize it once, in parallel, into token shards and a manifest.

  python experiments/prepare_data.py --input='data/*.jsonl.zst' --tokenizer=<tokenizer.json or HF folder> \
      --out=corpora/mine [--workers=N] [--eval_fraction=0.001 | --eval_input=held_out.jsonl]
  python experiments/prepare_data.py --hf_name=<dataset or local folder> --hf_split=train --tokenizer=... --out=...
  python experiments/prepare_data.py --input='fineweb_train_*.bin' --eval_input=fineweb_val_000000.bin --out=...
  python experiments/train_lm.py --config=experiments/configs/gpt2_small.py --config.data.source=prepared \
      --config.data.prepared=corpora/mine --workdir=runs/x

Inputs: .txt, .jsonl, .json, .parquet (text ones may be .gz/.zst/.bz2/.lz4 compressed), an HF dataset (streamed),
or files another tool already tokenized (llm.c's .bin shards, datatrove's .ds files), which are indexed in place,
not tokenized again. Running the same command again after an interruption resumes; on a finished folder it only
prints the summary. --verify re-reads every shard and checks it against the manifest's checksums.
"""

import glob
import os
import time

from absl import flags

from jaxlm import cli
from jaxlm.config import DataConfig
from jaxlm.data import tokenizer as tokenizer_lib
from jaxlm.data.corpora import foreign_shards, prepare, sources

_INPUT = flags.DEFINE_multi_string("input", [], "file or glob of documents (repeatable)")
_EVAL_INPUT = flags.DEFINE_multi_string("eval_input", [], "file or glob of held-out documents (repeatable); "
                                        "instead of --eval_fraction")
_HF_NAME = flags.DEFINE_string("hf_name", "", "HF dataset name or local dataset folder, streamed (instead of --input)")
_HF_CONFIG = flags.DEFINE_string("hf_config", "", "HF dataset config name, if any")
_HF_SPLIT = flags.DEFINE_string("hf_split", "train", "HF split to read")
_TEXT_COLUMN = flags.DEFINE_string("text_column", "text", "column holding the text (JSONL, Parquet, HF)")
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "a tokenizer.json or an HF checkpoint folder holding one")
_OUT = flags.DEFINE_string("out", None, "folder for the shards and manifest.json")
_WORKERS = flags.DEFINE_integer("workers", 0, "tokenizer processes (0 = one per core)")
_EVAL_FRACTION = flags.DEFINE_float("eval_fraction", 0.001, "share of documents held out for eval (evenly spaced "
                                    "in reading order); ignored with --eval_input")
_SHARD_MB = flags.DEFINE_integer("shard_mb", 32, "text per shard, in millions of characters")
_MAX_DOCUMENTS = flags.DEFINE_integer("max_documents", 0, "cap on documents read (0 = no cap)")
_MAX_BYTES = flags.DEFINE_integer("max_bytes", 0, "cap on bytes of text read (0 = no cap)")
_EOS_ID = flags.DEFINE_integer("eos_id", None, "pre-tokenized inputs: the document separator's id (default: the "
                               "format's, e.g. 50256 for llm.c's GPT-2 shards)")
_VERIFY = flags.DEFINE_bool("verify", False, "check every shard of --out against its manifest checksum and exit")
flags.mark_flags_as_required(["out"])


def main(argv):
  del argv  # flags only: cli.run refuses positional arguments
  out = _OUT.value
  if _VERIFY.value:
    problems = foreign_shards.verify(out)
    print("\n".join(problems) if problems else f"{out}: every shard matches its checksum")
    return 1 if problems else 0
  started = time.time()
  inputs, eval_inputs = _expand(_INPUT.value, "--input"), _expand(_EVAL_INPUT.value, "--eval_input")
  if bool(inputs) == bool(_HF_NAME.value):
    raise ValueError("give the documents with --input=<file or glob> or --hf_name=<dataset>, one of the two")
  kinds = [foreign_shards.detect(p) for p in inputs + eval_inputs]
  if any(kinds):
    if not all(kinds):
      text = next(p for p, kind in zip(inputs + eval_inputs, kinds) if not kind)
      raise ValueError(f"{text!r} is not a pre-tokenized shard like the other inputs; give tokenized shards (llm.c "
                       f".bin, datatrove .ds) or text, not both, and no .ds.index/.ds.metadata files in the globs")
    ignored = [f"--{f.name}" for f in (_EVAL_FRACTION, _MAX_DOCUMENTS, _MAX_BYTES, _WORKERS, _HF_NAME, _SHARD_MB)
               if flags.FLAGS[f.name].present]
    if ignored:
      raise ValueError(f"{', '.join(ignored)} apply to text only; pre-tokenized shards are indexed in place as they "
                       f"are (give the held-out shards with --eval_input)")
    manifest = foreign_shards.index_prepared(inputs, eval_inputs, out, tokenizer=_TOKENIZER.value,
                                             eos_id=_EOS_ID.value)
  else:
    manifest = _tokenize(inputs, eval_inputs, out)
  _summary(out, manifest, time.time() - started)


def _expand(patterns: list[str], flag: str) -> list[str]:
  paths = []
  for pattern in patterns:
    matched = sorted(glob.glob(pattern)) if glob.has_magic(pattern) else [pattern]
    if not matched:
      raise FileNotFoundError(f"{flag}={pattern!r} matches no file")
    paths.extend(matched)
  return paths


def _tokenize(inputs: list[str], eval_inputs: list[str], out: str) -> dict:
  if not _TOKENIZER.value:
    raise ValueError("--tokenizer is required to tokenize text: a tokenizer.json or an HF checkpoint folder")
  config = DataConfig(source="files" if inputs else "hf", train_files=tuple(inputs), eval_files=tuple(eval_inputs),
                      hf_name=_HF_NAME.value, hf_config=_HF_CONFIG.value, hf_split=_HF_SPLIT.value,
                      text_column=_TEXT_COLUMN.value, max_documents=_MAX_DOCUMENTS.value, max_bytes=_MAX_BYTES.value)
  tokenizer = tokenizer_lib.load_tokenizer(_TOKENIZER.value)
  train = sources.stream_documents(config, "train")
  held = sources.stream_documents(config, "eval") if eval_inputs else None
  described = {"inputs": [os.path.abspath(p) for p in inputs], "eval_inputs": [os.path.abspath(p) for p in eval_inputs],
               "hf_name": _HF_NAME.value, "hf_config": _HF_CONFIG.value, "hf_split": _HF_SPLIT.value,
               "text_column": _TEXT_COLUMN.value, "max_documents": _MAX_DOCUMENTS.value, "max_bytes": _MAX_BYTES.value,
               "shard_mb": _SHARD_MB.value}
  return prepare.prepare(train, out, tokenizer.to_str(), tokenizer_lib.eos_id(tokenizer),
                         tokenizer.get_vocab_size(with_added_tokens=True), eval_documents=held,
                         eval_fraction=0.0 if held is not None else _EVAL_FRACTION.value, workers=_WORKERS.value,
                         shard_bytes=_SHARD_MB.value * 1_000_000, inputs=described, read_stats=train)


def _summary(out: str, manifest: dict, seconds: float) -> None:
  splits = manifest["splits"]
  print(f"{out}: {manifest['documents']:,} documents, {manifest['tokens']:,} tokens ({manifest['dtype']}) in "
        f"{len(manifest['shards'])} shards; train {splits['train']['tokens']:,} tokens, eval "
        f"{splits['eval']['tokens']:,} tokens; {seconds:.1f} s")
  print(f"train on it: python experiments/train_lm.py --config=<config> --config.data.source=prepared "
        f"--config.data.prepared={out} --workdir=<run>  (model.vocab_size >= {manifest['vocab_size']})")


if __name__ == "__main__":
  cli.run(main)
