"""The tokamax wrappers (jaxlm/kernels/gpu.py) against jaxlm's XLA references: values and gradients, in f32 on the
CPU through tokamax's portable path (implementation="xla"; its Pallas kernels need a GPU or TPU).

Tolerance everywhere: rtol 1e-5, atol 1e-6 (tokamax orders some f32 reductions differently); the correct count is
compared exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("tokamax")

from jaxlm.kernels import attention, gpu, xla  # noqa: E402

TOL = dict(rtol=1e-5, atol=1e-6)


def _normal(key, *shape):
  return jax.random.normal(key, shape, jnp.float32)


def _close(actual, expected):
  for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
    np.testing.assert_allclose(np.asarray(a), np.asarray(e), **TOL)


def _check(ours, reference, *args):
  """Values, and the gradients for every argument of sum(f(*args) * a random cotangent), jitted."""
  _close(jax.jit(ours)(*args), jax.jit(reference)(*args))
  dout = _normal(jax.random.key(99), *jax.eval_shape(reference, *args).shape)
  grad = lambda f: jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) * dout), argnums=tuple(range(len(args)))))(*args)
  _close(grad(ours), grad(reference))


def test_available():
  assert gpu.tokamax_unavailable() is None


def _packed_mask(b: int, t: int) -> jax.Array:
  """Causal attention within two packed documents per row, split at a different position in each row."""
  splits = jnp.array([3, 5])[:b]
  pos = jnp.arange(t)
  segment_BT = (pos[None, :] >= splits[:, None]).astype(jnp.int32)
  same_BTS = segment_BT[:, :, None] == segment_BT[:, None, :]
  return same_BTS & (pos[:, None] >= pos[None, :])[None]


def _qkv(seed: int, b=2, t=8, h=4, g=2, k=8):  # GQA: 4 query heads over 2 key/value heads
  kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
  return _normal(kq, b, t, h, k), _normal(kk, b, t, g, k), _normal(kv, b, t, g, k)


@pytest.mark.parametrize("masking", ["packed", "causal_no_mask", "packed_not_causal"])
def test_attention_gqa(masking):
  q, k, v = _qkv(0)
  b, t = q.shape[:2]
  packed = _packed_mask(b, t)
  causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  if masking == "packed":  # the mask is passed, and `causal` says it hides every later key
    mask, is_causal, reference_mask = packed, True, packed
  elif masking == "causal_no_mask":  # no mask tensor: tokamax's own causal mask
    mask, is_causal, reference_mask = None, True, causal
  else:  # the mask alone, no causal hint
    mask, is_causal, reference_mask = packed, False, packed
  _check(lambda q, k, v: gpu.tokamax_attention(q, k, v, mask, is_causal, implementation="xla"),
         lambda q, k, v: attention.dot_product_attention(q, k, v, reference_mask), q, k, v)


def test_attention_keeps_documents_apart():
  """Changing the first document's keys and values must not move the second document's outputs."""
  q, k, v = _qkv(1)
  mask = _packed_mask(*q.shape[:2])
  f = jax.jit(lambda q, k, v: gpu.tokamax_attention(q, k, v, mask, True, implementation="xla"))
  out, out2 = f(q, k, v), f(q, k.at[:, :3].add(5.0), v.at[:, :3].add(5.0))
  np.testing.assert_array_equal(np.asarray(out[:, 5:]), np.asarray(out2[:, 5:]))
  assert not np.allclose(np.asarray(out[:, :3]), np.asarray(out2[:, :3]))


def test_attention_rejects_a_non_bool_mask():
  q = jnp.zeros((1, 4, 2, 8))
  with pytest.raises(ValueError, match="bool mask"):
    gpu.tokamax_attention(q, q, q, jnp.ones((1, 4, 4), jnp.float32), True, implementation="xla")


def _norm_inputs(seed: int):
  kx, ks, kb = jax.random.split(jax.random.key(seed), 3)
  return _normal(kx, 2, 3, 16) * 3 + 1, 1 + 0.1 * _normal(ks, 16), 0.1 * _normal(kb, 16)


def test_layer_norm():
  x, scale, bias = _norm_inputs(2)
  _check(lambda x, s, b: gpu.tokamax_layer_norm(x, s, b, 1e-5, implementation="xla"),
         lambda x, s, b: xla.layer_norm(x, s, b, 1e-5), x, scale, bias)


def test_rms_norm():
  x, scale, _ = _norm_inputs(3)
  _check(lambda x, s: gpu.tokamax_rms_norm(x, s, 1e-6, implementation="xla"),
         lambda x, s: xla.rms_norm(x, s, 1e-6), x, scale)


def test_norms_return_f32_from_bf16():
  x, scale, bias = _norm_inputs(4)
  xb = x.astype(jnp.bfloat16)
  layer = gpu.tokamax_layer_norm(xb, scale, bias, 1e-5, implementation="xla")
  rms = gpu.tokamax_rms_norm(xb, scale, 1e-6, implementation="xla")
  assert layer.dtype == rms.dtype == jnp.float32
  _close((layer, rms), (xla.layer_norm(xb, scale, bias, 1e-5), xla.rms_norm(xb, scale, 1e-6)))


def test_glu():
  kx, kg, ku = jax.random.split(jax.random.key(5), 3)
  x, wg, wu = _normal(kx, 2, 3, 16), _normal(kg, 16, 24) / 4, _normal(ku, 16, 24) / 4
  _check(lambda x, wg, wu: gpu.tokamax_glu(x, wg, wu, implementation="xla"), xla.glu, x, wg, wu)


V = 40


def _ce_inputs(seed: int, n: int = 12, d: int = 16):
  kx, kt, ky = jax.random.split(jax.random.key(seed), 3)
  x, table = _normal(kx, n, d), _normal(kt, V, d) / 2
  targets = jax.random.randint(ky, (n,), 0, V)
  targets = targets.at[:4].set(jnp.argmax(x[:4] @ table.T, axis=-1))  # some rows predicted right
  weights = jnp.ones(n).at[jnp.array([1, 6, 7])].set(0.0)  # a 0/1 loss mask with 3 dropped rows
  return x, table, targets.at[7].set(V + 3), weights  # a dropped row's target out of range (padding)


def test_cross_entropy():
  x, table, targets, weights = _ce_inputs(6)
  ours = jax.jit(lambda x, t: gpu.tokamax_cross_entropy(x, t, targets, weights, implementation="xla", chunk=5))
  reference = jax.jit(lambda x, t: xla.cross_entropy_sums(x, t, jnp.clip(targets, 0, V - 1), weights))
  (loss, correct), (ref_loss, ref_correct) = ours(x, table), reference(x, table)
  _close(loss, ref_loss)
  assert float(correct) == float(ref_correct) >= 3  # the weighted count of correct argmaxes, exactly
  grad = lambda f: jax.jit(jax.grad(lambda *a: f(*a)[0], argnums=(0, 1)))(x, table)
  dx, dtable = grad(ours)
  _close((dx, dtable), grad(reference))
  assert np.all(np.asarray(dx)[np.asarray(weights) == 0] == 0)  # dropped rows get no gradient


def test_cross_entropy_eager_and_bf16_inputs_use_f32_logits():
  x, table, targets, weights = _ce_inputs(7)
  xb, tb = x.astype(jnp.bfloat16), table.astype(jnp.bfloat16)
  loss, correct = gpu.tokamax_cross_entropy(xb, tb, targets, weights, implementation="xla")
  ref_loss, ref_correct = xla.cross_entropy_sums(xb, tb, jnp.clip(targets, 0, V - 1), weights)
  _close(loss, ref_loss)
  assert float(correct) == float(ref_correct)


def test_cross_entropy_rejects_fractional_weights():
  x, table, targets, weights = _ce_inputs(8)
  with pytest.raises(ValueError, match="0/1 weights"):
    gpu.tokamax_cross_entropy(x, table, targets, weights * 0.5, implementation="xla")
  traced = jax.jit(lambda w: gpu.tokamax_cross_entropy(x, table, targets, w, implementation="xla")[0])
  assert np.isnan(float(traced(weights * 0.5)))  # under jit the weights are unknown: the loss is NaN, not wrong
  assert np.isfinite(float(traced(weights)))


def _scan_bodies(jaxpr):
  for eqn in jaxpr.eqns:
    for param in eqn.params.values():
      sub = getattr(param, "jaxpr", param)
      if hasattr(sub, "eqns"):
        if eqn.primitive.name == "scan":
          yield sub
        yield from _scan_bodies(sub)


def test_cross_entropy_count_pass_has_no_backward():
  """Under jax.grad the correct-count pass runs its primal: a scan whose body has one matmul (the logits), not the
  custom-vjp forward rule's three (logits, d(x), d(table))."""
  x, table, targets, weights = _ce_inputs(9)
  f = lambda x, t: gpu.tokamax_cross_entropy(x, t, targets, weights, implementation="xla", chunk=4)[0]
  bodies = list(_scan_bodies(jax.make_jaxpr(jax.grad(f, argnums=(0, 1)))(x, table).jaxpr))
  assert len(bodies) == 1
  assert sum(e.primitive.name == "dot_general" for e in bodies[0].eqns) == 1
