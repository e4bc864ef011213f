"""kernels.matmul=blas (jaxlm/kernels/cpu.py): the sgemm custom call against float64 numpy for every transpose flag and
every way it splits the work over XLA's threads, its einsum mapping and gradients against jnp.einsum, the
refusals, and remat=dots keeping its outputs. Whole models against matmul=xla: tests/test_kernels.py."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm.kernels import cpu as blas
from jaxlm.kernels.registry import REMAT_POLICIES

# The kernel is compiled on first use; a machine without a C++ compiler cannot run kernels.matmul=blas at all.
pytestmark = pytest.mark.skipif(blas.compiler() is None, reason="kernels.matmul=blas needs a C++ compiler (g++)")

# (batch, m, k, n): one block; C's rows split (m >= n); its columns split; batch entries split; empty contraction.
SHAPES = [(None, 5, 7, 3), (None, 300, 200, 100), (None, 100, 200, 300), (6, 128, 64, 256), (None, 4, 0, 3)]


@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("batch, m, k, n", SHAPES)
def test_gemm_equals_numpy(batch, m, k, n, trans_a, trans_b):
  rng = np.random.default_rng(0)
  lead = (batch,) if batch else ()
  a = rng.standard_normal(lead + ((k, m) if trans_a else (m, k))).astype(np.float32)
  b = rng.standard_normal(lead + ((n, k) if trans_b else (k, n))).astype(np.float32)
  op = lambda x, t: np.swapaxes(x, -1, -2) if t else x
  expected = op(a, trans_a).astype(np.float64) @ op(b, trans_b)
  got = jax.jit(blas.gemm, static_argnums=(2, 3))(a, b, trans_a, trans_b)
  assert got.shape == expected.shape
  np.testing.assert_allclose(np.asarray(got), expected, rtol=1e-4, atol=1e-4)


EINSUMS = [
    ("btd,dhk->bthk", (2, 5, 6), (6, 3, 4)),  # attention projections
    ("btd,vd->btv", (2, 5, 6), (7, 6)),  # tied output table: w transposed
    ("...i,io->...o", (2, 3, 5, 6), (6, 4)),  # Dense
    ("bthk,hkd->btd", (2, 5, 3, 4), (3, 4, 6)),  # attention output: two contracted axes
    ("pcv,pcd->pvd", (2, 5, 7), (2, 5, 6)),  # cross-entropy table gradient: batched, x transposed
    ("bgrqk,bgsk->bgrqs", (2, 3, 2, 5, 4), (2, 3, 7, 4)),  # batched, w transposed
]


@pytest.mark.parametrize("subscripts, x_shape, w_shape", EINSUMS)
def test_einsum_value_and_gradients_equal_jnp_einsum(subscripts, x_shape, w_shape):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal(x_shape), jnp.float32)
  w = jnp.asarray(rng.standard_normal(w_shape), jnp.float32)

  def value_and_grads(einsum):
    loss = lambda x, w: jnp.sum(jnp.sin(einsum(subscripts, x, w)))
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)

  reference = lambda s, x, w: jnp.einsum(s, x, w, precision=jax.lax.Precision.HIGHEST)
  chex.assert_trees_all_close(value_and_grads(blas.einsum), value_and_grads(reference), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("subscripts, x_shape, w_shape", [
    ("btgrk,bsgk->bgrts", (1, 2, 1, 1, 4), (1, 3, 1, 4)),  # needs a transpose in memory
    ("ijj,jjk->ik", (2, 3, 3), (3, 3, 4)),  # repeated axes: a diagonal, not a matmul
    ("bd,bdk->bk", (2, 6), (3, 4, 5)),  # sizes that disagree
    ("i...j,jk->i...k", (2, 3, 4), (4, 5)),  # an ellipsis inside x
])
def test_einsum_refuses_what_is_not_a_plain_matmul(subscripts, x_shape, w_shape):
  with pytest.raises(ValueError, match="use kernels.matmul=xla"):
    blas.einsum(subscripts, jnp.ones(x_shape), jnp.ones(w_shape))


def test_gemm_under_vmap_equals_numpy():
  a, b = np.arange(24, dtype=np.float32).reshape(2, 3, 4), np.ones((2, 4, 5), np.float32)
  np.testing.assert_allclose(jax.vmap(blas.gemm)(a, b), a @ b)


def test_gemm_refuses_bfloat16_operands():
  with pytest.raises(ValueError, match="model.compute_dtype=float32"):
    blas.gemm(jnp.ones((2, 3), jnp.bfloat16), jnp.ones((3, 4), jnp.bfloat16))


def test_build_refuses_clearly_without_a_compiler(monkeypatch, tmp_path):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # nothing built there yet
  monkeypatch.setattr(blas, "compiler", lambda: None)
  with pytest.raises(RuntimeError, match="install g\\+\\+"):
    blas._build()


def _gemm_calls(remat: str) -> int:
  """jaxlm_gemm calls in the gradient's jaxpr (compiled, XLA would merge a recomputed gemm with the original one
  outside a layer scan) for two matmuls with a tanh between them, under `remat`."""
  x, w1, w2 = jnp.ones((8, 16)), jnp.ones((16, 32)), jnp.ones((32, 4))

  def block(x, w1, w2):
    return blas.einsum("nf,fo->no", jnp.tanh(blas.einsum("nd,df->nf", x, w1)), w2)

  block = jax.checkpoint(block, policy=REMAT_POLICIES[remat])
  jaxpr = jax.make_jaxpr(jax.grad(lambda *a: jnp.sum(jnp.sin(block(*a))), argnums=(0, 1, 2)))(x, w1, w2)
  return str(jaxpr).count(f"target_name={blas.TARGET}")


def test_remat_dots_saves_the_blas_matmul_outputs():
  """remat=dots keeps the custom calls' outputs as it keeps XLA's dots: the gradient runs 2 forward and 4
  backward gemms; remat=full recomputes the first one (the tanh's input) in the backward pass."""
  assert _gemm_calls("dots") == 6
  assert _gemm_calls("full") == 7
