"""One layer's causal self-attention on the CPU bench's shape (B=8, T=256, 6 heads of 64, f32), forward and
backward, side by side in one process: the einsum reference (kernels.attention=xla), causal_blocks with XLA's and
with BLAS matmuls, cpu_fused (jaxlm/kernels/cpu_attention.cc) per query block size, and torch's fused SDPA kernel.
It says which attention `auto` should pick on the CPU and which query block size.

  JAX_PLATFORMS=cpu GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python benchmarks/bench_cpu_attention.py

Prints the median and fastest milliseconds per forward+backward over the rounds (each round times every contender
in turn, after one untimed call). Needs torch (the `hf` extra) and a C++ compiler (cpu_fused, blas).
"""

import time

import jax
import jax.numpy as jnp
import numpy as np
import torch
from absl import app, flags

from jaxlm.kernels import Kernels
from jaxlm.models import masks

_ROUNDS = flags.DEFINE_integer("rounds", 5, "rounds (each times every contender)")
_CALLS = flags.DEFINE_integer("calls", 5, "forward+backward calls per contender per round")
B, T, H, K = 8, 256, 6, 64


def _jax_contenders(mask):
  kernels = {
      "xla (einsum reference)": Kernels(attention="xla"),
      "causal_blocks 32, XLA dots": Kernels(attention="causal_blocks", attention_block=32, matmul="xla"),
      "causal_blocks 32, blas": Kernels(attention="causal_blocks", attention_block=32, matmul="blas"),
  }
  for block in (32, 64, 128):
    kernels[f"cpu_fused {block}"] = Kernels(attention="cpu_fused", attention_block=block)
  attends = {name: (lambda q, k, v, kk=kk: kk.attend(q, k, v, mask, causal=True)) for name, kk in kernels.items()}

  def forward_backward(attend):
    def run(q, k, v, dout):
      _, vjp = jax.vjp(attend, q, k, v)
      return vjp(dout)
    return jax.jit(run)

  return {name: forward_backward(attend) for name, attend in attends.items()}


def main(argv):
  del argv
  rng = np.random.default_rng(0)
  q, k, v, dout = (rng.standard_normal((B, T, H, K), dtype=np.float32) for _ in range(4))
  mask = masks.causal_mask(jnp.ones((B, T), jnp.int32))
  jax_args = [jnp.asarray(a) for a in (q, k, v, dout)]
  torch_args = [torch.from_numpy(a).transpose(1, 2).contiguous() for a in (q, k, v, dout)]  # [B, H, T, K]

  def torch_sdpa():
    tq, tk, tv = (a.clone().requires_grad_() for a in torch_args[:3])
    torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True).backward(torch_args[3])
    return tq.grad

  calls = {name: (lambda fn=fn: jax.block_until_ready(fn(*jax_args))) for name, fn in _jax_contenders(mask).items()}
  calls["torch SDPA (is_causal)"] = torch_sdpa
  ms = {name: [] for name in calls}
  for _ in range(_ROUNDS.value):
    for name, call in calls.items():
      call()  # untimed: compile on the first round, warm caches after the others
      start = time.perf_counter()
      for _ in range(_CALLS.value):
        call()
      ms[name].append((time.perf_counter() - start) / _CALLS.value * 1e3)
  for name, times in ms.items():
    print(f"{name:28s} forward+backward median {np.median(times):6.1f} ms  fastest {min(times):6.1f} ms")


if __name__ == "__main__":
  app.run(main)
