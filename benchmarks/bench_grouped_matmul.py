"""The experts' grouped matmul (rows sorted by expert, each expert's weight on its own rows), forward + backward, in
each implementation at the GPU MoE bench's shape (benchmarks/configs/bench_moe_gpu.py: 8 experts, 32768 routed rows,
1024 -> 5632, bf16), beside the ideal: equal groups as one batched matmul. Also two pure-JAX candidates: rows padded
to blocks of one expert each, run as a scan over the blocks or as one batched matmul with each block's weight
gathered.

  python benchmarks/bench_grouped_matmul.py            # a GPU; --small for a CPU-sized shape in f32 (adds blas)
  python benchmarks/bench_grouped_matmul.py --only=ideal,ragged_dot,mosaic   # those rows alone

Prints one line per implementation (median of 5 after a warm-up); one that cannot run prints why.
"""

from __future__ import annotations

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

SMALL = "--small" in sys.argv
# --only=a,b: the rows whose name starts with a listed key (ideal, ragged_dot, blas, tokamax, mosaic, padded)
ONLY = next((a.split("=", 1)[1].split(",") for a in sys.argv if a.startswith("--only=")), None)
E, M, D, F = (8, 8192, 384, 768) if SMALL else (8, 32768, 1024, 5632)
DTYPE = jnp.float32 if SMALL else jnp.bfloat16
x = jax.random.normal(jax.random.key(0), (M, D), DTYPE)
w = jax.random.normal(jax.random.key(1), (E, D, F), DTYPE) * 0.02
sizes = jnp.asarray(np.random.default_rng(0).multinomial(M, np.ones(E) / E).astype(np.int32))


def timeit(name, fn, skipped: str | None = None):
  if ONLY and name.split()[0].split(".")[0] not in ONLY:
    return
  if skipped:
    print(f"{name}: skipped, {skipped}", flush=True)
    return
  try:
    step = jax.jit(jax.value_and_grad(lambda x, w: jnp.sum(fn(x, w).astype(jnp.float32) ** 2), argnums=(0, 1)))
    jax.block_until_ready(step(x, w))
    times = []
    for _ in range(5):
      started = time.perf_counter()
      jax.block_until_ready(step(x, w))
      times.append(time.perf_counter() - started)
    print(f"{name}: forward + backward {np.median(times) * 1e3:.2f} ms", flush=True)
  except Exception as e:  # pylint: disable=broad-except  # report and go on to the next one
    print(f"{name}: failed, {type(e).__name__}: {str(e)[:300]}", flush=True)


def padded_blocks(m: int, gathered: bool):
  """Rows padded per expert to whole blocks of m (at most M / m + E blocks), each block one expert's."""
  blocks = M // m + E

  def run(x, w):
    padded = (sizes + m - 1) // m * m
    starts, first = jnp.cumsum(padded) - padded, jnp.cumsum(sizes) - sizes
    expert_of_row = jnp.repeat(jnp.arange(E), sizes, total_repeat_length=M)
    dest = starts[expert_of_row] + jnp.arange(M) - first[expert_of_row]
    block_expert = jnp.clip(jnp.searchsorted(jnp.cumsum(padded), jnp.arange(blocks) * m, side="right"), 0, E - 1)
    x_blocks = jnp.zeros((blocks * m, D), x.dtype).at[dest].set(x).reshape(blocks, m, D)
    if gathered:
      y = jnp.einsum("bmd,bdf->bmf", x_blocks, w[block_expert])
    else:
      _, y = jax.lax.scan(lambda carry, a: (carry, a[0] @ w[a[1]]), None, (x_blocks, block_expert))
    return y.reshape(blocks * m, F)[dest]

  return run


def main():
  print(f"{jax.devices()[0].device_kind}: E={E} M={M} D={D} F={F} {jnp.dtype(DTYPE).name}")
  timeit("ideal (equal groups, one batched matmul)",
         lambda x, w: jnp.einsum("gnd,gdf->gnf", x.reshape(E, -1, D), w).reshape(-1, F))
  timeit("ragged_dot (jax.lax.ragged_dot, XLA)", lambda x, w: jax.lax.ragged_dot(x, w, sizes))
  if SMALL:
    from jaxlm.kernels import cpu
    timeit("blas (jaxlm's CPU grouped GEMM)", lambda x, w: cpu.grouped_matmul(x, w, sizes))
  else:
    from jaxlm.kernels import gpu
    for implementation in (None, "triton", "mosaic", "xla"):
      timeit(f"tokamax.ragged_dot implementation={implementation}",
             lambda x, w, i=implementation: gpu.tokamax_ragged_dot(x, w, sizes, implementation=i))
  # jax's Mosaic GPU kernels with jaxlm's VJP (kernels.grouped_matmul=mosaic): Hopper GPUs, 16-bit operands.
  from jaxlm.kernels import mosaic_grouped
  timeit("mosaic (jax's Mosaic GPU kernels, jaxlm's VJP)", lambda x, w: mosaic_grouped.grouped_matmul(x, w, sizes),
         skipped=mosaic_grouped.unavailable())
  for m in ((256, 1024) if SMALL else (1024, 2048)):
    timeit(f"padded blocks of {m}, scanned", padded_blocks(m, False))
    timeit(f"padded blocks of {m}, weights gathered", padded_blocks(m, True))


if __name__ == "__main__":
  main()
