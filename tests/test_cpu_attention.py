"""kernels.attention=cpu_fused (jaxlm/kernels/cpu_attention.cc): output and q/k/v gradients against the einsum
reference for multi-head, grouped and multi-query heads, packed documents, query blocks that do or do not divide T,
large scores; a query that sees no key; the refusals; remat=dots keeping its forward. Whole models:
tests/test_kernels.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm.kernels import cpu as blas
from jaxlm.kernels.attention import dot_product_attention
from jaxlm.kernels.registry import REMAT_POLICIES
from jaxlm.models.masks import causal_mask

pytestmark = pytest.mark.skipif(blas.compiler() is None, reason="kernels.attention=cpu_fused needs a C++ compiler")



def _inputs(b, t, h, g, k, documents, scale=1.0, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, h, k)) * scale, jnp.float32)
  keys, values = (jnp.asarray(rng.standard_normal((b, t, g, k)) * scale, jnp.float32) for _ in range(2))
  segments = np.cumsum(rng.random((b, t)) < 0.15, axis=1) + 1 if documents else np.ones((b, t))
  return q, keys, values, causal_mask(jnp.asarray(segments, jnp.int32))


@pytest.mark.parametrize("b, t, h, g, k, block, documents, scale", [
    (2, 16, 4, 4, 8, 4, False, 1.0),  # multi-head, blocks divide T
    (2, 19, 4, 2, 8, 5, True, 1.0),  # grouped heads, a short last block, packed documents
    (3, 33, 6, 1, 16, 8, True, 1.0),  # multi-query
    (1, 12, 2, 2, 8, 64, False, 1.0),  # one block longer than T
    (2, 24, 2, 2, 8, 8, True, 6.0),  # scores in the tens: the exp's range
    (8, 64, 6, 6, 16, 8, True, 1.0),  # 48 tasks over the pool's threads, many taken late
])
def test_fused_attention_and_gradients_equal_einsum_attention(b, t, h, g, k, block, documents, scale):
  q, keys, values, mask = _inputs(b, t, h, g, k, documents, scale)
  dout = jnp.asarray(np.random.default_rng(9).standard_normal(q.shape), jnp.float32)

  def value_and_grads(attend):
    out, vjp = jax.vjp(attend, q, keys, values)
    return out, vjp(dout)

  reference = jax.jit(lambda *a: value_and_grads(lambda q, k, v: dot_product_attention(q, k, v, mask)))()
  got = jax.jit(lambda *a: value_and_grads(lambda q, k, v: blas.fused_attention(q, k, v, mask, block)))()
  # Scores near 100 (scale 6): rounding them to f32 alone moves outputs by ~2e-5, on both paths (each is within
  # 2.5e-5 of a float64 computation there).
  chex.assert_trees_all_close(got, reference, rtol=1e-5, atol=2e-5 if scale == 1 else 1e-4)


def test_a_query_that_sees_no_key_gets_zeros():
  q, keys, values, mask = _inputs(1, 8, 2, 2, 4, documents=False)
  mask = mask.at[:, 3].set(False)  # query 3 sees nothing
  q = q / 2.0  # the kernel takes q already scaled by 1 / sqrt(K)
  out, lse = jax.jit(blas.attention_forward, static_argnums=4)(q, keys, values, mask, 4)
  assert np.all(np.asarray(out[:, 3]) == 0) and np.all(np.isneginf(np.asarray(lse[:, :, 3])))
  dout = jnp.asarray(np.random.default_rng(3).standard_normal(q.shape), jnp.float32)
  grads = jax.jit(blas.attention_backward, static_argnums=7)(q, keys, values, mask, out, lse, dout, 4)
  assert np.all(np.asarray(grads[0][:, 3]) == 0) and all(np.isfinite(np.asarray(g)).all() for g in grads)
  # Everything else is the reference's, where query 3 (uniform over every key there) gets no output gradient.
  attend = lambda q, k, v: dot_product_attention(q * 2.0, k, v, mask)  # the kernel's function of its q
  reference, vjp = jax.vjp(attend, q, keys, values)
  dq, dk, dv = vjp(dout.at[:, 3].set(0.0))
  for got, expected in ((out, reference), (grads[0], dq)):
    np.testing.assert_allclose(np.delete(np.asarray(got), 3, axis=1), np.delete(np.asarray(expected), 3, axis=1),
                               rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(grads[1:], (dk, dv), rtol=1e-5, atol=1e-5)


def test_refusals_are_one_line_errors():
  q, keys, values, mask = _inputs(1, 8, 2, 2, 4, documents=False)
  with pytest.raises(ValueError, match="float32"):
    blas.fused_attention(q.astype(jnp.bfloat16), keys, values, mask, 4)
  with pytest.raises(ValueError, match="as many keys as queries"):
    blas.fused_attention(q, keys[:, :4], values[:, :4], mask[:, :, :4], 4)



def test_remat_dots_keeps_the_forward_kernels_outputs():
  """Under remat=dots the backward pass uses the saved output and log-sum-exp: one forward kernel call per
  layer, not a second one to rebuild them."""
  q, keys, values, mask = _inputs(1, 8, 2, 2, 4, documents=False)

  def hlo(remat):
    layer = lambda q: jnp.sum(jnp.sin(blas.fused_attention(q, keys, values, mask, 4)))
    return jax.jit(jax.value_and_grad(jax.checkpoint(layer, policy=REMAT_POLICIES[remat]))).lower(q).as_text()

  assert hlo("dots").count(f"{blas.ATTENTION_TARGETS[0]}") == 1
  assert hlo("full").count(f"{blas.ATTENTION_TARGETS[0]}") == 2  # the control: remat=full does rebuild them
