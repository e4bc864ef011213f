"""The CPU verdict against torch.compile, pooled: every paired round (torch.compile step / jaxlm step, run back to back)
of the bench runs of the current bench_cpu step whose JSON keeps every round, with measure.median_interval.
  python experiments/results/cpu_2026-12-01/session11/pooled_verdict.py
"""
import json
import pathlib
import statistics

from jaxlm import measure

RUNS = ("bench_session9_final", "bench_session9_final_2", "bench_session10", "bench_session11")
folder = pathlib.Path(__file__).resolve().parents[1]
pooled = []
for run in RUNS:
  data = json.loads((folder / f"{run}.json").read_text())
  ratios = [t / j for j, t in zip(data["jaxlm_step_sec_rounds"], data["torch_compile_step_sec_rounds"])]
  pooled += ratios
  low, high, coverage = measure.median_interval(ratios)
  print(f"{run}: jaxlm_vs_torch_compile {data['jaxlm_vs_torch_compile']:.4f}, "
        f"median round {statistics.median(ratios):.3f} [{low:.3f}, {high:.3f}] ({coverage:.1%}), {len(ratios)} rounds")
low, high, coverage = measure.median_interval(pooled)
print(f"pooled {len(pooled)} rounds: median {statistics.median(pooled):.3f}, "
      f"{coverage:.1%} interval [{low:.3f}, {high:.3f}]")
