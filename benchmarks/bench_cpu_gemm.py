"""The CPU bench step's matmul shapes, one at a time: XLA:CPU (jax), jaxlm's OpenBLAS custom call (kernels.matmul=blas,
jaxlm/kernels/cpu.py) and torch's CPU GEMM, GFLOP/s.

  JAX_PLATFORMS=cpu GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/bench_cpu_gemm.py

Why it exists: most of a CPU train step is matmuls, and this says how much of a gap to torch on the CPU is the GEMM
library itself, and whether `auto` should keep picking the BLAS matmuls. Shapes: the vocabulary head (forward, both
gradients, whole and per 512-token chunk), an MLP projection and 1024^3, f32. Each figure is the mean of 10 runs
after a warm-up. Needs torch (the `hf` extra).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jaxlm.kernels import cpu

# name -> (shape of a, shape of b, layout): "nn" a @ b, "nt" a @ b.T, "tn" a.T @ b
SHAPES = {
    "head logits [2048,384] x [8192,384]^T": ((2048, 384), (8192, 384), "nt"),
    "head dx [2048,8192] x [8192,384]": ((2048, 8192), (8192, 384), "nn"),
    "head dW [2048,8192]^T x [2048,384]": ((2048, 8192), (2048, 384), "tn"),
    "chunk logits [512,384] x [8192,384]^T": ((512, 384), (8192, 384), "nt"),
    "chunk dW [512,8192]^T x [512,384]": ((512, 8192), (512, 384), "tn"),
    "mlp up [2048,384] x [384,1536]": ((2048, 384), (384, 1536), "nn"),
    "1024^3": ((1024, 1024), (1024, 1024), "nn"),
}
PRODUCTS = {"nn": lambda a, b: a @ b, "nt": lambda a, b: a @ b.T, "tn": lambda a, b: a.T @ b}


def seconds(fn, repeats: int = 10) -> float:
  jax.block_until_ready(fn())
  start = time.perf_counter()
  for _ in range(repeats):
    out = fn()
  jax.block_until_ready(out)  # a torch tensor passes through unchanged (torch's CPU ops are synchronous)
  return (time.perf_counter() - start) / repeats


def main():
  rng = np.random.default_rng(0)
  for name, (shape_a, shape_b, layout) in SHAPES.items():
    a, b = (rng.standard_normal(s).astype(np.float32) for s in (shape_a, shape_b))
    product = PRODUCTS[layout]
    flops = 2 * a.size * (b.shape[0] if layout == "nt" else b.shape[1])  # 2 * m * k * n
    jitted = jax.jit(product)
    a_jax, b_jax, a_torch, b_torch = jnp.asarray(a), jnp.asarray(b), torch.from_numpy(a), torch.from_numpy(b)
    jitted_blas = jax.jit(lambda a, b, layout=layout: cpu.gemm(a, b, layout[0] == "t", layout[1] == "t"))
    jax_rate = flops / seconds(lambda: jitted(a_jax, b_jax)) / 1e9
    blas_rate = flops / seconds(lambda: jitted_blas(a_jax, b_jax)) / 1e9
    torch_rate = flops / seconds(lambda: product(a_torch, b_torch)) / 1e9
    print(f"{name:40s} jax {jax_rate:6.1f} GFLOP/s  blas {blas_rate:6.1f}  torch {torch_rate:6.1f}  "
          f"jax/torch {jax_rate / torch_rate:.2f}  blas/torch {blas_rate / torch_rate:.2f}")


if __name__ == "__main__":
  main()
