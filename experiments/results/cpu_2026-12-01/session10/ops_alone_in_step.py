"""Session 10: per XLA op of a profiled CPU step, the time it ran with nothing else running (the critical-path
elementwise ops). Argument: a profile_step.py workdir.
  python experiments/results/cpu_2026-12-01/session10/ops_alone_in_step.py runs/prof_s10
"""
import glob, sys, gzip, re, collections, jax
sys.path.insert(0, '.')
from jaxlm import hlo
wd = sys.argv[1]
text = gzip.open(f"{wd}/step.hlo.txt.gz","rt").read()
kinds = hlo.instruction_kinds(text)
src = {m.group(1): m.group(2) for m in re.finditer(r"%([\w.\-]+) = .*?op_name=\"([^\"]*)\"", text)}
shape = {m.group(1): m.group(2) for m in re.finditer(r"%([\w.\-]+) = (\S+)", text)}
p = jax.profiler.ProfileData.from_file(glob.glob(f"{wd}/trace/**/*.xplane.pb", recursive=True)[0])
ev = []
for plane in p.planes:
  if not plane.name.startswith("/host:CPU"): continue
  for line in plane.lines:
    if not ("XLAEigen" in line.name or "XLACpu" in line.name): continue
    for e in line.events:
      st = dict(e.stats)
      n = next(filter(None, (hlo.event_instruction(str(x).lstrip("%"), kinds) for x in (st.get("hlo_op"), e.name) if x)), None)
      if n is None or kinds[n] == "control": continue
      ev.append((e.start_ns, e.start_ns + e.duration_ns, n))
edges = sorted([(s, 1, i) for i, (s, t, n) in enumerate(ev)] + [(t, -1, i) for i, (s, t, n) in enumerate(ev)])
active = set(); prev = edges[0][0]; alone = collections.Counter()
for t, ch, i in edges:
  if len(active) == 1:
    (j,) = active; alone[ev[j][2]] += t - prev
  if ch > 0: active.add(i)
  else: active.discard(i)
  prev = t
steps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
tot = 0
for n, v in alone.most_common(30):
  if kinds[n] in ("matmul", "custom-call"): continue
  tot += v
  print(f"{v/steps/1e6:7.2f} ms alone  {n:38s} {kinds[n]:12s} {shape.get(n,'')[:36]:36s} {src.get(n,'')[-60:]}")
print("non-library alone total (top)", tot/steps/1e6)
