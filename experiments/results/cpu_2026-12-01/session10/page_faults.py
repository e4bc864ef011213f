"""Session 10: minor page faults, kernel and user CPU-seconds of single bench_cpu steps (getrusage).
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python experiments/results/cpu_2026-12-01/session10/page_faults.py
  python experiments/results/cpu_2026-12-01/session10/page_faults.py
"""
import resource, time, sys, jax
sys.path.insert(0, '.')
from ml_collections import config_flags
import importlib.util
spec = importlib.util.spec_from_file_location("c", "experiments/configs/bench_cpu.py"); m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
from jaxlm import measure, config as config_lib
config = config_lib.from_config_dict(m.get_config())
compiled, state, batch, _ = measure.compiled_train_step(config)
for _ in range(2): state, metrics = compiled(state, batch)
jax.block_until_ready(metrics)
for _ in range(3):
  r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
  state, metrics = compiled(state, batch); jax.block_until_ready(metrics)
  r1 = resource.getrusage(resource.RUSAGE_SELF)
  print(f"step {time.perf_counter()-t:.3f}s minflt {r1.ru_minflt-r0.ru_minflt} majflt {r1.ru_majflt-r0.ru_majflt} sys {r1.ru_stime-r0.ru_stime:.3f}s user {r1.ru_utime-r0.ru_utime:.3f}s")
