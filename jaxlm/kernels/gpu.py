"""The GPU/TPU library kernels: cuDNN's flash attention (through jax.nn.dot_product_attention) and DeepMind's tokamax
(Pallas kernels for GPUs and TPUs), each wrapped to compute what its jaxlm reference in jaxlm.kernels.xla or
jaxlm.kernels.attention computes. Every tokamax wrapper takes `implementation=`, passed on to tokamax: None lets
tokamax pick its kernel for the device, "xla" is its portable path (what the CPU tests run)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from jaxlm.kernels import attention as xla_attention
from jaxlm.kernels import cross_entropy as chunked_ce


def nvidia_missing(needs: str, minimum: float, below: float = float("inf"), unknown: str = "0.0") -> str | None:
  """Why the first device is not an NVIDIA GPU of compute capability in [minimum, below), or None; `needs` says
  what the kernel needs, `unknown` is the capability assumed when the device does not report one."""
  device = jax.devices()[0]
  version = getattr(device.client, "platform_version", "cuda").lower()  # "cuda 12080", "rocm ..."
  if "cuda" not in version:
    return f"needs an NVIDIA GPU with {needs} (this GPU runs {version})"
  capability = str(getattr(device, "compute_capability", unknown))
  if not minimum <= float(capability) < below:
    return f"needs {needs}; this GPU has compute capability {capability}"
  return None


def cudnn_attention(q_BTHK, k_BSGK, v_BSGK, mask_BTS, causal: bool) -> jax.Array:
  """cuDNN's flash attention (bf16/fp16, NVIDIA GPUs); see `attention.library_attention` for the mask contract."""
  return xla_attention.library_attention(q_BTHK, k_BSGK, v_BSGK, mask_BTS, causal, implementation="cudnn")


# ------------------------------------------------------------------------------------------------ tokamax


@functools.cache
def tokamax_unavailable() -> str | None:
  """Why tokamax cannot be used here, or None."""
  try:
    import tokamax  # noqa: F401  (imported here only: a CPU run never needs it)
  except Exception as e:  # pylint: disable=broad-except  # ImportError, or a tokamax built for another jax
    return f"tokamax cannot be imported ({type(e).__name__}: {e}); pip install 'tokamax>=0.0.12'"
  return None


def _tokamax():
  reason = tokamax_unavailable()
  if reason:
    raise ImportError(reason)
  import tokamax
  from absl import flags
  if not flags.FLAGS.is_parsed():
    # tokamax reads its absl flags on first use and would parse sys.argv (pytest's, a notebook's) and fail on it.
    flags.FLAGS.mark_as_parsed()
  return tokamax


def _call(op: str, *args, **kwargs):
  tokamax = _tokamax()
  with jax.numpy_rank_promotion("allow"):  # tokamax broadcasts by rank promotion, which jaxlm's tests make an error
    return getattr(tokamax, op)(*args, **kwargs)


def _plain(name: str, w) -> None:
  if not isinstance(w, jax.Array):  # tracers are jax.Arrays; jaxlm.compress.quantization's int8 weights are not
    raise ValueError(f"tokamax takes plain float arrays; {name} is a {type(w).__name__} (a quantized weight?): "
                     "use the xla kernels for quantized models")


def tokamax_attention(q_BTHK, k_BSGK, v_BSGK, mask_BTS, causal: bool, *, implementation=None) -> jax.Array:
  """`attention.dot_product_attention` through tokamax.dot_product_attention. The bool mask [B, T, S] (causality and
  packed-document boundaries) is passed whole, as one [B, 1, T, S] mask for every head, so documents stay apart on
  every tokamax path; `causal` also tells the kernel it may skip the blocks above the diagonal. `mask_BTS=None`:
  plain causal attention when `causal`, else no mask. Query head h reads key/value head h // (H / G), as in jaxlm."""
  if mask_BTS is not None and (mask_BTS.dtype != jnp.bool_ or mask_BTS.ndim != 3):
    raise ValueError(f"tokamax_attention takes a bool mask [B, T, S], got {mask_BTS.dtype} {mask_BTS.shape}")
  mask = None if mask_BTS is None else mask_BTS[:, None]
  return _call("dot_product_attention", q_BTHK, k_BSGK, v_BSGK, mask=mask, is_causal=causal,
               implementation=implementation)


def tokamax_layer_norm(x, scale, bias, eps: float, *, implementation=None) -> jax.Array:
  """`xla.layer_norm` (f32 result) through tokamax.layer_norm."""
  # tokamax returns x's dtype (it computes in f32 either way): an f32 input gives jaxlm's f32 result unrounded.
  return _call("layer_norm", x.astype(jnp.float32), scale, bias, epsilon=eps, implementation=implementation)


def tokamax_rms_norm(x, scale, eps: float, *, implementation=None) -> jax.Array:
  """`xla.rms_norm` (f32 result) through tokamax.layer_norm without the mean subtraction or an offset."""
  return _call("layer_norm", x.astype(jnp.float32), scale, None, epsilon=eps, subtract_mean=False,
               implementation=implementation)


def tokamax_glu(x_BTD, w_gate_DF, w_up_DF, *, implementation=None) -> jax.Array:
  """`xla.glu`, silu(x @ w_gate) * (x @ w_up), through tokamax.gated_linear_unit with unfused weights. tokamax forms
  the product in f32 and rounds it to x's dtype once (jaxlm's reference multiplies in the compute dtype)."""
  _plain("w_gate", w_gate_DF)
  _plain("w_up", w_up_DF)
  return _call("gated_linear_unit", x_BTD, (w_gate_DF, w_up_DF), activation=jax.nn.silu,
               implementation=implementation)


def tokamax_ragged_dot(x_MK, w_GKN, group_sizes_G, *, implementation=None) -> jax.Array:
  """`jax.lax.ragged_dot(x, w, group_sizes)` (rows sorted by group) through tokamax.ragged_dot, its grouped-matmul
  kernels for GPUs and TPUs."""
  _plain("the expert weights", w_GKN)
  return _call("ragged_dot", x_MK, w_GKN, group_sizes_G.astype(jnp.int32), implementation=implementation)


def _concrete(x) -> np.ndarray | None:
  try:
    return np.asarray(x)
  except jax.errors.TracerArrayConversionError:
    return None


def tokamax_cross_entropy(x_ND, table_VD, targets_N, weights_N, *, implementation=None,
                          chunk: int = 4096) -> tuple[jax.Array, jax.Array]:
  """`xla.cross_entropy_sums`: (sum_n w_n * CE(x_n @ table^T, target_n), sum_n w_n * [argmax == target]), the loss
  and its gradient from tokamax.linear_softmax_cross_entropy_loss, which never returns the logits.

  Weights must be 0 or 1 (jaxlm's loss masks): tokamax returns one sum over all rows and takes no per-row weight, so
  rows of weight 0 are zeroed (all-zero logits: a loss of log V and no gradient to x or the table) and their
  n * log V is subtracted. Other weights raise a ValueError when the weights are concrete and make the loss NaN
  under jit. The correct count needs each row's argmax, which tokamax does not expose: it comes from a separate
  gradient-free pass of `cross_entropy.fused_cross_entropy`, `chunk` tokens at a time (one more [N, D] x [D, V]
  matmul, no [N, V] logits in memory; XLA drops it when the count is unused).

  implementation=None: tokamax's Pallas TPU kernel ("mosaic_tpu") on a TPU when N is a multiple of its 1024-row
  block and D of 8, else its XLA path; tokamax 0.0.12 has no GPU kernel for this op."""
  _plain("the output table", table_VD)
  n, d = x_ND.shape
  v = table_VD.shape[0]
  weights = _concrete(weights_N)
  if weights is not None and not np.all((weights == 0) | (weights == 1)):
    raise ValueError("tokamax_cross_entropy takes 0/1 weights (a loss mask): tokamax has no per-token weight; "
                     "use kernels.cross_entropy=chunked or logits")
  if implementation is None:
    # tokamax's own default (implementation=None) always runs its XLA path in 0.0.12: its loop tries "xla" first.
    tpu_fits = jax.default_backend() == "tpu" and n % 1024 == 0 and d % 8 == 0
    implementation = "mosaic_tpu" if tpu_fits else "xla"
  keep_N = weights_N != 0
  x_in, table_in = jnp.where(keep_N[:, None], x_ND, 0), table_VD
  if implementation == "xla":
    # tokamax's XLA path forms the logits in the input dtype; jaxlm's contract is f32 logits.
    x_in, table_in = x_in.astype(jnp.float32), table_in.astype(jnp.float32)
  # A dropped row's target is set in range: an out-of-range one-hot would give it a loss of 0, not log V.
  targets_in = jnp.where(keep_N, targets_N, 0)
  # tokamax takes the table as [D, V].
  total = _call("linear_softmax_cross_entropy_loss", x_in, targets_in, table_in.T, reduction="sum",
                implementation=implementation)
  dropped = (n - jnp.sum(keep_N)).astype(jnp.float32)
  loss = total.astype(jnp.float32) - dropped * jnp.float32(math.log(v))
  valid = jnp.all((weights_N == 0) | (weights_N == 1))
  loss = jnp.where(valid, loss, jnp.nan)  # weights other than 0/1 are not expressible here: fail loudly
  frozen = [jax.lax.stop_gradient(a) for a in (x_ND, table_VD)]  # forward only: the count has no gradient
  correct = chunked_ce.fused_cross_entropy(*frozen, targets_N, weights_N, min(chunk, n))[1]
  return loss, correct
