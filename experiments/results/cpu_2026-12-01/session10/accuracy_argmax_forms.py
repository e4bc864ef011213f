"""Session 10: the cross-entropy accuracy's argmax over one [1024, 8192] chunk against exact replacements
(a: argmax, b: unique max, c: first index of the max, d: target is max and no tie before it), asserted equal.
  JAX_PLATFORMS=cpu python experiments/results/cpu_2026-12-01/session10/accuracy_argmax_forms.py
"""
import time, statistics, jax, jax.numpy as jnp, numpy as np
l = jax.random.normal(jax.random.key(0), (1, 1024, 8192), jnp.float32)
t = jax.random.randint(jax.random.key(1), (1, 1024), 0, 8192)
def a(l, t):
  m = l.max(-1); return m, (jnp.argmax(l, -1) == t)
def b(l, t):
  m = l.max(-1); tl = jnp.take_along_axis(l, t[..., None], -1)[..., 0]
  return m, (tl == m) & ((l == m[..., None]).sum(-1) == 1)
def c(l, t):
  m = l.max(-1)
  first = jnp.min(jnp.where(l == m[..., None], jax.lax.broadcasted_iota(jnp.int32, l.shape, 2), l.shape[-1]), -1)
  return m, first == t
def d(l, t):
  m = l.max(-1); tl = jnp.take_along_axis(l, t[..., None], -1)[..., 0]
  # ties before the target: any j < t with l[j] == m
  before = jnp.any((l == m[..., None]) & (jax.lax.broadcasted_iota(jnp.int32, l.shape, 2) < t[..., None]), -1)
  return m, (tl == m) & ~before
def e(l, t):
  m = l.max(-1); return m
fs = {k: jax.jit(f) for k, f in dict(a=a, b=b, c=c, d=d, max_only=e).items()}
for f in fs.values(): jax.block_until_ready(f(l, t))
for k in "abcd":
  assert np.array_equal(np.asarray(fs[k](l, t)[1]), np.asarray(fs["a"](l, t)[1])), k
ts = {k: [] for k in fs}
for r in range(10):
  for k, f in fs.items():
    s = time.perf_counter()
    for _ in range(10): out = f(l, t)
    jax.block_until_ready(out); ts[k].append((time.perf_counter() - s) / 10 * 1e3)
print({k: f"{statistics.median(v):.2f} ms" for k, v in ts.items()})
