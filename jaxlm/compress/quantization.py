"""Post-training int8 quantization of jaxlm models (GPT, Llama, BERT): `quantize` builds the int8 copy of a model.

  qmodel = quant.quantize(model, "weight_only")                     # int8 weights, per-channel f32 scales
  qmodel = quant.quantize(model, "w8a8", calibration=batches, forward=lambda m, b: m(b["inputs"]))
  qmodel = quant.quantize(model, "w8a8_dynamic")                    # activations scaled per token at run time
  qmodel = quant.quantize(model, "w8a8", calibration=batches, forward=forward, smoothing=0.5)  # SmoothQuant first
  graphdef, qparams = nnx.split(qmodel)                             # same generate/evaluate code as a float model
  quant_io.save(qmodel, "out/int8"); qmodel = quant_io.load("out/int8", make_float_model, mesh=mesh)  # int8 files

Modes:
  weight_only   every matmul weight (and embedding table) stored as int8 with one f32 scale per output channel
                (symmetric absmax); the matmul dequantizes it on the fly (XLA fuses this into the dot).
  w8a8          also the matmul inputs in int8, with one scale per (weight, layer) calibrated on N batches (mean
                of the per-batch absmax, qwix's SimpleMovingAverage rule); int8 x int8 dots accumulate in int32.
  w8a8_dynamic  as w8a8 but each input row (token) gets its absmax scale when the model runs: no calibration.
`smoothing` (alpha in [0, 1], either w8a8 mode) first divides each matmul input by per-channel factors and multiplies
them into the weight (jaxlm/compress/smoothquant.py: SmoothQuant), measured on the calibration batches by the same probe
that calibrates the static scales, which then see the smoothed inputs.
The attention score and value einsums (activation x activation), norms, biases and softmax stay in float.
The int8 weight types, which run their own matmuls (jaxlm.kernels.weights), are in jaxlm/compress/int8.py.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import jax
from flax import nnx

from jaxlm.compress import calibration as calibration_lib
from jaxlm.compress import int8
from jaxlm.compress import smoothquant as smoothing_lib


MODES = ("weight_only", "w8a8", "w8a8_dynamic")


def quantize(model: nnx.Module, mode: str = "weight_only", *, calibration: Iterable[Any] = (),
             forward: Callable[[nnx.Module, Any], Any] | None = None, smoothing: float | None = None
             ) -> nnx.Module:
  """A quantized copy of `model` (see the module docstring for the modes).

  `w8a8` needs `calibration` batches and `forward(model, batch)`, which runs the model as the task does.
  `smoothing` (w8a8 modes; SmoothQuant's alpha in [0, 1], 0.5 its default) first moves each matmul input's per-channel
  range into the weight (`jaxlm.compress.smoothquant`), measured on the same calibration batches as the static
  scales."""
  if mode not in MODES:
    raise ValueError(f"quantization mode {mode!r} is not one of {', '.join(MODES)}")
  if smoothing is not None:
    if mode == "weight_only":
      raise ValueError("smoothing moves activation ranges into the weights: it applies to the w8a8 modes, not "
                       "weight_only; drop smoothing or pick w8a8 / w8a8_dynamic")
    if not 0.0 <= smoothing <= 1.0:
      raise ValueError(f"smoothing strength {smoothing} is out of range: it must be in [0, 1] (0.5 is SmoothQuant's)")
  graphdef, state = nnx.split(model)
  if any(isinstance(v.get_value(), int8.Int8Weight) for _, v in nnx.to_flat_state(state)):
    raise ValueError("this model is already quantized; quantize its float version")
  act_scales = None
  if mode == "w8a8" or smoothing is not None:
    batches = list(calibration)
    if not batches or forward is None:
      raise ValueError(f"{'smoothing' if smoothing is not None else 'mode w8a8'} needs calibration batches (got "
                       f"{len(batches)}) and forward(model, batch); or use w8a8_dynamic without smoothing")
    statistics = calibration_lib.input_statistics(model, batches, forward)
    factors = None
    if smoothing is not None:
      model, factors = smoothing_lib.smooth(model, statistics, smoothing)
      graphdef, state = nnx.split(model)
    if mode == "w8a8":
      act_scales = calibration_lib.static_scales(statistics, factors)
  state = jax.tree.map(lambda x: x, state)  # a copy: the float model is left as it was
  return nnx.merge(graphdef, int8.quantize_state(state, mode, act_scales))


def mode_of(model_or_state: Any) -> str:
  """'float' or the quantization mode of a model (the most common mode of its weights)."""
  state = nnx.state(model_or_state) if isinstance(model_or_state, nnx.Module) else model_or_state
  modes = [v.get_value().mode for _, v in nnx.to_flat_state(state) if isinstance(v.get_value(), int8.Int8Weight)]
  return max(set(modes), key=modes.count) if modes else "float"


def param_bytes(tree: Any) -> int:
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree)))
