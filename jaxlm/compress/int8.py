"""int8 weights in the parameter tree, and the stand-ins that run a model's matmuls on them.

  w = int8.Int8Weight(int8.quantize_array(w_float, contracted))   # int8 values, one f32 scale per output channel

Three stand-ins for a float weight (jaxlm.kernels.weights: the model's kernels hand each its own `contract` and
`lookup`): `Int8Weight` (quantized: weight-only, static or per-token W8A8; jaxlm.compress.quantization builds them),
`SmoothedWeight` (a float weight with SmoothQuant factors still to apply to its input; jaxlm.compress.smoothquant)
and `Probe` (a float weight whose input statistics are recorded; jaxlm.compress.calibration).

What is qwix and what is ours. From qwix (0.1.8): the quantized array (`qwix.QArray`), `qwix.quantize` (per-channel
absmax), `qwix.dequantize`, `qwix.einsum` (for a contraction that is not a plain one: none of jaxlm's layers) and
qwix's einsum parser for the per-token axes. Ours, for the plain contractions of our layers (see `_int8_dot` and
`_weight_only_dot`): the int8 x int8 -> int32 dot (qwix's layout ran slowly on the CPU), and the weight-only dot as
`x @ (int8 -> x's dtype)` with the per-channel scale on the dot's output, so that decoding reads int8 weight bytes
(qwix scales the weight before its dot); on the CPU that converted weight is materialised first.
Ours, because qwix's model-level PTQ (`quantize_model` + `PtqProvider`) can not serve these models: (1) it replaces
each weight inside the module that uses it during a first call, but our blocks run under `jax.lax.scan` on modules
rebuilt by `nnx.merge` inside the scan body, so the replacement is lost and `quantize_params` finds no quantized
weight; (2) its static activation scales and calibration statistics are variables created in that same per-call
module, so they are lost too, and there would be one per stacked weight, not one per layer; (3) for NNX it intercepts
a single method, while a decoder needs `__call__` and `decode` (generation). So `Int8Weight` keeps the int8 weight
and its calibrated input scales *in the parameter tree*, with the leading layer axis, where `scan` slices them like
any parameter; and calibration (jaxlm/compress/calibration.py) reads the per-layer input ranges out of the scan with
`jax.debug.callback`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
# A private qwix module, pinned by the qwix version in pyproject.toml: its einsum parser gives the per-token
# (channelwise) axes of an input.
from qwix._src.core import einsum as qwix_einsum


INT8_MAX = 127.0

# Parameter name -> the axes the model contracts it over (in one layer's parameter, without the stacked [L] axis).
# Every other axis gets its own scale. Names not listed (biases, norm scales, the MLM vocab bias) stay float.
CONTRACTED_AXES = {
    "w_q": (0,), "w_k": (0,), "w_v": (0,),  # [D, H|G, K]
    "w_o": (0, 1),  # [H, K, D]
    "w_in": (0,), "w_out": (0,), "w_gate": (0,), "w_up": (0,), "w_down": (0,),  # [D, F] / [F, D]
    "w": (0,),  # Dense [in, out] (BERT pooler, classifier, MLM transform)
    "embedding": (1,),  # [V, D]: one scale per row serves both the lookup and the tied output projection
}


@flax.struct.dataclass
class Int8Weight:
  """The value of a quantized parameter: int8 values with per-channel scales, plus the calibrated input scale.

  It stands in for the float array inside the unchanged model code: `param[...]` and `.astype(compute dtype)` return
  an Int8Weight, and the kernels call its `contract` and `lookup` (jaxlm.kernels.weights)."""
  q: qwix.QArray  # qvalue int8 [..weight shape], scale f32 with 1 on the contracted axes
  act_scale: jax.Array | None = None  # w8a8: input scale, [L] for stacked blocks, [] otherwise
  mode: str = flax.struct.field(pytree_node=False, default="weight_only")
  smooth: jax.Array | None = None  # SmoothQuant not folded into an earlier op: 1/s per input channel ([L,] + C)

  shape = property(lambda self: self.q.shape)
  ndim = property(lambda self: self.q.ndim)
  dtype = property(lambda self: self.q.dtype)  # the dequantized dtype, so the precision policy casts it

  def __getitem__(self, index):
    if index is not Ellipsis:
      raise TypeError(f"an int8 weight is read whole (param[...]), not indexed with {index!r}")
    return self

  def astype(self, dtype) -> "Int8Weight":
    return self.replace(q=self.q.astype(dtype))

  def dequantize(self) -> jax.Array:
    return qwix.dequantize(self.q)

  def contract(self, subscripts: str, x: jax.Array, matmul, **kwargs) -> jax.Array:
    kwargs.pop("precision", None)
    lhs = _quantize_input(subscripts, x, self)
    dims = _dot_dims(subscripts, x.ndim, self.ndim)
    if dims is not None:
      if isinstance(lhs, qwix.QArray):
        return _int8_dot(lhs, self.q, dims, kwargs.get("preferred_element_type") or x.dtype)
      return _weight_only_dot(subscripts, lhs, self.q, dims, matmul, **kwargs)
    if not isinstance(lhs, qwix.QArray) and jax.default_backend() == "cpu":  # as _weight_only_dot, on the CPU
      return matmul(subscripts, lhs, jax.lax.optimization_barrier(qwix.dequantize(self.q)), **kwargs)
    return qwix.einsum(subscripts, lhs, self.q, **kwargs)

  def lookup(self, ids: jax.Array) -> jax.Array:
    """Embedding rows: the int8 rows and their scales gathered, then dequantized."""
    rows = jnp.take(self.q.qvalue, ids, axis=0)
    return rows.astype(self.q.scale.dtype) * jnp.take(self.q.scale, ids, axis=0)

  @classmethod
  def concatenate(cls, weights: list["Int8Weight"], axis: int) -> "Int8Weight | None":
    """One weight for one matmul (fused q/k/v): the int8 values and their per-channel scales joined along the
    output `axis`, so a decoding step reads the three projections' int8 bytes in one matmul, as the float model
    does. None where one matmul cannot serve them all: a contracted `axis` (one scale across it), static input
    scales (one per weight) or SmoothQuant factors kept on the weight."""
    first = weights[0]
    if any(w.mode != first.mode or w.act_scale is not None or w.smooth is not None or w.q.zero_point is not None
           or w.q.scale.shape[axis] != w.q.shape[axis] for w in weights):
      return None
    q = dataclasses.replace(first.q, qvalue=jnp.concatenate([w.q.qvalue for w in weights], axis=axis),
                            scale=jnp.concatenate([w.q.scale for w in weights], axis=axis))
    return cls(q, None, first.mode, None)


class _FloatStandIn:
  """What the model code reads of a float weight `w` wrapped with extra data: shape, dtype, `param[...]`, astype."""
  shape = property(lambda self: self.w.shape)
  ndim = property(lambda self: self.w.ndim)
  dtype = property(lambda self: self.w.dtype)

  def __getitem__(self, index):
    return self

  def astype(self, dtype):
    return self.replace(w=self.w.astype(dtype))


@flax.struct.dataclass
class SmoothedWeight(_FloatStandIn):
  """A float weight already multiplied by its SmoothQuant factors s (per input channel) whose input is divided by s
  when it runs: the smoothing of a matmul whose input comes from no op that could absorb 1/s
  (jaxlm.compress.smoothquant)."""
  w: jax.Array
  inv_scale: jax.Array  # 1/s, the weight's contracted axes ([L,] + C)

  def contract(self, subscripts: str, x: jax.Array, matmul, **kwargs) -> jax.Array:
    return matmul(subscripts, x * _per_input_channel(self.inv_scale, subscripts, x.ndim, self.ndim).astype(x.dtype),
                  self.w, **kwargs)

  def lookup(self, ids: jax.Array) -> jax.Array:
    raise ValueError("a smoothed weight is a matmul's, not a lookup table")


@flax.struct.dataclass
class Probe(_FloatStandIn):
  """Calibration stand-in for a float weight: `tag` (one id per layer, sliced by scan) names whose input it saw."""
  w: jax.Array
  tag: jax.Array
  gram: bool = flax.struct.field(pytree_node=False, default=False)  # also record X^T X (SparseGPT): off for W8A8/Wanda

  def contract(self, subscripts: str, x: jax.Array, matmul, **kwargs) -> jax.Array:
    real = _real_tokens(x)
    absmax, sumsq = _channel_stats(subscripts, real, self.ndim)
    jax.debug.callback(lambda tag, a, q: PROBE_RECORDS.setdefault(int(tag), []).append((np.asarray(a), np.asarray(q))),
                       self.tag, absmax, sumsq)
    if self.gram:
      jax.debug.callback(_add_gram, self.tag, _channel_gram(subscripts, real, self.ndim))
    return matmul(subscripts, x, self.w, **kwargs)

  def lookup(self, ids: jax.Array) -> jax.Array:
    return jnp.take(self.w, ids, axis=0)


nnx.register_data_type(Int8Weight)
nnx.register_data_type(SmoothedWeight)
nnx.register_data_type(Probe)

# Calibration: tag -> per call (input absmax per channel, input sum of squares per channel), host side. Channels are
# the weight's contracted axes in its own order (w_o: [H, K]).
PROBE_RECORDS: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}
# tag -> the input's Gram matrix X^T X [C, C] (C flattened), summed over calls in float64: only for Probe(gram=True).
PROBE_GRAMS: dict[int, np.ndarray] = {}


# The calibration batch's token mask [B, S] (1 = a real token) while `calibration.input_statistics` traces a probed
# forward, else None: padding rows are zeroed in the statistics, so no scale, factor or reconstruction fits pad tokens.
PROBE_TOKENS: list = [None]


def _real_tokens(x: jax.Array) -> jax.Array:
  """x with its padding rows zeroed, when x is a per-token activation [B, S, ...channels] of the traced batch."""
  mask = PROBE_TOKENS[0]
  if mask is None or x.ndim < 3 or x.shape[:2] != mask.shape:
    return x  # a pooled input [B, D] (a head's) has no padding rows
  return x * mask.reshape(mask.shape + (1,) * (x.ndim - 2)).astype(x.dtype)


def _add_gram(tag, gram) -> None:
  tag, gram = int(tag), np.asarray(gram, np.float64)
  PROBE_GRAMS[tag] = PROBE_GRAMS[tag] + gram if tag in PROBE_GRAMS else gram


# ----------------------------------------------------------------------------------------------- the int8 matmul


def _lhs_contracted(eq: str, lhs_ndim: int, rhs_ndim: int) -> list[int]:
  how = qwix_einsum.get_how_to_quantize(einsum_str=eq, ndims=(lhs_ndim, rhs_ndim), for_lhs=True, tile_size=None,
                                        qtype=jnp.int8)
  return [a for a in range(lhs_ndim) if a not in how.channelwise_axes]


def _per_input_channel(v: jax.Array, eq: str, x_ndim: int, w_ndim: int) -> jax.Array:
  """`v` over the weight's contracted axes (in the weight's order), reshaped to broadcast against the input x."""
  dims = _dot_dims(eq, x_ndim, w_ndim)
  if dims is None:
    raise ValueError(f"smoothing needs a plain contraction, not {eq!r}")
  lhs_c, rhs_c = dims
  weight_order = sorted(range(len(rhs_c)), key=lambda i: rhs_c[i])  # v's axis i is contraction weight_order[i]
  lhs_axes = [lhs_c[i] for i in weight_order]
  v = jnp.transpose(v, np.argsort(lhs_axes))  # now in the input's axis order
  shape = [1] * x_ndim
  for i, axis in enumerate(sorted(lhs_axes)):
    shape[axis] = v.shape[i]
  return v.reshape(shape)


def _channel_stats(eq: str, x: jax.Array, w_ndim: int) -> tuple[jax.Array, jax.Array]:
  """(absmax, sum of squares) of x per input channel, in the weight's contracted-axes order."""
  lhs_c, rhs_c = _dot_dims(eq, x.ndim, w_ndim)
  weight_order = sorted(range(len(rhs_c)), key=lambda i: rhs_c[i])
  x = jnp.moveaxis(x.astype(jnp.float32), [lhs_c[i] for i in weight_order], range(x.ndim - len(lhs_c), x.ndim))
  rows = tuple(range(x.ndim - len(lhs_c)))
  return jnp.max(jnp.abs(x), axis=rows), jnp.sum(jnp.square(x), axis=rows)


def _channel_gram(eq: str, x: jax.Array, w_ndim: int) -> jax.Array:
  """X^T X [C, C] of x's rows, its input channels flattened in the weight's contracted-axes order."""
  lhs_c, rhs_c = _dot_dims(eq, x.ndim, w_ndim)
  weight_order = sorted(range(len(rhs_c)), key=lambda i: rhs_c[i])
  x = jnp.moveaxis(x.astype(jnp.float32), [lhs_c[i] for i in weight_order], range(x.ndim - len(lhs_c), x.ndim))
  rows = x.reshape(-1, int(np.prod(x.shape[x.ndim - len(lhs_c):])))
  return jnp.einsum("ti,tj->ij", rows, rows, precision=jax.lax.Precision.HIGHEST)


def _quantize_input(eq: str, x: jax.Array, w: Int8Weight) -> jax.Array | qwix.QArray:
  if w.smooth is not None:
    x = x * _per_input_channel(w.smooth, eq, x.ndim, w.ndim).astype(x.dtype)
  if w.mode == "weight_only":
    return x
  if w.mode == "w8a8_dynamic":  # per token: one absmax scale per row of every non-contracted axis
    how_axes = [a for a in range(x.ndim) if a not in _lhs_contracted(eq, x.ndim, w.ndim)]
    return qwix.quantize(x, jnp.int8, channelwise_axes=how_axes)
  scale = w.act_scale.astype(x.dtype).reshape((1,) * x.ndim)  # static, per tensor
  qvalue = jnp.clip(jnp.round(x / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  return qwix.QArray(qvalue=qvalue, scale=scale)


def _dot_dims(eq: str, lhs_ndim: int, rhs_ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
  """(lhs, rhs) contracted axes when `eq` is a plain contraction whose output is lhs's free axes then rhs's, in
  order (every weight einsum of jaxlm's layers); else None."""
  inputs, out = eq.replace(" ", "").split("->")
  lhs, rhs = inputs.split(",")
  if "..." in lhs:  # stand-in letters for the ellipsis axes
    extra = "".join(chr(0x3B1 + i) for i in range(lhs_ndim - (len(lhs) - 3)))
    lhs, out = lhs.replace("...", extra), out.replace("...", extra)
  if "..." in rhs + out or len(lhs) != lhs_ndim or len(rhs) != rhs_ndim:
    return None
  if len(set(lhs)) != len(lhs) or len(set(rhs)) != len(rhs):  # a repeated letter (a trace or diagonal)
    return None
  contracted = [c for c in lhs if c in rhs and c not in out]
  if out != "".join([c for c in lhs if c not in contracted] + [c for c in rhs if c not in contracted]):
    return None
  return tuple(lhs.index(c) for c in contracted), tuple(rhs.index(c) for c in contracted)


def _weight_only_dot(subscripts: str, x: jax.Array, w: qwix.QArray, dims, matmul, **kwargs) -> jax.Array:
  """x times the int8 values converted to x's dtype, then each output channel times its f32 scale.

  The weight-only matmul, written so that the int8 array is what a step reads: the dot's weight operand is a bare
  convert of the int8 values (exact: |q| <= 127 fits the significand of bf16 and f16), the form XLA:GPU's Triton
  GEMM fusion takes as an s8 operand (whether it does at decoding's shapes: benchmarks/bench_decode.py), and the
  scale, one per output channel, multiplies the dot's output instead of the weight, so no scaled float weight is
  ever formed. The dot itself is the float model's (same dtypes and `preferred_element_type`). On the CPU the
  converted weight is materialised behind a barrier first: fused into the dot, XLA:CPU runs a loop slower than its
  GEMM (and the BLAS kernel, kernels.matmul=blas, needs a plain array)."""
  values = w.qvalue.astype(x.dtype)
  if jax.default_backend() == "cpu":
    values = jax.lax.optimization_barrier(values)
  result_dtype = kwargs.get("preferred_element_type") or x.dtype
  acc = matmul(subscripts, x, values, **kwargs)
  lhs_c, rhs_c = dims
  rhs_free = [a for a in range(w.ndim) if a not in rhs_c]
  scale = w.scale.astype(jnp.float32).reshape([1] * (x.ndim - len(lhs_c)) + [w.scale.shape[a] for a in rhs_free])
  return (acc.astype(jnp.float32) * scale).astype(result_dtype)


def _int8_dot(x: qwix.QArray, w: qwix.QArray, dims, result_dtype) -> jax.Array:
  """int8 x int8 -> int32 `dot_general`, then one f32 rescale by the input's and the weight's scales.

  Ours rather than `qwix.einsum` for the plain contractions of our layers: qwix's lowering put the weight first and
  transposed the result, which XLA:CPU runs far slower than this layout (docs/optimization.md). The arithmetic is
  the same: int32 accumulation, scales applied to the output."""
  lhs_c, rhs_c = dims
  acc = jax.lax.dot_general(x.qvalue, w.qvalue, ((lhs_c, rhs_c), ((), ())), preferred_element_type=jnp.int32)
  lhs_free = [a for a in range(x.ndim) if a not in lhs_c]
  rhs_free = [a for a in range(w.ndim) if a not in rhs_c]
  x_scale = x.scale.astype(jnp.float32).reshape([x.scale.shape[a] for a in lhs_free] + [1] * len(rhs_free))
  w_scale = w.scale.astype(jnp.float32).reshape([1] * len(lhs_free) + [w.scale.shape[a] for a in rhs_free])
  return (acc.astype(jnp.float32) * x_scale * w_scale).astype(result_dtype)


# ----------------------------------------------------------------------------------------------- int8 parameters


def is_stacked(variable: nnx.Variable, value: Any) -> bool:
  axes = variable.get_metadata().get("axes")
  return bool(axes) and len(axes) == value.ndim - 1  # blocks carry one leading [L] axis more than their names


def quantizable(path: tuple, variable: nnx.Variable) -> tuple[int, ...] | None:
  """Contracted axes of a quantizable parameter (including a stacked layer axis), or None if it stays float."""
  if not isinstance(variable, nnx.Param) or path[-1] not in CONTRACTED_AXES:
    return None
  value = variable.get_value()
  if not hasattr(value, "ndim") or value.ndim < 2:
    return None
  shift = 1 if is_stacked(variable, value) else 0
  return tuple(a + shift for a in CONTRACTED_AXES[path[-1]])


def quantize_array(w: jax.Array, contracted: tuple[int, ...]) -> qwix.QArray:
  """Symmetric int8 with one f32 scale per channel (every axis but the contracted ones): |w - deq| <= scale / 2."""
  channels = tuple(a for a in range(w.ndim) if a not in contracted)
  return qwix.quantize(w.astype(jnp.float32), jnp.int8, channelwise_axes=channels)


@jax.jit
def _quantize_arrays(weights: dict[str, jax.Array], contracted: dict[str, tuple[int, ...]]) -> dict:
  # One compiled program for all weights (eagerly, each of qwix's small ops would compile on its own: 10 s on the CPU).
  return {name: quantize_array(w, contracted[name]) for name, w in weights.items()}


def quantize_state(state: nnx.State, mode: str, act_scales: dict | None) -> nnx.State:
  targets = {}
  for path, variable in nnx.to_flat_state(state):
    contracted = quantizable(path, variable)
    if contracted is not None:
      targets["/".join(map(str, path))] = (variable, contracted)
  values = {name: v.get_value() for name, (v, _) in targets.items()}
  quantized = _quantize_arrays({name: getattr(v, "w", v) for name, v in values.items()},
                               _Static({name: c for name, (_, c) in targets.items()}))
  for name, (variable, _) in targets.items():
    act, w_mode = None, mode
    if mode == "w8a8":
      # A weight that no calibrated matmul read (e.g. the position table, only looked up) stays weight-only.
      act = (act_scales or {}).get(name)
      w_mode = mode if act is not None else "weight_only"
    smooth = values[name].inv_scale if isinstance(values[name], SmoothedWeight) else None
    variable.set_value(Int8Weight(quantized[name], act, w_mode, smooth))
  return state


class _Static(dict):
  """A dict that jit treats as a static argument (hashable by value)."""

  def __hash__(self):
    return hash(tuple(sorted(self.items())))


jax.tree_util.register_static(_Static)
