"""Session 11, in-process A/B: the bench_cpu step with each blas gemm split into 1, 2 or 4 blocks per XLA pool
thread (taken dynamically by jaxlm::ParallelFor, which then also schedules blocks - 1 pool tasks on the 2-thread
pool), rounds interleaved, a warm-up step per setting per round.
Needs a temporary patch of jaxlm/blas_gemm.cc that reads the setting per call (not kept; GemmImpl's g.blocks line):
  const char* env = std::getenv("JAXLM_GEMM_BLOCKS_PER_THREAD"); const int64_t per = env ? std::atoi(env) : 1;
  g.blocks = int(std::min<int64_t>({per * std::max<int64_t>(pool.num_threads(), 1), by_size, parts}));
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python experiments/results/cpu_2026-12-01/session11/ab_gemm_blocks.py 8
"""
import os, statistics, sys, time
import jax
from jaxlm import measure
from jaxlm import config as config_lib
sys.path.insert(0, "experiments")
from configs import bench_cpu
config = config_lib.from_config_dict(bench_cpu.get_config())
step, state, batch, _ = measure.compiled_train_step(config)
def run(n):
  global state
  for _ in range(n):
    state, metrics = step(state, batch)
  jax.block_until_ready(metrics)
settings = sys.argv[2].split(",") if len(sys.argv) > 2 else ["1", "2", "4"]
times = {s: [] for s in settings}
for r in range(int(sys.argv[1])):
  for s in settings:
    os.environ["JAXLM_GEMM_BLOCKS_PER_THREAD"] = s
    run(1)
    t = time.perf_counter(); run(2); times[s].append((time.perf_counter() - t) / 2)
  print("round", r, {s: round(v[-1] * 1e3) for s, v in times.items()}, flush=True)
base = statistics.median(times[settings[0]])
for s, v in times.items():
  paired = statistics.median(a / b for a, b in zip(times[settings[0]], v))
  print(f"blocks/thread {s}: median {statistics.median(v) * 1e3:.0f} ms, speedup {base / statistics.median(v):.3f}, "
        f"paired {paired:.3f}")
