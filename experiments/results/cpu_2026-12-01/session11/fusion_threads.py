"""Session 11: does XLA:CPU split one elementwise/reduce fusion over its threads? CPU-seconds per wall-second of a
jitted tanh-GELU over the bench_cpu MLP activation f32[2048, 1536] (alone and inside a 6-step scan, as the layer
scan runs it) and of a tanh row-sum; run it as is and under `taskset -c 0` (one core) to compare.
  python experiments/results/cpu_2026-12-01/session11/fusion_threads.py
  taskset -c 0 python experiments/results/cpu_2026-12-01/session11/fusion_threads.py
"""
import time

import jax
import jax.numpy as jnp

gelu = lambda h: jax.nn.gelu(h, approximate=True) * 1.0001
one = jnp.full((2048, 1536), 0.3, jnp.float32)
six = jnp.full((6, 2048, 1536), 0.3, jnp.float32)
cases = {
    "gelu [2048,1536]": (jax.jit(gelu), one),
    "tanh row-sum [2048,1536]": (jax.jit(lambda x: jnp.tanh(x).sum(axis=-1)), one),
    "gelu in a 6-step scan (per step)": (jax.jit(lambda x: jax.lax.scan(lambda c, h: (c, gelu(h)), 0., x)[1]), six),
}
for name, (fn, x) in cases.items():
  fn(x).block_until_ready()
  reps = 30
  wall, cpu = time.perf_counter(), time.process_time()
  for _ in range(reps):
    fn(x).block_until_ready()
  wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
  per = reps * (6 if x is six else 1)
  print(f"{name}: {wall / per * 1e3:.2f} ms wall, {cpu / per * 1e3:.2f} ms CPU ({cpu / wall:.2f} cores busy)")
