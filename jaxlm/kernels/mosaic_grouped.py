"""The experts' grouped matmul on Hopper GPUs (kernels.grouped_matmul=mosaic): jax's own Mosaic GPU kernels
(jax.experimental.pallas.ops.gpu: ragged_dot_mgpu, transposed_ragged_dot_mgpu), which ship without a gradient rule,
joined here into one differentiable op with its own VJP, as the CPU's BLAS grouped matmul (jaxlm/kernels/cpu.py):

  y  = ragged_dot(x, w)                          [M, N]     y_g  = x_g @ w[g]
  dx = ragged_dot(dy, w, transpose_rhs=True)     [M, K]     dx_g = dy_g @ w[g]^T
  dw = transposed_ragged_dot(x, dy)              [G, K, N]  dw[g] = x_g^T @ dy_g (ragged over the contracted rows)

It computes what `jax.lax.ragged_dot(x, w, group_sizes)` computes, with `Kernels.expert_matmul`'s contract: rows
past the groups give zero output and zero gradient (the kernels leave those rows unwritten, so they are zeroed
here). Why: XLA:GPU's ragged_dot runs far behind the ideal batched matmul of equal groups, and tokamax's kernels
did not run on the GPU images' jax (benchmarks/results/grouped_matmul_implementations.md).

The kernels' WGMMA takes a transposed operand only in 16-bit types, so other dtypes run `jax.lax.ragged_dot` whole.
Each kernel wants its dimensions in whole blocks: a call whose shapes no block fits runs XLA's ragged_dot instead
(per call, so the forward may use the kernel while a backward call does not). The three calls come in a `Calls`
table, so the CPU tests run this VJP with XLA's functions in the kernels' places (`XLA`).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from jaxlm.kernels import cpu, gpu

CHECKPOINT_NAME = "mosaic_grouped_matmul"  # the output's name: remat=dots saves it like XLA's dot outputs
BLOCK_K = 64  # contracted rows per pipeline step: 4 steps of 128 x 64 and 64 x 128 bf16 tiles fit shared memory
STEPS = 4  # pipeline steps in flight (max_concurrent_steps)


class Calls(NamedTuple):
  """The three kernel calls, with the signatures of jax's Mosaic GPU kernels (block sizes as keyword arguments),
  and the operand dtypes they take."""
  ragged_dot: Callable  # (lhs [M, K], rhs [G, K, N] ([G, N, K] with transpose_rhs), *, group_sizes, ...) -> [M, N]
  transposed_ragged_dot: Callable  # (lhs [R, M], rhs [R, N], *, group_sizes, ...) -> [G, M, N], ragged over R
  dtypes: tuple[str, ...]


def xla_ragged_dot(lhs, rhs, *, group_sizes, transpose_rhs: bool = False, **_blocks) -> jax.Array:
  """XLA's ragged_dot in the kernel's signature: the reference, and the fallback for shapes the kernel refuses."""
  numbers = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((1,), (2 if transpose_rhs else 1,)), ((), ())), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[0])
  return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, numbers)


def xla_transposed_ragged_dot(lhs, rhs, *, group_sizes, **_blocks) -> jax.Array:
  """lhs_g^T @ rhs_g per group of rows (XLA's ragged_dot_general, ragged over the contracted axis) [G, M, N]."""
  numbers = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(((0,), (0,)), ((), ())),
                                              lhs_ragged_dimensions=[0], rhs_group_dimensions=[])
  return jax.lax.ragged_dot_general(lhs, rhs, group_sizes, numbers)


def _mosaic_ragged_dot(lhs, rhs, **kwargs) -> jax.Array:
  from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu  # imported on use: it loads Mosaic GPU
  with jax.numpy_rank_promotion("allow"):  # jax's kernel code, not written for jaxlm's strict rank promotion
    return ragged_dot_mgpu.ragged_dot(lhs, rhs, **kwargs)


def _mosaic_transposed_ragged_dot(lhs, rhs, **kwargs) -> jax.Array:
  from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu
  with jax.numpy_rank_promotion("allow"):
    return transposed_ragged_dot_mgpu.transposed_ragged_dot(lhs, rhs, **kwargs)


MOSAIC = Calls(_mosaic_ragged_dot, _mosaic_transposed_ragged_dot, ("bfloat16", "float16"))
XLA = Calls(xla_ragged_dot, xla_transposed_ragged_dot, ("float32", "bfloat16", "float16"))


@functools.cache
def unavailable() -> str | None:
  """Why the kernels cannot run here, or None: they need an NVIDIA Hopper GPU (WGMMA, compute capability 9.x) and
  a jax that ships them."""
  if jax.default_backend() != "gpu":
    return f"needs an NVIDIA Hopper GPU (this backend: {jax.default_backend()})"
  missing = gpu.nvidia_missing("compute capability 9.x, a Hopper GPU such as the H100 or H200", 9.0, below=10.0)
  if missing:
    return missing
  try:
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu  # noqa: F401
  except Exception as e:  # pylint: disable=broad-except  # ImportError, or a module that fails on this jaxlib
    return f"jax {jax.__version__} lacks its Mosaic GPU ragged-dot kernels ({type(e).__name__}: {e})"
  if "transpose_rhs" not in inspect.signature(ragged_dot_mgpu.ragged_dot).parameters:  # earlier releases
    return f"jax {jax.__version__}'s Mosaic GPU ragged_dot has no transpose_rhs (the input gradient needs it)"
  return None


def _block(size: int) -> int:
  """The largest of 128 and 64 that divides `size`, or 0."""
  return next((b for b in (128, 64) if size % b == 0), 0)


def blocks(rows: int, contracted: int, cols: int) -> dict | None:
  """The kernels' block sizes for an output [rows, cols] contracting `contracted` (for transposed_ragged_dot: rows
  and cols of each group's output, `contracted` the ragged token rows), or None where no block fits: both kernels
  need the contracted size in whole blocks and tile their output in whole blocks (the store of a partial tile is
  not bounded). Two contracted blocks at least: ragged_dot's pipeline releases each step's buffers one step late
  (delay_release=1), which needs two steps in flight."""
  block_m, block_n = _block(rows), _block(cols)
  if not (block_m and block_n and contracted % BLOCK_K == 0 and contracted >= 2 * BLOCK_K):
    return None
  grid_n = cols // block_n
  # grid_block_n: how many column tiles one sweep down the rows covers (the kernels' snake order, for L2 reuse).
  return dict(block_m=block_m, block_n=block_n, block_k=BLOCK_K, max_concurrent_steps=STEPS,
              grid_block_n=next(w for w in (8, 4, 2, 1) if grid_n % w == 0))


def _zero_past_groups(y_MN: jax.Array, group_sizes_G: jax.Array) -> jax.Array:
  """The kernel writes only the groups' rows: the rest of its output is whatever the buffer held."""
  rows_M = jnp.arange(y_MN.shape[0], dtype=group_sizes_G.dtype)
  return jnp.where((rows_M < jnp.sum(group_sizes_G))[:, None], y_MN, jnp.zeros((), y_MN.dtype))


def _ragged_dot(calls: Calls, lhs_MK, rhs_GKN, group_sizes_G, transpose_rhs: bool = False) -> jax.Array:
  m, k = lhs_MK.shape
  n = rhs_GKN.shape[1] if transpose_rhs else rhs_GKN.shape[2]
  fitted = blocks(m, k, n)
  call = calls.ragged_dot if fitted else xla_ragged_dot
  out = call(lhs_MK, rhs_GKN, group_sizes=group_sizes_G, transpose_rhs=transpose_rhs, **(fitted or {}))
  return _zero_past_groups(cpu._varying_like(out, lhs_MK, rhs_GKN, group_sizes_G), group_sizes_G)


def _transposed_ragged_dot(calls: Calls, lhs_RM, rhs_RN, group_sizes_G) -> jax.Array:
  # Every [g, :, :] tile is written (an empty group's as zeros), and rows past the groups are never read.
  fitted = blocks(lhs_RM.shape[1], lhs_RM.shape[0], rhs_RN.shape[1])
  call = calls.transposed_ragged_dot if fitted else xla_transposed_ragged_dot
  out = call(lhs_RM, rhs_RN, group_sizes=group_sizes_G, **(fitted or {}))
  return cpu._varying_like(out, lhs_RM, rhs_RN, group_sizes_G)


def grouped_matmul(x_MK: jax.Array, w_GKN: jax.Array, group_sizes_G: jax.Array, calls: Calls = MOSAIC) -> jax.Array:
  """`jax.lax.ragged_dot(x, w, group_sizes)` through `calls` (default: the Mosaic GPU kernels), differentiable.
  Operands of different dtypes, or a dtype `calls` does not take, go to `jax.lax.ragged_dot` whole. Its output is
  named CHECKPOINT_NAME, so remat=dots keeps it as it keeps XLA's matmul outputs."""
  if x_MK.dtype != w_GKN.dtype or jnp.dtype(x_MK.dtype).name not in calls.dtypes:
    return jax.lax.ragged_dot(x_MK, w_GKN, group_sizes_G)
  # The kernels compute group boundaries in int32.
  return checkpoint_name(_grouped_matmul(x_MK, w_GKN, group_sizes_G.astype(jnp.int32), calls), CHECKPOINT_NAME)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _grouped_matmul(x_MK, w_GKN, group_sizes_G, calls):
  return _ragged_dot(calls, x_MK, w_GKN, group_sizes_G)


def _grouped_fwd(x_MK, w_GKN, group_sizes_G, calls):
  return _ragged_dot(calls, x_MK, w_GKN, group_sizes_G), (x_MK, w_GKN, group_sizes_G)


def _grouped_bwd(calls, residuals, dy_MN):
  x_MK, w_GKN, group_sizes_G = residuals
  dy_MN = dy_MN.astype(x_MK.dtype)
  # dx_g = dy_g @ w[g]^T: the kernel reads w as [G, N, K] through its transpose flag, no transpose in memory.
  dx_MK = _ragged_dot(calls, dy_MN, w_GKN, group_sizes_G, transpose_rhs=True)
  # dw[g] = x_g^T @ dy_g: x [M, K] is the kernel's lhs [R, M] with the token rows R ragged. The kernel masks the
  # rows of other groups by multiplying them by 0, so those rows must be finite (jaxlm's rows past the groups are).
  dw_GKN = _transposed_ragged_dot(calls, x_MK, dy_MN, group_sizes_G)
  # The sizes are integers (no cotangent); inside shard_map a weight the devices share gets its summed cotangent.
  return cpu._summed_to(dx_MK, x_MK), cpu._summed_to(dw_GKN.astype(w_GKN.dtype), w_GKN), None


_grouped_matmul.defvjp(_grouped_fwd, _grouped_bwd)
