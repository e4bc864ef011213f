"""Corpus scale: prepare throughput and memory, the loader's batch rate, training memory against corpus size.

  python benchmarks/bench_corpus_scale.py --part=prepare --sizes_mb=200,2000 --workdir=/tmp/corpus_bench
  python benchmarks/bench_corpus_scale.py --part=loader --workdir=/tmp/corpus_bench
  python benchmarks/bench_corpus_scale.py --part=train --sizes_mb=200,2000 --workdir=/tmp/corpus_bench

prepare: a JSONL corpus of Python source (the standard library's files, each copy marked so no two documents are the
  same) of each size, tokenized by a byte-level BPE of 32,768 tokens trained on the standard library, through
  experiments/prepare_data.py with 1 and 2 workers, beside the tokenizer's own `encode_batch` over the same documents
  in one process (its Rust threads on every core). Peak RSS is the sum over the process and its workers, sampled.
loader: PretrainingBatches over the largest prepared corpus, [B, T] batches per second on one host (no device), against
  the 470k tokens/s an H200 consumes in GPT-2 124M's step.
train: experiments/train_lm.py for 20 steps of a small GPT from each prepared corpus: peak RSS and the time from
  start to the first step.
Results: benchmarks/results/corpus_scale_<part>.json.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import sysconfig
import threading
import time

from absl import app, flags

_PART = flags.DEFINE_enum("part", "prepare", ["prepare", "loader", "train"], "what to measure")
_SIZES = flags.DEFINE_list("sizes_mb", ["200", "2000"], "corpus sizes in MB of JSONL text")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/corpus_bench", "corpora, prepared folders and runs")
_WORKERS = flags.DEFINE_list("workers", ["1", "2"], "prepare worker counts to compare")
_ENCODE_MB = flags.DEFINE_integer("encode_mb", 200, "MB of the corpus the in-process encode_batch baseline reads "
                                  "(0 = no baseline)")
_BATCH = flags.DEFINE_integer("batch", 64, "loader: global batch in sequences")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 1024, "loader: tokens per sequence")
_OUT = flags.DEFINE_string("out", "benchmarks/results", "folder for the JSON result")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
H200_GPT2_TOKENS_PER_SEC = 470_000  # benchmarks/results/h200_*.json: GPT-2 124M's bf16 step on one H200


def peak_rss_of(command: list[str], env: dict | None = None, watch: str = "") -> tuple[int, float, float]:
  """Runs `command`; returns (peak RSS in bytes of it and all its descendants, seconds, seconds until the file
  `watch` appeared)."""
  import psutil

  started = time.time()
  process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
  peak, appeared = [0], [float("nan")]

  def sample():
    root = psutil.Process(process.pid)
    while process.poll() is None:
      if watch and appeared[0] != appeared[0] and os.path.exists(watch):
        appeared[0] = time.time() - started
      try:
        total = sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
        peak[0] = max(peak[0], total)
      except psutil.Error:
        pass
      time.sleep(0.1)

  sampler = threading.Thread(target=sample, daemon=True)
  sampler.start()
  output, _ = process.communicate()
  sampler.join()
  if process.returncode:
    raise RuntimeError(f"{' '.join(command)} failed:\n{output[-3000:]}")
  return peak[0], time.time() - started, appeared[0]


def corpus(size_mb: int) -> str:
  """A JSONL file of `size_mb` MB of Python source documents (written once)."""
  path = os.path.join(_WORKDIR.value, f"python_{size_mb}mb.jsonl")
  if os.path.isfile(path):
    return path
  from jaxlm.data.corpora import sources

  texts = sources.demo_texts()
  target, written, copy = size_mb * 1_000_000, 0, 0
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    while written < target:
      for text in texts:
        line = json.dumps({"text": f"# copy {copy}\n{text}"}) + "\n"
        f.write(line)
        written += len(line)
        if written >= target:
          break
      copy += 1
  os.replace(path + ".tmp", path)
  return path


def tokenizer() -> str:
  path = os.path.join(_WORKDIR.value, "bpe32k", "tokenizer.json")
  if not os.path.isfile(path):
    from jaxlm.data import tokenizer as tok_lib
    from jaxlm.data.corpora import sources

    texts = (open(p, encoding="utf-8", errors="ignore").read() for p in sources.demo_files())
    tok_lib.train_bpe(texts, 32768, path)
  return path


def prepared(size_mb: int, workers: int, fresh: bool) -> tuple[str, dict]:
  out = os.path.join(_WORKDIR.value, f"prepared_{size_mb}mb_w{workers}")
  if fresh and os.path.isdir(out):
    import shutil

    shutil.rmtree(out)
  command = [sys.executable, "experiments/prepare_data.py", f"--input={corpus(size_mb)}", f"--tokenizer={tokenizer()}",
             f"--out={out}", f"--workers={workers}"]
  rss, seconds, _ = peak_rss_of(command)
  manifest = json.load(open(os.path.join(out, "manifest.json")))
  return out, {"peak_rss_gb": rss / 1e9, "seconds": seconds, "tokens": manifest["tokens"],
               "tokens_per_sec": manifest["tokens"] / seconds}


def encode_batch_baseline(size_mb: int) -> dict:
  """The tokenizer's own encode_batch over the corpus's first `encode_mb` MB, in this process."""
  import tokenizers

  tok = tokenizers.Tokenizer.from_file(tokenizer())
  texts, size = [], 0
  with open(corpus(size_mb), encoding="utf-8") as f:
    for line in f:
      texts.append(json.loads(line)["text"])
      size += len(line)
      if size >= _ENCODE_MB.value * 1_000_000:
        break
  result = {"mb": size / 1e6}
  for name in ("encode_batch", "encode_batch_fast"):  # _fast skips the character offsets, as prepare does
    encode = getattr(tok, name)
    started, tokens = time.time(), 0
    for start in range(0, len(texts), 1024):
      tokens += sum(len(e.ids) for e in encode(texts[start:start + 1024], add_special_tokens=False))
    seconds = time.time() - started
    result[name] = {"tokens": tokens, "seconds": seconds, "tokens_per_sec": tokens / seconds}
  return result


def part_prepare() -> dict:
  result = {"cores": os.cpu_count(), "sizes_mb": {}}
  for size in map(int, _SIZES.value):
    corpus(size)
    tokenizer()
    row = {"one_process": encode_batch_baseline(size)} if _ENCODE_MB.value else {}
    for workers in map(int, _WORKERS.value):
      row[f"prepare_{workers}_workers"] = prepared(size, workers, fresh=True)[1]
      for name in ("encode_batch", "encode_batch_fast"):
        if row.get("one_process"):
          row[f"prepare_{workers}_workers"][f"vs_{name}"] = (row[f"prepare_{workers}_workers"]["tokens_per_sec"]
                                                             / row["one_process"][name]["tokens_per_sec"])
    result["sizes_mb"][size] = row
    print(json.dumps({size: row}, indent=1))
  return result


def part_loader() -> dict:
  import numpy as np

  from jaxlm.data import PretrainingBatches, TokenWindows

  size = max(map(int, _SIZES.value))
  folder = os.path.join(_WORKDIR.value, f"prepared_{size}mb_w{max(map(int, _WORKERS.value))}")
  windows = TokenWindows(folder, "train", _SEQ_LEN.value)
  batches = PretrainingBatches([windows], [1.0], _BATCH.value, seed=0)
  next(batches)
  started, steps = time.time(), 0
  while time.time() - started < 10:
    batch = next(batches)
    steps += 1
  seconds = time.time() - started
  tokens_per_sec = steps * batch["inputs"].size / seconds
  assert batch["inputs"].dtype == np.int32
  return {"prepared": folder, "windows": len(windows), "batch": _BATCH.value, "seq_len": _SEQ_LEN.value,
          "batches_per_sec": steps / seconds, "tokens_per_sec": tokens_per_sec,
          "vs_h200_gpt2_step": tokens_per_sec / H200_GPT2_TOKENS_PER_SEC}


def part_train() -> dict:
  result = {}
  for size in map(int, _SIZES.value):
    folder = os.path.join(_WORKDIR.value, f"prepared_{size}mb_w{max(map(int, _WORKERS.value))}")
    workdir = os.path.join(_WORKDIR.value, f"train_{size}mb")
    if os.path.isdir(workdir):
      import shutil

      shutil.rmtree(workdir)
    command = [sys.executable, "experiments/train_lm.py", "--config=experiments/configs/demo.py",
               f"--workdir={workdir}",
               "--config.data.source=prepared", f"--config.data.prepared={folder}", "--config.model.vocab_size=32768",
               "--config.train.steps=20", "--config.train.warmup_steps=5", "--config.log.every_steps=1",
               "--config.train.eval_every_steps=0", "--config.log.sample_tokens=0", "--config.log.progress_bar=False",
               "--config.checkpoint.every_steps=0"]
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
    # metrics.jsonl's first line is written at the first step (read one step late: as step 2 starts).
    rss, seconds, first_step = peak_rss_of(command, env, watch=os.path.join(workdir, "metrics.jsonl"))
    metrics = [json.loads(l) for l in open(os.path.join(workdir, "metrics.jsonl"))]
    manifest = json.load(open(os.path.join(folder, "manifest.json")))
    result[size] = {"corpus_tokens": manifest["tokens"], "peak_rss_gb": rss / 1e9, "seconds": seconds,
                    "seconds_to_first_step": first_step,
                    "final_loss": metrics[-1]["loss"]}
    print(json.dumps({size: result[size]}))
  sizes = sorted(result)
  result["rss_ratio_largest_over_smallest"] = result[sizes[-1]]["peak_rss_gb"] / result[sizes[0]]["peak_rss_gb"]
  return result


def main(argv):
  del argv
  os.makedirs(_WORKDIR.value, exist_ok=True)
  result = {"prepare": part_prepare, "loader": part_loader, "train": part_train}[_PART.value]()
  result["command"] = "python " + " ".join(sys.argv)
  os.makedirs(_OUT.value, exist_ok=True)
  path = os.path.join(_OUT.value, f"corpus_scale_{_PART.value}.json")
  if os.path.isfile(path) and "sizes_mb" in result:  # runs of other sizes are kept beside this one's
    kept = json.load(open(path)).get("sizes_mb", {})
    result["sizes_mb"] = {**kept, **{str(k): v for k, v in result["sizes_mb"].items()}}
    result["commands"] = sorted(set(json.load(open(path)).get("commands", [])) | {"python " + " ".join(sys.argv)})
  with open(path, "w") as f:
    json.dump(result, f, indent=1)
  print(json.dumps(result, indent=1))
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
