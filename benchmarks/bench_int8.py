"""int8 x int8 -> int32 matmuls against bf16 and f32 on this machine's first device, and the op XLA chose for each.

  python benchmarks/bench_int8.py --batch=64 --seq=128 --out=runs/bench_int8.json     # CPU or one GPU

Shapes are GPT-2 small's projections ([B*T, 768] x [768, 3072] and back) and one whole int8 MLP as jaxlm.compress.int8
runs it (per-token input quantization, int32 accumulation, rescale). For every case: the best of --repeats wall times,
the achieved TFLOP/s, and the compiled HLO's matmul instructions (a `dot` on the CPU; on GPUs a custom call such as
`__cublas$gemm` / `__cublas$lt$matmul`, or a Triton fusion), so a report can name what XLA picked (int8 on GPUs through
XLA is uneven: jax-ml/jax#17688, openxla/xla#5796).
"""

from __future__ import annotations

import json
import re
import time

from absl import app, flags

_BATCH = flags.DEFINE_integer("batch", 64, "sequences")
_SEQ = flags.DEFINE_integer("seq", 128, "tokens per sequence")
_REPEATS = flags.DEFINE_integer("repeats", 20, "timed calls per case")
_OUT = flags.DEFINE_string("out", "", "write the results as JSON here")


def main(argv):
  del argv
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  from jaxlm.compress import int8  # noqa: PLC0415

  rows, d, f = _BATCH.value * _SEQ.value, 768, 3072
  key = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(key[0], (rows, d), jnp.float32)
  w_in = jax.random.normal(key[1], (d, f), jnp.float32) * 0.02
  w_out = jax.random.normal(key[2], (f, d), jnp.float32) * 0.02
  x8 = jnp.clip(jnp.round(x * 40), -127, 127).astype(jnp.int8)
  w8 = int8.quantize_array(w_in, (0,)).qvalue
  int8_in = int8.Int8Weight(int8.quantize_array(w_in, (0,)), None, "w8a8_dynamic")
  int8_out = int8.Int8Weight(int8.quantize_array(w_out, (0,)), None, "w8a8_dynamic")

  def mlp_float(x, a, b):
    return jnp.einsum("nf,fd->nd", jax.nn.gelu(jnp.einsum("nd,df->nf", x, a)), b)

  def mlp_int8(x, a, b):
    h = a.contract("btd,df->btf", x[None], jnp.einsum)  # the int8 weight's own matmul, as the kernels call it
    return b.contract("btf,fd->btd", jax.nn.gelu(h), jnp.einsum)[0]

  cases = {
      "dot f32": (lambda a, b: a @ b, (x, w_in)),
      "dot bf16": (lambda a, b: a @ b, (x.astype(jnp.bfloat16), w_in.astype(jnp.bfloat16))),
      "dot s8 x s8 -> s32": (lambda a, b: jax.lax.dot(a, b, preferred_element_type=jnp.int32), (x8, w8)),
      "mlp f32": (mlp_float, (x, w_in, w_out)),
      "mlp bf16": (mlp_float, (x.astype(jnp.bfloat16), w_in.astype(jnp.bfloat16), w_out.astype(jnp.bfloat16))),
      "mlp int8 W8A8 dynamic": (mlp_int8, (x, int8_in, int8_out)),
  }
  results = {"device_kind": jax.devices()[0].device_kind, "rows": rows, "d": d, "f": f}
  for name, (fn, args) in cases.items():
    compiled = jax.jit(fn).lower(*args).compile()
    ops = sorted({m.group(0) for m in re.finditer(
        r"(custom_call_target=\"[^\"]+\"|\b\w+\[[\d,]*\]\{?[\d,]*\}? dot\(|__triton\w*|kind=k\w+)",
        compiled.as_text())})
    jax.block_until_ready(compiled(*args))
    times = []
    for _ in range(_REPEATS.value):
      start = time.perf_counter()
      jax.block_until_ready(compiled(*args))
      times.append(time.perf_counter() - start)
    flops = 2 * rows * d * f * (2 if name.startswith("mlp") else 1)
    results[f"{name}/ms"] = 1e3 * min(times)
    results[f"{name}/tflops"] = flops / min(times) / 1e12
    results[f"{name}/ops"] = "; ".join(ops)[:400]
    print(f"{name:24s} {1e3 * min(times):9.3f} ms {flops / min(times) / 1e12:8.3f} TFLOP/s  {results[f'{name}/ops']}")
  if _OUT.value:
    with open(_OUT.value, "w") as fh:
      json.dump(results, fh, indent=2)


if __name__ == "__main__":
  app.run(main)
