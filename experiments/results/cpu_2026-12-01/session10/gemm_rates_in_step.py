"""Session 10: GFLOP/s of every jaxlm_gemm custom call of a profiled step (FLOPs from the kept HLO, time from
the trace, read by profile_step.op_events) and how much of its time other ops overlapped. Argument: a
profile_step.py workdir.
  python experiments/results/cpu_2026-12-01/session10/gemm_rates_in_step.py runs/prof_s10
"""
import collections, gzip, json, math, re, sys
sys.path.insert(0, "experiments")
import profile_step
from jaxlm import hlo
wd = sys.argv[1]
text = gzip.open(f"{wd}/step.hlo.txt.gz", "rt").read()
steps = json.load(open(f"{wd}/profile.json"))["steps"]
kinds = hlo.instruction_kinds(text)
flops = {}
for m in re.finditer(r"%(ffi_call\.\d+) = f32\[([\d,]*)\]\S* custom-call.*?jaxlm_gemm.*?"
                     r"operand_layout_constraints=\{f32\[([\d,]+)\]\S*, f32\[([\d,]+)\].*?trans_a = (\w+)", text):
  name, out, a, b, ta = m.groups()
  out = [int(x) for x in out.split(",")]; a = [int(x) for x in a.split(",")]
  k = a[-2] if ta == "true" else a[-1]
  flops[name] = 2 * math.prod(out) * k
_, ev, _ = profile_step.op_events(f"{wd}/trace", kinds)  # (start, end, instruction) on the host's XLA threads
gem = [e for e in ev if e[2] in flops or kinds[e[2]] == "custom-call"]
agg = collections.defaultdict(lambda: [0, 0, 0])
for s, t, n in gem:
  ov = sum(max(0, min(t, t2) - max(s, s2)) for s2, t2, n2 in ev if (s2, t2, n2) != (s, t, n))
  a = agg[n]; a[0] += t - s; a[1] += ov; a[2] += 1
tf = 0; tt = 0
for n, (d, ov, c) in sorted(agg.items(), key=lambda x: -x[1][0]):
  f = flops.get(n, 0) * c
  tf += f; tt += d
  print(f"{n:14s} n={c:3d} {d / steps / 1e6:7.1f} ms/step overlap {100 * ov / d:5.1f}%  "
        f"{f / d if f else 0:6.1f} GFLOP/s")
print("gemm total", tf / steps / 1e9, "GFLOP/step", tt / steps / 1e6, "ms/step")
