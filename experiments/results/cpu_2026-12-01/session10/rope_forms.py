"""Session 10 (2026-12-01): one RoPE rotation in three forms (pair-swap with reverse, HF concatenate, stack),
cos/sin precomputed, and the HF form with the angles computed inside; forward and forward+backward times on the CPU, and the HLO ops each compiles to.
  JAX_PLATFORMS=cpu python experiments/results/cpu_2026-12-01/session10/rope_forms.py
"""
import time, statistics, jax, jax.numpy as jnp
x = jax.random.normal(jax.random.key(0), (8,256,8,64), jnp.float32); pos = jnp.broadcast_to(jnp.arange(256), (8,256))
half = 32
inv = 1.0 / 10000.0 ** (jnp.arange(0, 64, 2, dtype=jnp.float32) / 64)
ang = pos.astype(jnp.float32)[:, :, None] * inv[None, None, :]
cos, sin = jnp.cos(ang), jnp.sin(ang)
def rev(x, cos, sin):
  xp = x.reshape(*x.shape[:-1], 2, half)
  s = jnp.array([-1.0, 1.0]).reshape(1,1,1,2,1) * sin[:, :, None, None, :]
  return (xp * cos[:, :, None, None, :] + xp[..., ::-1, :] * s).reshape(x.shape)
def cat(x, cos, sin):
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  x1, x2 = x[..., :half], x[..., half:]
  return jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
def stk(x, cos, sin):
  c, s = cos[:, :, None, :], sin[:, :, None, :]
  xp = x.reshape(*x.shape[:-1], 2, half); x1, x2 = xp[..., 0, :], xp[..., 1, :]
  return jnp.stack([x1 * c - x2 * s, x2 * c + x1 * s], axis=-2).reshape(x.shape)
def inside(x, cos, sin):  # the angles computed from the positions inside the rotation (before session 10)
  del cos, sin
  a = pos.astype(jnp.float32)[:, :, None] * inv[None, None, :]
  return cat(x, jnp.cos(a), jnp.sin(a))
fs = {}
for n, f in [("rev", rev), ("cat", cat), ("stk", stk), ("inside", inside)]:
  fs[n+"_fwd"] = jax.jit(f)
  fs[n+"_vg"] = jax.jit(jax.value_and_grad(lambda x, c, s, f=f: jnp.sum(f(x, c, s) * x)))
ts = {n: [] for n in fs}
for f in fs.values(): jax.block_until_ready(f(x, cos, sin))
for r in range(10):
  for n, f in fs.items():
    t = time.perf_counter()
    for _ in range(10): out = f(x, cos, sin)
    jax.block_until_ready(out); ts[n].append((time.perf_counter()-t)/10*1e3)
print({n: f"{statistics.median(v):.2f}" for n, v in ts.items()})
for n in ("rev", "cat", "stk"):
  t = fs[n+"_vg"].lower(x, cos, sin).compile().as_text()
  print(n, "concat", t.count("concatenate("), "slice", t.count(" slice("), "fusion", t.count(" fusion("),
        "reverse", t.count("reverse("))
