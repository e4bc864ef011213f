"""Session 10: the same gemm shapes through blas.gemm alone (jit, 20 calls): GFLOP/s and CPU/wall.
  GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python experiments/results/cpu_2026-12-01/session10/gemm_rates_alone.py
"""
import time, resource, jax, jax.numpy as jnp, numpy as np
from jaxlm import blas
shapes = [((2048,384),(384,1536),"nn"), ((1024,384),(8192,384),"nt"), ((2048,1536),(2048,384),"tn"), ((2048,384),(1536,384),"nt")]
for sa, sb, lay in shapes:
  a = jnp.asarray(np.random.rand(*sa).astype(np.float32)); b = jnp.asarray(np.random.rand(*sb).astype(np.float32))
  f = jax.jit(lambda a, b: blas.gemm(a, b, lay[0]=="t", lay[1]=="t"))
  out = f(a,b); out.block_until_ready()
  m = sa[1] if lay[0]=="t" else sa[0]; k = sa[0] if lay[0]=="t" else sa[1]; n = sb[0] if lay[1]=="t" else sb[1]
  r0 = resource.getrusage(resource.RUSAGE_SELF); t = time.perf_counter()
  for _ in range(20): out = f(a,b)
  out.block_until_ready(); dt = time.perf_counter()-t
  r1 = resource.getrusage(resource.RUSAGE_SELF)
  cpu = (r1.ru_utime-r0.ru_utime)+(r1.ru_stime-r0.ru_stime)
  print(sa, sb, lay, f"{2*m*n*k*20/dt/1e9:.1f} GFLOP/s cpu/wall {cpu/dt:.2f} sys {r1.ru_stime-r0.ru_stime:.3f}")
