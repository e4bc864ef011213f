"""Post-training int8 quantization of jaxlm models (GPT, Llama, BERT) with qwix, and int8 checkpoints.

  qmodel = quant.quantize(model, "weight_only")                     # int8 weights, per-channel f32 scales
  qmodel = quant.quantize(model, "w8a8", calibration=batches, forward=lambda m, b: m(b["inputs"]))
  qmodel = quant.quantize(model, "w8a8_dynamic")                    # activations scaled per token at run time
  graphdef, qparams = nnx.split(qmodel)                             # same generate/evaluate code as a float model
  quant_io.save(qmodel, "out/int8"); qmodel = quant_io.load("out/int8", make_float_model, mesh=mesh)  # int8 files

Modes:
  weight_only   every matmul weight (and embedding table) stored as int8 with one f32 scale per output channel
                (symmetric absmax); the matmul dequantizes it on the fly (XLA fuses this into the dot).
  w8a8          also the matmul inputs in int8, with one scale per (weight, layer) calibrated on N batches (mean
                of the per-batch absmax, qwix's SimpleMovingAverage rule); int8 x int8 dots accumulate in int32.
  w8a8_dynamic  as w8a8 but each input row (token) gets its absmax scale when the model runs: no calibration.
The attention score and value einsums (activation x activation), norms, biases and softmax stay in float.

What is qwix and what is ours. From qwix (0.1.8): the quantized array (`qwix.QArray`), `qwix.quantize` (per-channel
absmax), `qwix.dequantize`, `qwix.einsum` (weight-only on accelerators: XLA fuses the dequantize into the dot),
qwix's einsum parser for the per-token axes, and qwix's interception (which swaps `jnp.einsum` while a model runs).
Ours, for speed on the CPU (see `_int8_dot` and `_einsum`): the int8 x int8 -> int32 dot of our plain
contractions, and materialising a weight-only layer's float weight before its dot.
Ours, because qwix's model-level PTQ (`quantize_model` + `PtqProvider`) can not serve these models: (1) it replaces
each weight inside the module that uses it during a first call, but our blocks run under `jax.lax.scan` on modules
rebuilt by `nnx.merge` inside the scan body, so the replacement is lost and `quantize_params` finds no quantized
weight; (2) its static activation scales and calibration statistics are variables created in that same per-call
module, so they are lost too, and there would be one per stacked weight, not one per layer; (3) for NNX it intercepts
a single method, while a decoder needs `__call__` and `decode` (generation). So `Int8Weight` keeps the int8 weight
and its calibrated input scales *in the parameter tree*, with the leading layer axis, where `scan` slices them like
any parameter; and calibration reads the per-layer input ranges out of the scan with `jax.debug.callback`.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import flax
import jax
import jax.numpy as jnp
import numpy as np
import qwix
from flax import nnx
# Private qwix modules, pinned by the qwix version in pyproject.toml: interception is how qwix's own providers swap
# jnp.einsum, and the einsum parser gives the per-token (channelwise) axes of an input.
from qwix._src import interception
from qwix._src.core import einsum as qwix_einsum


MODES = ("weight_only", "w8a8", "w8a8_dynamic")
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
  an Int8Weight, and the intercepted `jnp.einsum` / `jnp.take` read it (see `_einsum`, `_take`)."""
  q: qwix.QArray  # qvalue int8 [..weight shape], scale f32 with 1 on the contracted axes
  act_scale: jax.Array | None = None  # w8a8: input scale, [L] for stacked blocks, [] otherwise
  mode: str = flax.struct.field(pytree_node=False, default="weight_only")

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


@flax.struct.dataclass
class _Probe:
  """Calibration stand-in for a float weight: `tag` (one id per layer, sliced by scan) names whose input it saw."""
  w: jax.Array
  tag: jax.Array
  shape = property(lambda self: self.w.shape)
  ndim = property(lambda self: self.w.ndim)
  dtype = property(lambda self: self.w.dtype)

  def __getitem__(self, index):
    return self

  def astype(self, dtype) -> "_Probe":
    return self.replace(w=self.w.astype(dtype))


nnx.register_data_type(Int8Weight)
nnx.register_data_type(_Probe)

_RECORDS: dict[int, list[float]] = {}  # calibration: tag -> per-call input absmax (host side)


# ----------------------------------------------------------------------------------------------- the interception


def _lhs_contracted(eq: str, lhs_ndim: int, rhs_ndim: int) -> list[int]:
  how = qwix_einsum.get_how_to_quantize(einsum_str=eq, ndims=(lhs_ndim, rhs_ndim), for_lhs=True, tile_size=None,
                                        qtype=jnp.int8)
  return [a for a in range(lhs_ndim) if a not in how.channelwise_axes]


def _quantize_input(eq: str, x: jax.Array, w: Int8Weight) -> jax.Array | qwix.QArray:
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


def _einsum(*args, **kwargs):
  if len(args) == 3 and isinstance(args[2], Int8Weight):
    eq, x, w = args
    kwargs.pop("precision", None)
    lhs = _quantize_input(eq, x, w)
    if isinstance(lhs, qwix.QArray):
      dims = _dot_dims(eq, x.ndim, w.ndim)
      if dims is not None:
        return _int8_dot(lhs, w.q, dims, kwargs.get("preferred_element_type") or x.dtype)
    elif jax.default_backend() == "cpu":
      # Weight-only on the CPU: XLA fuses the dequantize into the dot and then runs a loop slower than its f32
      # GEMM; the barrier materialises this layer's float weight first. Accelerators keep qwix's fused path.
      return jnp.einsum(eq, x, jax.lax.optimization_barrier(qwix.dequantize(w.q)), **kwargs)
    return qwix.einsum(eq, lhs, w.q, **kwargs)
  if len(args) == 3 and isinstance(args[2], _Probe):
    eq, x, probe = args
    absmax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    jax.debug.callback(lambda tag, value: _RECORDS.setdefault(int(tag), []).append(float(value)), probe.tag, absmax)
    return jnp.einsum(eq, x, probe.w, **kwargs)
  return jnp.einsum(*args, **kwargs)


def _take(a, indices, axis=None, **kwargs):
  if isinstance(a, Int8Weight):  # embedding lookup: gather int8 rows and their scales, then dequantize
    if axis != 0:
      raise ValueError(f"int8 tables support lookups along axis 0 only, got axis={axis}")
    rows = jnp.take(a.q.qvalue, indices, axis=0, **kwargs)
    scales = jnp.take(a.q.scale, indices, axis=0, **kwargs)
    return rows.astype(a.q.scale.dtype) * scales
  if isinstance(a, _Probe):
    a = a.w
  return jnp.take(a, indices, axis=axis, **kwargs)


_INTERCEPTOR_ID = 0x6A61786C6D  # a stable id: jit caches compiled functions of the intercepted methods by it
_METHODS = ("__call__", "decode", "encode", "pool", "loss_sums")
_INTERCEPTED_CLASSES: dict[type, type] = {}


def _interceptor() -> interception.Interceptor:
  return interception.Interceptor(mapping={"jax.numpy.einsum": _einsum, "jax.numpy.take": _take},
                                  id=_INTERCEPTOR_ID)


def intercepted_class(cls: type) -> type:
  """A subclass of a model class whose entry points run with `jnp.einsum` / `jnp.take` reading Int8Weights.
  One subclass per class, so graph definitions (and jit caches) of quantized models compare equal."""
  if getattr(cls, "_jaxlm_float_class", None) is not None:
    return cls
  if cls not in _INTERCEPTED_CLASSES:
    fields = {name: interception.wrap_func_intercepted(getattr(cls, name), _interceptor, disable_jit=False)
              for name in _METHODS if hasattr(cls, name)}
    fields["_jaxlm_float_class"] = cls
    _INTERCEPTED_CLASSES[cls] = type(f"Int8{cls.__name__}", (cls,), fields)
  return _INTERCEPTED_CLASSES[cls]


def _with_interception(model: nnx.Module) -> nnx.Module:
  model.__class__ = intercepted_class(type(model))
  return model


# ----------------------------------------------------------------------------------------------- quantize


def _is_stacked(variable: nnx.Variable, value: Any) -> bool:
  axes = variable.get_metadata().get("axes")
  return bool(axes) and len(axes) == value.ndim - 1  # blocks carry one leading [L] axis more than their names


def quantizable(path: tuple, variable: nnx.Variable) -> tuple[int, ...] | None:
  """Contracted axes of a quantizable parameter (including a stacked layer axis), or None if it stays float."""
  if not isinstance(variable, nnx.Param) or path[-1] not in CONTRACTED_AXES:
    return None
  value = variable.get_value()
  if not hasattr(value, "ndim") or value.ndim < 2:
    return None
  shift = 1 if _is_stacked(variable, value) else 0
  return tuple(a + shift for a in CONTRACTED_AXES[path[-1]])


def quantize_array(w: jax.Array, contracted: tuple[int, ...]) -> qwix.QArray:
  """Symmetric int8 with one f32 scale per channel (every axis but the contracted ones): |w - deq| <= scale / 2."""
  channels = tuple(a for a in range(w.ndim) if a not in contracted)
  return qwix.quantize(w.astype(jnp.float32), jnp.int8, channelwise_axes=channels)


@jax.jit
def _quantize_arrays(weights: dict[str, jax.Array], contracted: dict[str, tuple[int, ...]]) -> dict:
  # One compiled program for all weights (eagerly, each of qwix's small ops would compile on its own: 10 s on the CPU).
  return {name: quantize_array(w, contracted[name]) for name, w in weights.items()}


def _quantize_state(state: nnx.State, mode: str, act_scales: dict | None) -> nnx.State:
  targets = {}
  for path, variable in nnx.to_flat_state(state):
    contracted = quantizable(path, variable)
    if contracted is not None:
      targets["/".join(map(str, path))] = (variable, contracted)
  quantized = _quantize_arrays({name: v.get_value() for name, (v, _) in targets.items()},
                               _Static({name: c for name, (_, c) in targets.items()}))
  for name, (variable, _) in targets.items():
    act, w_mode = None, mode
    if mode == "w8a8":
      # A weight that no calibrated matmul read (e.g. the position table, only looked up) stays weight-only.
      act = (act_scales or {}).get(name)
      w_mode = mode if act is not None else "weight_only"
    variable.set_value(Int8Weight(quantized[name], act, w_mode))
  return state


class _Static(dict):
  """A dict that jit treats as a static argument (hashable by value)."""

  def __hash__(self):
    return hash(tuple(sorted(self.items())))


jax.tree_util.register_static(_Static)


def quantize(model: nnx.Module, mode: str = "weight_only", *, calibration: Iterable[Any] = (),
             forward: Callable[[nnx.Module, Any], Any] | None = None) -> nnx.Module:
  """A quantized copy of `model` (see the module docstring for the modes).

  `w8a8` needs `calibration` batches and `forward(model, batch)`, which runs the model as the task does."""
  if mode not in MODES:
    raise ValueError(f"quantization mode {mode!r} is not one of {', '.join(MODES)}")
  graphdef, state = nnx.split(model)
  if any(isinstance(v.get_value(), Int8Weight) for _, v in nnx.to_flat_state(state)):
    raise ValueError("this model is already quantized; quantize its float version")
  act_scales = None
  if mode == "w8a8":
    batches = list(calibration)
    if not batches or forward is None:
      raise ValueError("mode w8a8 needs calibration batches and forward(model, batch); or use w8a8_dynamic")
    act_scales = calibrate(model, batches, forward)
  state = jax.tree.map(lambda x: x, state)  # a copy: the float model is left as it was
  return _with_interception(nnx.merge(graphdef, _quantize_state(state, mode, act_scales)))


def calibrate(model: nnx.Module, batches: list[Any], forward: Callable[[nnx.Module, Any], Any]) -> dict:
  """Input scale of every quantizable weight's matmul: the mean over `batches` of the per-batch absmax, / 127.

  Returns {parameter path: scale [L] (stacked) or []}."""
  graphdef, state = nnx.split(model)
  probed = jax.tree.map(lambda x: x, state)
  tags: dict[str, tuple[int, int]] = {}  # path -> (first tag, layers or 0)
  next_tag = 0
  for path, variable in nnx.to_flat_state(probed):
    if quantizable(path, variable) is None:
      continue
    value = variable.get_value()
    layers = value.shape[0] if _is_stacked(variable, value) else 0
    tag = jnp.arange(next_tag, next_tag + layers, dtype=jnp.int32) if layers else jnp.int32(next_tag)
    tags["/".join(map(str, path))] = (next_tag, layers)
    next_tag += max(layers, 1)
    variable.set_value(_Probe(value, tag))
  probe_def, probe_state = nnx.split(_with_interception(nnx.merge(graphdef, probed)))
  run = jax.jit(lambda s, batch: forward(nnx.merge(probe_def, s), batch))
  _RECORDS.clear()
  for batch in batches:
    jax.block_until_ready(run(probe_state, batch))
  jax.effects_barrier()
  records = dict(_RECORDS)
  _RECORDS.clear()
  scales = {}
  for name, (first, layers) in tags.items():
    per_tag = [records.get(t) for t in range(first, first + max(layers, 1))]
    if any(r is None for r in per_tag):
      continue  # never multiplied (a lookup-only table)
    values = np.array([np.mean(r) for r in per_tag], np.float32) / INT8_MAX
    values = np.maximum(values, np.finfo(np.float32).tiny)
    scales[name] = jnp.asarray(values if layers else values[0])
  return scales


def mode_of(model_or_state: Any) -> str:
  """'float' or the quantization mode of a model (the most common mode of its weights)."""
  state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
  modes = [v.get_value().mode for _, v in nnx.to_flat_state(state) if isinstance(v.get_value(), Int8Weight)]
  return max(set(modes), key=modes.count) if modes else "float"


def param_bytes(tree: Any) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))


def quantized_like(make_float_model: Callable[[], nnx.Module], mode: str, calibrated: Iterable[str] = ()
                   ) -> nnx.Module:
  """The model `quantize(make_float_model(), mode)` would give, built from shapes alone (`nnx.eval_shape`): what an
  int8 checkpoint restores into. `calibrated`: the '/'-joined paths of the weights with calibrated input scales."""
  calibrated = set(calibrated)

  def build():
    model = make_float_model()
    if mode == "float":
      return model
    _, state = nnx.split(model)
    placeholder = None
    if mode == "w8a8":  # scale shapes only; the values come from the checkpoint
      placeholder = {"/".join(map(str, p)): jnp.ones(v.get_value().shape[:1] if _is_stacked(v, v.get_value())
                                                     else (), jnp.float32)
                     for p, v in nnx.to_flat_state(state) if "/".join(map(str, p)) in calibrated}
    _quantize_state(state, mode, placeholder)
    return model

  return nnx.eval_shape(build)


def with_interception(model: nnx.Module) -> nnx.Module:
  """A quantized model whose matmuls run through the int8 paths (`quantize` returns models like this already)."""
  return model if mode_of(model) == "float" else _with_interception(model)
