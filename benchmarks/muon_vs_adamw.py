"""Muon against AdamW, each at its own best learning rate, on two corpora: held-out loss at equal steps and at equal
wall time over 3 seeds, and Newton-Schulz's step-time overhead measured side by side in one process.

  python benchmarks/muon_vs_adamw.py --workdir=runs/muon_vs_adamw --out=benchmarks/results/cpu_muon_vs_adamw.json

Corpora (made here; nothing is downloaded):
  char  nanoGPT's character recipe (benchmarks/configs/shakespeare_char.py: 4 layers, 128 wide, context 64, batch
        12) on the Python reference manual's topics (`pydoc_data.topics` of the standard library: 0.46 M
        characters of English prose and code; Tiny Shakespeare is not on this machine), one token per character.
  bpe   a 4-layer, 256-wide GPT on the Python sources of this environment's site-packages (a few hundred MB, one
        document per file), prepared with a byte-level BPE of 8,192 tokens trained on a sample of them.
For each corpus and optimizer, experiments/sweep.py runs the learning-rate grid at seed 0; the best rate (lowest
final eval_loss) then runs seeds 1 and 2. Equal wall time: the step-time ratio r = muon / adamw from
benchmarks/ab_step.py (rounds interleaved in one process) maps AdamW's final step N to Muon's step N / r, where
Muon's held-out loss is read off its eval curve (metrics.jsonl, linear between evaluations).
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import subprocess
import sys
import sysconfig

import numpy as np
from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from jaxlm.training import atomic_files  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", "runs/muon_vs_adamw", "folder for the corpora, sweeps and timings")
_OUT = flags.DEFINE_string("out", "benchmarks/results/cpu_muon_vs_adamw.json", "results JSON")
_CORPORA = flags.DEFINE_list("corpora", ["char", "bpe"], "which corpora to run")
_SEEDS = flags.DEFINE_integer("seeds", 3, "seeds at each optimizer's best rate (the sweep's seed 0 included)")
_BPE_MB = flags.DEFINE_integer("bpe_mb", 300, "megabytes of Python source for the bpe corpus")

OPTIMIZERS = ("adamw", "muon")
# Learning-rate grids; Muon's uses consistent RMS scaling (train.muon_consistent_rms), so its rates sit near AdamW's.
GRIDS = {"char": {"adamw": "1e-3,3e-3,1e-2", "muon": "1e-3,3e-3,1e-2,3e-2"},
         "bpe": {"adamw": "1e-3,3e-3,1e-2,3e-4", "muon": "3e-3,1e-2,3e-2,1e-3"}}
CHAR_CONFIG = os.path.join(ROOT, "benchmarks", "configs", "shakespeare_char.py")
BPE_CONFIG = os.path.join(ROOT, "experiments", "configs", "demo.py")


def run(cmd: list[str]) -> None:
  print("+", " ".join(cmd), flush=True)
  subprocess.run(cmd, check=True, cwd=ROOT)


def char_corpus(folder: str) -> tuple[str, int]:
  """(prepared folder, vocabulary size) of the character corpus."""
  import pydoc_data.topics  # noqa: PLC0415
  import tokenizers  # noqa: PLC0415

  from jaxlm.data.tokenizer import EOS_TOKEN  # noqa: PLC0415
  prepared = os.path.join(folder, "prepared")
  tokenizer_path = os.path.join(folder, "tokenizer.json")
  texts = [t for _, t in sorted(pydoc_data.topics.topics.items())]
  chars = sorted(set("".join(texts)))
  vocab = {EOS_TOKEN: 0, **{c: i + 1 for i, c in enumerate(chars)}}
  if not os.path.isfile(os.path.join(prepared, "manifest.json")):
    os.makedirs(folder, exist_ok=True)
    # One token per character: a BPE with no merges and no pre-tokenizer splits text into single characters.
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))
    tokenizer.add_special_tokens([EOS_TOKEN])
    tokenizer.save(tokenizer_path)
    with open(os.path.join(folder, "topics.jsonl"), "w") as f:
      for text in texts:
        f.write(json.dumps({"text": text}) + "\n")
    run([sys.executable, "experiments/prepare_data.py", f"--input={folder}/topics.jsonl",
         f"--tokenizer={tokenizer_path}", f"--out={prepared}", "--eval_fraction=0.05"])
  return prepared, len(vocab)


def bpe_corpus(folder: str, megabytes: int) -> tuple[str, int]:
  from jaxlm.data.tokenizer import train_bpe  # noqa: PLC0415
  prepared = os.path.join(folder, "prepared")
  if not os.path.isfile(os.path.join(prepared, "manifest.json")):
    os.makedirs(folder, exist_ok=True)
    site = sysconfig.get_paths()["purelib"]
    files, total, sample = sorted(glob.glob(os.path.join(site, "**", "*.py"), recursive=True)), 0, []
    with open(os.path.join(folder, "sources.jsonl"), "w") as out:
      for path in files:
        try:
          with open(path, encoding="utf-8") as f:
            text = f.read()
        except (UnicodeDecodeError, OSError):
          continue
        if not text.strip():
          continue
        out.write(json.dumps({"text": text}) + "\n")
        total += len(text)
        if total < 8e6:
          sample.append(text)
        if total >= megabytes * 1e6:
          break
    train_bpe(sample, 8192, os.path.join(folder, "tokenizer.json"))
    run([sys.executable, "experiments/prepare_data.py", f"--input={folder}/sources.jsonl",
         f"--tokenizer={folder}/tokenizer.json", f"--out={prepared}", "--eval_fraction=0.002"])
  return prepared, 8192


def corpus_overrides(name: str, prepared: str, vocab: int) -> tuple[str, list[str]]:
  common = ["--config.data.source=prepared", f"--config.data.prepared={prepared}", f"--config.model.vocab_size={vocab}",
            "--config.log.progress_bar=False", "--config.log.sample_tokens=0", "--config.checkpoint.every_steps=0"]
  if name == "char":
    return CHAR_CONFIG, common + ["--config.train.steps=1000", "--config.train.eval_every_steps=100",
                                  "--config.train.eval_batches=20", "--config.log.every_steps=50"]
  return BPE_CONFIG, common + [
      "--config.model.num_layers=4", "--config.model.d_model=256", "--config.model.num_heads=4",
      "--config.model.max_seq_len=128", "--config.data.seq_len=128", "--config.train.batch_size=16",
      "--config.train.steps=300", "--config.train.warmup_steps=30", "--config.train.eval_every_steps=50",
      "--config.train.eval_batches=16", "--config.log.every_steps=50", "--config.mesh.data=1"]


def eval_curve(workdir: str) -> list[tuple[int, float]]:
  curve = []
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    for line in f:
      row = json.loads(line)
      if "eval_loss" in row:
        curve.append((int(row["step"]), float(row["eval_loss"])))
  return curve


def loss_at(curve: list[tuple[int, float]], step: float) -> float:
  steps, losses = zip(*curve)
  return float(np.interp(step, steps, losses))


def sweep(name: str, optimizer: str, config: str, overrides: list[str], grid: str, seeds: int) -> dict:
  folder = os.path.join(_WORKDIR.value, name, optimizer)
  base = [sys.executable, "experiments/sweep.py", "--script=experiments/train_lm.py", f"--config={config}",
          "--metric=eval_loss"]
  extra = ["--", f"--config.train.optimizer={optimizer}", *overrides]
  run(base + [f"--workdir={folder}/rates", f"--grid=train.learning_rate={grid}"] + extra)
  with open(os.path.join(folder, "rates", "sweep.json")) as f:
    rates = json.load(f)["runs"]
  done = [r for r in rates if "eval_loss" in r.get("eval", {})]
  best = min(done, key=lambda r: r["eval"]["eval_loss"])
  best_rate = best["values"]["train.learning_rate"]
  seed_grid = ",".join(str(s) for s in range(1, seeds))
  run(base + [f"--workdir={folder}/seeds", f"--grid=train.seed={seed_grid}"]
      + extra + [f"--config.train.learning_rate={best_rate}"])
  with open(os.path.join(folder, "seeds", "sweep.json")) as f:
    seed_runs = json.load(f)["runs"]
  workdirs = [best["workdir"]] + [r["workdir"] for r in seed_runs]
  return {"rates": {r["values"]["train.learning_rate"]: r.get("eval", {}).get("eval_loss") for r in rates},
          "best_learning_rate": best_rate, "workdirs": workdirs,
          "final_eval_loss": [eval_curve(w)[-1][1] for w in workdirs],
          "curves": [eval_curve(w) for w in workdirs]}


def step_time_ratio(name: str, config: str, overrides: list[str]) -> dict:
  out = os.path.join(_WORKDIR.value, name, "ab")
  keep = [o for o in overrides if not o.startswith(("--config.data.", "--config.train.eval", "--config.log."))]
  run([sys.executable, "benchmarks/ab_step.py", f"--config={config}", *keep, f"--workdir={out}",
       "--variants=adamw:train.optimizer=adamw,muon:train.optimizer=muon", "--rounds=6", "--steps_per_round=10"])
  with open(os.path.join(out, "ab.json")) as f:
    return json.load(f)


def main(argv):
  del argv
  results = {"command": "python " + " ".join(sys.argv), "corpora": {}}
  if os.path.isfile(_OUT.value):
    with open(_OUT.value) as f:
      results["corpora"] = json.load(f).get("corpora", {})
  for name in _CORPORA.value:
    folder = os.path.join(_WORKDIR.value, name, "corpus")
    prepared, vocab = char_corpus(folder) if name == "char" else bpe_corpus(folder, _BPE_MB.value)
    config, overrides = corpus_overrides(name, prepared, vocab)
    entry = {"optimizers": {opt: sweep(name, opt, config, overrides, GRIDS[name][opt], _SEEDS.value)
                            for opt in OPTIMIZERS}}
    ab = step_time_ratio(name, config, overrides)
    entry["step_time"] = ab
    adamw, muon = entry["optimizers"]["adamw"], entry["optimizers"]["muon"]
    ratio = muon_step_ratio(ab)
    final_step = adamw["curves"][0][-1][0]
    muon_equal_time = [loss_at(c, final_step / ratio) for c in muon["curves"]]
    entry["summary"] = {
        "muon_over_adamw_step_time": ratio,
        "equal_steps": {"steps": final_step, "adamw_mean": statistics.mean(adamw["final_eval_loss"]),
                        "adamw_sd": statistics.pstdev(adamw["final_eval_loss"]),
                        "muon_mean": statistics.mean(muon["final_eval_loss"]),
                        "muon_sd": statistics.pstdev(muon["final_eval_loss"])},
        "equal_time": {"adamw_steps": final_step, "muon_steps": final_step / ratio,
                       "adamw_mean": statistics.mean(adamw["final_eval_loss"]),
                       "muon_mean": statistics.mean(muon_equal_time), "muon_sd": statistics.pstdev(muon_equal_time)}}
    results["corpora"][name] = entry
    atomic_files.write_json(_OUT.value, results)
    print(json.dumps(entry["summary"], indent=1), flush=True)


def muon_step_ratio(ab: dict) -> float:
  """Muon's median step time over AdamW's, from ab_step.py's ab.json."""
  return ab["rows"]["muon"]["step_sec"] / ab["rows"]["adamw"]["step_sec"]


if __name__ == "__main__":
  app.run(main)
