"""Prepare's memory per process against corpus size, on FineWeb-like Parquet.

  python benchmarks/prepare_memory.py --sizes_mb=200,1000 --workers=2 --workdir=/tmp/prepare_memory --label=after
  python benchmarks/prepare_memory.py --sizes_mb=200,1000 --repo=<a checkout of an older commit> --label=before
  python benchmarks/prepare_memory.py --sizes_mb=200 --against=<that checkout> --repeats=4 --label=throughput

The corpus: Parquet files of `--file_mb` MB of text each with FineWeb's columns (text, id, dump, url, date, file_path,
language, language_score, token_count), the text being the standard library's `.py` files, each copy marked so no
two documents are equal; row groups of `--row_group_rows` rows. The tokenizer: a byte-level BPE of 32,768 tokens
trained on the standard library, as bench_corpus_scale.py trains it. Each size runs
experiments/prepare_data.py in a fresh process; a sampler reads /proc every --every_s seconds for the parent and each
worker: the kernel's own high-water mark (VmHWM, exact whatever the sampling) and a timeline of the current RSS (kept
at most --timeline_points points, each the largest RSS of its stretch). --repo runs another checkout's prepare (its
experiments/prepare_data.py, its jaxlm first on PYTHONPATH) on the same corpus, for before/after comparisons.
--against=<checkout> alternates this checkout and that one --repeats rounds per size (the order swapped each round)
and reports the median ratios of seconds and CPU seconds. Results: <out>/prepare_memory.json, one entry per --label
(runs under other labels are kept).
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import threading
import time

from absl import app, flags

_SIZES = flags.DEFINE_list("sizes_mb", ["200", "1000"], "corpus sizes in MB of text")
_WORKERS = flags.DEFINE_integer("workers", 2, "prepare worker processes")
_FILE_MB = flags.DEFINE_integer("file_mb", 50, "MB of text per Parquet file")
_ROW_GROUP = flags.DEFINE_integer("row_group_rows", 1000, "rows per Parquet row group")
_EVERY = flags.DEFINE_float("every_s", 0.25, "seconds between /proc samples")
_WORKDIR = flags.DEFINE_string("workdir", "/tmp/prepare_memory", "corpora and prepared folders")
_TOKENIZER = flags.DEFINE_string("tokenizer", "", "tokenizer.json (default: train the 32k BPE into --workdir)")
_LABEL = flags.DEFINE_string("label", "run", "a name for this run in the result (e.g. before / after a change)")
_ENV = flags.DEFINE_list("env", [], "NAME=VALUE pairs set for the prepare process (e.g. MALLOC_ARENA_MAX=2)")
_REPO = flags.DEFINE_string("repo", "", "a checkout whose prepare to measure (default: this one)")
_POINTS = flags.DEFINE_integer("timeline_points", 120, "points kept of each RSS timeline")
_AGAINST = flags.DEFINE_string("against", "", "another checkout to alternate with, --repeats rounds per size, for "
                               "a throughput comparison on a noisy machine")
_REPEATS = flags.DEFINE_integer("repeats", 3, "rounds per size with --against")
_OUT = flags.DEFINE_string("out", "benchmarks/results", "folder for prepare_memory.json")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9


def corpus(size_mb: int) -> list[str]:
  """Parquet files holding `size_mb` MB of text in all (written once; a larger corpus reuses a smaller one's
  files)."""
  import pyarrow as pa
  import pyarrow.parquet as pq

  from jaxlm.data.corpora import sources

  folder = os.path.join(_WORKDIR.value, f"parquet_{_FILE_MB.value}mb_rg{_ROW_GROUP.value}")
  os.makedirs(folder, exist_ok=True)
  count = -(-size_mb // _FILE_MB.value)
  paths = [os.path.join(folder, f"{i:05d}.parquet") for i in range(count)]
  if all(os.path.isfile(p) for p in paths):
    return paths
  texts = sources.demo_texts()
  for index, path in enumerate(paths):
    if os.path.isfile(path):
      continue
    columns = {k: [] for k in ("text", "id", "dump", "url", "date", "file_path", "language", "language_score",
                               "token_count")}
    written, copy, row = 0, 0, index * 10_000_000
    while written < _FILE_MB.value * 1_000_000:
      for text in texts:
        document = f"# copy {index}-{copy}\n{text}"
        columns["text"].append(document)
        columns["id"].append(f"<urn:uuid:{row:032x}>")
        columns["dump"].append("CC-MAIN-2024-10")
        columns["url"].append(f"https://example.com/{row}")
        columns["date"].append("2024-02-21T00:00:00Z")
        columns["file_path"].append(f"s3://commoncrawl/crawl-data/CC-MAIN-2024-10/segments/{row // 10_000}.warc.gz")
        columns["language"].append("en")
        columns["language_score"].append(0.9)
        columns["token_count"].append(len(document) // 4)
        written += len(document)
        row += 1
        if written >= _FILE_MB.value * 1_000_000:
          break
      copy += 1
    pq.write_table(pa.table(columns), path + ".tmp", row_group_size=_ROW_GROUP.value)
    os.replace(path + ".tmp", path)
  return paths


def tokenizer() -> str:
  if _TOKENIZER.value:
    return _TOKENIZER.value
  path = os.path.join(_WORKDIR.value, "bpe32k", "tokenizer.json")
  if not os.path.isfile(path):
    from jaxlm.data import tokenizer as tok_lib
    from jaxlm.data.corpora import sources

    texts = (open(p, encoding="utf-8", errors="ignore").read() for p in sources.demo_files())
    tok_lib.train_bpe(texts, 32768, path)
  return path


def _kib(status: str, key: str) -> int:
  for line in status.splitlines():
    if line.startswith(key + ":"):
      return int(line.split()[1]) * 1024
  return 0


def measure(command: list[str], env: dict[str, str], cwd: str) -> dict:
  """Runs `command`; the peak RSS (VmHWM) of it and of each process it starts, and a timeline of their RSS."""
  import psutil

  started, cpu_before = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
  process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)
  peaks: dict[int, int] = {}
  cpu: dict[int, float] = {}  # user + system seconds of each process, at its last sample
  faults: dict[int, int] = {}  # minor page faults of each process, at its last sample
  names: dict[int, str] = {}
  timeline: list[dict] = []

  def sample():
    root = psutil.Process(process.pid)
    while process.poll() is None:
      try:
        tree = [root, *root.children(recursive=True)]
      except psutil.Error:
        break
      point = {"s": round(time.time() - started, 2)}
      for p in tree:
        try:
          with open(f"/proc/{p.pid}/status") as f:
            status = f.read()
          if p.pid not in names:
            cmdline = " ".join(p.cmdline())
            names[p.pid] = ("parent" if p.pid == process.pid else "worker" if "spawn_main" in cmdline else
                            "resource_tracker" if "resource_tracker" in cmdline else "other")
        except (OSError, psutil.Error):
          continue
        try:
          with open(f"/proc/{p.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
          faults[p.pid] = int(fields[7])  # minflt: pages the process touched afresh (each zeroed by the kernel)
          cpu[p.pid] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
        except (OSError, IndexError, ValueError):
          pass
        peaks[p.pid] = max(peaks.get(p.pid, 0), _kib(status, "VmHWM"))
        rss = _kib(status, "VmRSS") / GB
        if names[p.pid] == "parent":
          point["parent_gb"] = rss
        elif names[p.pid] == "worker":
          point["largest_worker_gb"] = max(point.get("largest_worker_gb", 0.0), rss)
      timeline.append(point)
      time.sleep(_EVERY.value)

  sampler = threading.Thread(target=sample, daemon=True)
  sampler.start()
  output, _ = process.communicate()
  sampler.join()
  if process.returncode:
    raise RuntimeError(f"{' '.join(command)} failed:\n{output[-3000:]}")
  workers = sorted(peaks[pid] for pid in peaks if names.get(pid) == "worker")
  cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
  cpu_seconds = sum(getattr(cpu_after, k) - getattr(cpu_before, k) for k in ("ru_utime", "ru_stime"))
  return {"seconds": time.time() - started, "cpu_seconds": cpu_seconds,
          "parent_cpu_seconds": cpu.get(process.pid, 0.0),
          "worker_cpu_seconds": [cpu[pid] for pid in cpu if names.get(pid) == "worker"],
          "parent_minor_faults": faults.get(process.pid, 0),
          "worker_minor_faults": [faults[pid] for pid in faults if names.get(pid) == "worker"],
          "parent_peak_gb": peaks.get(process.pid, 0) / GB,
          "worker_peaks_gb": [w / GB for w in workers], "largest_process_peak_gb": max(peaks.values()) / GB,
          "timeline": _compact(timeline), "output": output.strip().splitlines()[-2:]}


def _compact(timeline: list[dict]) -> list[dict]:
  """At most --timeline_points points, each the largest RSS of its stretch of samples (a peak is never dropped)."""
  step = max(1, -(-len(timeline) // _POINTS.value))
  points = []
  for start in range(0, len(timeline), step):
    stretch = timeline[start:start + step]
    point = {"s": stretch[-1]["s"]}
    for key in ("parent_gb", "largest_worker_gb"):
      values = [p[key] for p in stretch if key in p]
      if values:
        point[key] = round(max(values), 3)
    points.append(point)
  return points


def run_size(size_mb: int, checkout: str = "") -> dict:
  paths = corpus(size_mb)
  out = os.path.join(_WORKDIR.value, f"prepared_{size_mb}mb")
  if os.path.isdir(out):
    import shutil

    shutil.rmtree(out)
  env = dict(os.environ, **dict(v.split("=", 1) for v in _ENV.value))
  repo = os.path.abspath(checkout or REPO)
  if checkout:
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH", "")]))
  command = [sys.executable, "experiments/prepare_data.py", *(f"--input={p}" for p in paths),
             f"--tokenizer={tokenizer()}", f"--out={out}", f"--workers={_WORKERS.value}",
             f"--max_bytes={size_mb * 1_000_000}"]
  result = measure(command, env, repo)
  manifest = json.load(open(os.path.join(out, "manifest.json")))
  result.update(tokens=manifest["tokens"], bytes=manifest["bytes"], shards=len(manifest["shards"]),
                tokens_per_sec=manifest["tokens"] / result["seconds"],
                tokens_per_cpu_sec=manifest["tokens"] / result["cpu_seconds"])
  print(json.dumps({k: v for k, v in result.items() if k != "timeline"}))
  return result


def rotation(size_mb: int) -> dict:
  """--repeats rounds of this checkout and --against, the order swapped each round: seconds and CPU seconds of each
  run, and the medians of this / against (the machine's drift cancels out of the ratios)."""
  import statistics

  runs: dict[str, list[dict]] = {"this": [], "against": []}
  for round_ in range(_REPEATS.value):
    for name in ("this", "against")[::1 if round_ % 2 == 0 else -1]:
      result = run_size(size_mb, _AGAINST.value if name == "against" else _REPO.value)
      runs[name].append({k: result[k] for k in ("seconds", "cpu_seconds", "parent_peak_gb", "worker_peaks_gb")})
  ratio = {k: statistics.median(a[k] / b[k] for a, b in zip(runs["this"], runs["against"]))
           for k in ("seconds", "cpu_seconds")}
  return {"against": _AGAINST.value, "runs": runs, "median_ratio_this_over_against": ratio}


def main(argv):
  del argv
  os.makedirs(_WORKDIR.value, exist_ok=True)
  tokenizer()
  command = "python " + " ".join(sys.argv)
  measured = rotation if _AGAINST.value else lambda size: run_size(size, _REPO.value)
  result = {"cores": os.cpu_count(), "workers": _WORKERS.value, "file_mb": _FILE_MB.value,
            "row_group_rows": _ROW_GROUP.value, "env": _ENV.value, "repo": _REPO.value or "this checkout",
            "sizes_mb": {str(size): {**measured(size), "command": command} for size in map(int, _SIZES.value)}}
  os.makedirs(_OUT.value, exist_ok=True)
  path = os.path.join(_OUT.value, "prepare_memory.json")
  kept = json.load(open(path)) if os.path.isfile(path) else {}
  # Other labels (before / after a change) and this label's other sizes stay beside this run.
  result["sizes_mb"] = {**kept.get(_LABEL.value, {}).get("sizes_mb", {}), **result["sizes_mb"]}
  kept[_LABEL.value] = result
  with open(path, "w") as f:
    json.dump(kept, f, indent=1)
  summary = {size: {k: v for k, v in r.items() if k not in ("timeline", "output")}
             for size, r in result["sizes_mb"].items()}
  print(json.dumps(summary, indent=1))
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
