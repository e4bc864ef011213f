"""The Mosaic GPU grouped matmul's custom VJP (jaxlm/kernels/mosaic_grouped.py) against autodiff of
jax.lax.ragged_dot: values and both gradients, with uneven groups, empty groups (first, inside, last) and rows past
the groups, which must give zero output and zero gradient.

On the CPU (and any machine without a Hopper GPU) the kernels' places are taken by XLA's ragged_dot functions, in
float32, so the VJP's wiring, the block rule, the fallbacks and the zeroed rows are tested everywhere. On a Hopper GPU
the `mosaic` cases run jax's real kernels (benchmarks/gpu_checks.sh's test_mosaic part); those take 16-bit operands
only, so they run in bfloat16 against the float32 reference on the same rounded values."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxlm.config import KernelsConfig
from jaxlm.kernels import Kernels, mosaic_grouped, resolve
from jaxlm.kernels.registry import runnable_on

# M, K and N in whole blocks: 256 and 128 take blocks of 128, 192 of 64.
M, K, N = 256, 128, 192
SIZES = [0, 70, 0, 100, 50, 0]  # 220 rows in groups, 36 past them
REASON = mosaic_grouped.unavailable()


def _operands(m=M, k=K, n=N, sizes=SIZES, dtype=jnp.float32):
  kx, kw, kd = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
  w = jax.random.normal(kw, (len(sizes), k, n), jnp.float32).astype(dtype)
  dy = jax.random.normal(kd, (m, n), jnp.float32).astype(dtype)
  return x, w, jnp.asarray(sizes, jnp.int32), dy


def _value_and_grads(fn, x, w, sizes, dy):
  """(y, dx, dw) of sum(fn(x, w) * dy), jitted."""
  def run(x, w):
    y, vjp = jax.vjp(lambda x, w: fn(x, w, sizes), x, w)
    return (y, *vjp(dy))
  return jax.jit(run)(x, w)


def _reference(x, w, sizes, dy):
  """Autodiff of jax.lax.ragged_dot in float32, on the same (possibly rounded) values."""
  f32 = [a.astype(jnp.float32) for a in (x, w, dy)]
  return _value_and_grads(jax.lax.ragged_dot, f32[0], f32[1], sizes, f32[2])


def _check(got, want, rtol, atol_scale):
  for name, g, e in zip(("y", "dx", "dw"), got, want, strict=True):
    g, e = np.asarray(g, np.float32), np.asarray(e, np.float32)
    np.testing.assert_allclose(g, e, rtol=rtol, atol=atol_scale * np.abs(e).max(), err_msg=name)


@pytest.mark.parametrize("kernels", ["xla", pytest.param("mosaic", marks=pytest.mark.skipif(
    REASON is not None, reason=f"the Mosaic GPU kernels {REASON}"))])
def test_custom_vjp_equals_autodiff_of_ragged_dot(kernels):
  calls, dtype, tol = ((mosaic_grouped.XLA, jnp.float32, (1e-5, 1e-6)) if kernels == "xla"
                       else (mosaic_grouped.MOSAIC, jnp.bfloat16, (2e-2, 1e-2)))
  x, w, sizes, dy = _operands(dtype=dtype)
  assert mosaic_grouped.blocks(M, K, N) and mosaic_grouped.blocks(K, M, N)  # every call runs `calls`, no fallback
  got = _value_and_grads(lambda x, w, s: mosaic_grouped.grouped_matmul(x, w, s, calls), x, w, sizes, dy)
  _check(got, _reference(x, w, sizes, dy), *tol)
  y, dx, dw = got
  past = int(sum(SIZES))
  assert not np.any(np.asarray(y[past:])) and not np.any(np.asarray(dx[past:]))  # rows past the groups: zeros
  assert not np.any(np.asarray(dw[np.asarray(SIZES) == 0]))  # an empty group's weight gets no gradient


def _unwritten_rows(lhs, rhs, *, group_sizes, **kwargs):
  """XLA's ragged_dot with the rows past the groups left as garbage, as the kernel leaves them."""
  out = mosaic_grouped.xla_ragged_dot(lhs, rhs, group_sizes=group_sizes, **kwargs)
  past = jnp.arange(out.shape[0]) >= jnp.sum(group_sizes)
  return jnp.where(past[:, None], jnp.nan, out)


def test_rows_the_kernel_leaves_unwritten_come_out_zero():
  calls = mosaic_grouped.XLA._replace(ragged_dot=_unwritten_rows)
  x, w, sizes, dy = _operands()
  got = _value_and_grads(lambda x, w, s: mosaic_grouped.grouped_matmul(x, w, s, calls), x, w, sizes, dy)
  _check(got, _reference(x, w, sizes, dy), 1e-5, 1e-6)


def _refused(*args, **kwargs):
  raise AssertionError("a call the kernels cannot take reached them")


def test_shapes_and_dtypes_the_kernels_refuse_run_xla_ragged_dot():
  """Rows not in whole blocks (a decoding step's few tokens), and float32 for the 16-bit kernels."""
  refusing = mosaic_grouped.Calls(_refused, _refused, ("float32",))
  assert mosaic_grouped.blocks(40, K, N) is None and mosaic_grouped.blocks(M, 96, N) is None
  assert mosaic_grouped.blocks(M, 64, N) is None  # one contracted block: too few pipeline steps
  x, w, sizes, dy = _operands(m=40, sizes=[11, 0, 20, 5])
  got = _value_and_grads(lambda x, w, s: mosaic_grouped.grouped_matmul(x, w, s, refusing), x, w, sizes, dy)
  _check(got, _reference(x, w, sizes, dy), 1e-5, 1e-6)
  x, w, sizes, dy = _operands()  # float32 with the real kernels' table: XLA's ragged_dot, here and on a GPU
  _check(_value_and_grads(mosaic_grouped.grouped_matmul, x, w, sizes, dy), _reference(x, w, sizes, dy), 1e-5, 1e-6)


def test_block_rule():
  assert mosaic_grouped.blocks(32768, 1024, 5632) == dict(block_m=128, block_n=128, block_k=64,
                                                          max_concurrent_steps=4, grid_block_n=4)
  small = mosaic_grouped.blocks(192, 128, 320)  # 128 divides neither 192 nor 320
  assert (small["block_m"], small["block_n"], small["grid_block_n"]) == (64, 64, 1)


def test_the_expert_matmul_branch_and_remat_keep_the_contract():
  """Kernels(grouped_matmul=mosaic) as a model calls it (float32 here: XLA's ragged_dot), under remat=dots."""
  kernels = dataclasses.replace(Kernels(), grouped_matmul="mosaic")
  x, w, sizes, dy = _operands()
  policy = jax.checkpoint_policies.save_only_these_names(mosaic_grouped.CHECKPOINT_NAME)
  fn = jax.checkpoint(kernels.expert_matmul, policy=policy)
  _check(_value_and_grads(fn, x, w, sizes, dy), _reference(x, w, sizes, dy), 1e-5, 1e-6)


def test_choosing_mosaic_where_it_cannot_run_is_a_one_line_error():
  with pytest.raises(ValueError) as error:
    resolve(KernelsConfig(grouped_matmul="mosaic"), compute_dtype="float32", platform="cpu")
  message = str(error.value)
  assert "\n" not in message and message.startswith("kernels.grouped_matmul=mosaic runs on gpu, not cpu; here use "
                                                    "one of: auto, ragged_dot"), message
  with pytest.raises(ValueError, match="computes in bfloat16/float16, not model.compute_dtype=float32"):
    resolve(KernelsConfig(grouped_matmul="mosaic"), compute_dtype="float32", platform="gpu")
  if jax.default_backend() != "gpu":
    assert REASON and "Hopper" in REASON


def test_auto_does_not_pick_it_until_measured_and_the_planner_stands_in():
  gpu = resolve(KernelsConfig(), compute_dtype="bfloat16", platform="gpu", devices=1)
  assert gpu.grouped_matmul == "ragged_dot"
  if jax.default_backend() == "gpu" and REASON:  # a GPU that cannot run the kernels: choosing them is the error
    with pytest.raises(ValueError, match="kernels.grouped_matmul=mosaic needs"):
      resolve(KernelsConfig(grouped_matmul="mosaic"), compute_dtype="bfloat16", platform="gpu", devices=1)
    return
  chosen = resolve(KernelsConfig(grouped_matmul="mosaic"), compute_dtype="bfloat16", platform="gpu", devices=1)
  assert chosen.grouped_matmul == "mosaic"
  if REASON:
    assert runnable_on(chosen, jax.default_backend()).grouped_matmul == "ragged_dot"


def test_inside_shard_map_a_weight_the_devices_share_gets_the_summed_gradient():
  """As the MoE layer calls it on a mesh: each device its own rows and sizes, the weights replicated."""
  devices = min(jax.device_count(), 4)
  mesh = jax.make_mesh((devices,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
  rows = 128
  x, w, _, dy = _operands(m=devices * rows, sizes=SIZES)
  sizes = jnp.asarray([[0, 40 + 10 * d, 0, 30, 20, 0] for d in range(devices)], jnp.int32)
  spec = jax.sharding.PartitionSpec

  def per_device(fn):
    run = jax.shard_map(lambda x, w, s, dy: jnp.sum(fn(x, w, s[0]) * dy)[None], mesh=mesh,
                        in_specs=(spec("data"), spec(), spec("data"), spec("data")), out_specs=spec("data"))
    return jax.jit(jax.grad(lambda x, w: jnp.sum(run(x, w, sizes, dy)), argnums=(0, 1)))(x, w)

  ours = per_device(lambda x, w, s: mosaic_grouped.grouped_matmul(x, w, s, mosaic_grouped.XLA))
  for got, want in zip(ours, per_device(jax.lax.ragged_dot), strict=True):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
