"""Session 11: one-thread OpenBLAS sgemm rate (numpy, [1024,384]x[384,1536]) with the other core idle vs running
the same gemm in a second process: how much two busy cores cost each other. numpy's OpenBLAS (0.3.31, 64-bit
ints) times it, not the scipy 0.3.30 build jaxlm.blas calls; one shape only.
  python experiments/results/cpu_2026-12-01/session11/two_core_rate.py
"""
import os, sys, time, multiprocessing as mp
os.environ["OPENBLAS_NUM_THREADS"] = "1"
import numpy as np
def rate(seconds, out=None):
  a = np.random.rand(1024, 384).astype(np.float32); b = np.random.rand(384, 1536).astype(np.float32)
  n, t0 = 0, time.perf_counter()
  while time.perf_counter() - t0 < seconds:
    a @ b; n += 1
  r = 2 * 1024 * 384 * 1536 * n / (time.perf_counter() - t0) / 1e9
  if out is not None: out.put(r)
  return r
if __name__ == "__main__":
  print("alone: %.1f GFLOP/s" % rate(3))
  q = mp.Queue(); ps = [mp.Process(target=rate, args=(3, q)) for _ in range(2)]
  [p.start() for p in ps]; [p.join() for p in ps]
  print("two at once: %.1f + %.1f GFLOP/s" % (q.get(), q.get()))
  print("alone again: %.1f GFLOP/s" % rate(3))
