"""Session 10: per XLA op of a profiled CPU step, the time it ran with nothing else running (the critical-path
elementwise ops; events read by profile_step.op_events). Argument: a profile_step.py workdir.
  python experiments/results/cpu_2026-12-01/session10/ops_alone_in_step.py runs/prof_s10
"""
import collections, gzip, json, re, sys
sys.path.insert(0, "experiments")
import profile_step
from jaxlm import hlo
wd = sys.argv[1]
text = gzip.open(f"{wd}/step.hlo.txt.gz", "rt").read()
steps = json.load(open(f"{wd}/profile.json"))["steps"]
kinds = hlo.instruction_kinds(text)
src = {m.group(1): m.group(2) for m in re.finditer(r"%([\w.\-]+) = .*?op_name=\"([^\"]*)\"", text)}
shape = {m.group(1): m.group(2) for m in re.finditer(r"%([\w.\-]+) = (\S+)", text)}
_, ev, _ = profile_step.op_events(f"{wd}/trace", kinds)  # (start, end, instruction) on the host's XLA threads
edges = sorted([(s, 1, i) for i, (s, t, n) in enumerate(ev)] + [(t, -1, i) for i, (s, t, n) in enumerate(ev)])
active = set(); prev = edges[0][0]; alone = collections.Counter()
for t, ch, i in edges:
  if len(active) == 1:
    (j,) = active; alone[ev[j][2]] += t - prev
  if ch > 0: active.add(i)
  else: active.discard(i)
  prev = t
tot = 0
for n, v in alone.most_common(30):
  if kinds[n] in ("matmul", "custom-call"): continue
  tot += v
  print(f"{v/steps/1e6:7.2f} ms alone  {n:38s} {kinds[n]:12s} {shape.get(n,'')[:36]:36s} {src.get(n,'')[-60:]}")
print("non-library alone total (top)", tot/steps/1e6)
