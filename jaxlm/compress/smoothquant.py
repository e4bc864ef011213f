"""SmoothQuant smoothing (Xiao et al., 2023): move each matmul input's outlier channels into its weight before W8A8.

For y = x W contracting input channel j, with alpha the smoothing strength (`quant.quantize(..., smoothing=alpha)`):

  s_j = max|x_j|^alpha / max_o |W_jo|^(1 - alpha),      y = (x / s) (s W)

x / s has flat channels (easy to quantize per tensor or per token) and s W stays easy per output channel. The max|x_j|
come from the same calibration batches as the static scales (`calibration.input_statistics`). 1/s is folded into the
op that produces x wherever that op is linear per channel, so the smoothed float model computes the same function with
the same code:

  gpt2, llama (pre-norm)  attention / MLP norm scale (and bias) -> w_q, w_k, w_v / w_in or w_gate, w_up;
                          final norm -> an untied LM head
  every model             value projection (w_v, b_v) -> output projection w_o (s per key/value head channel,
                          shared by the query heads of a group)
  llama                   up projection w_up -> down projection w_down (silu(gate) * up is linear in up)

Every other matmul weight (BERT's post-norm blocks, where the norm's output is also the residual; GELU's output
projection; poolers and classifiers) becomes a `int8.SmoothedWeight`: its input is divided by s when it runs, one
elementwise multiply that XLA fuses into the input's quantization. Embedding lookup tables are not smoothed.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm.compress import int8


@dataclasses.dataclass(frozen=True)
class Fold:
  """Matmul weights that read one input, and the arrays (of the op producing that input) that absorb 1/s."""
  consumers: tuple[str, ...]
  producers: tuple[str, ...]


def fold_plan(model: nnx.Module, names: set[str]) -> list[Fold]:
  """The folds this model's structure allows (see the module docstring), by '/'-joined parameter path."""
  flavour = model.config.flavour
  plan = []
  for attn in sorted(n[:-len("/w_q")] for n in names if n.endswith("attn/w_q")):
    block = attn[:-len("attn")]  # "blocks/" or "bert/blocks/"
    present = lambda *paths: tuple(p for p in paths if p in names)  # noqa: E731
    if flavour in ("gpt2", "llama"):
      plan.append(Fold(present(f"{attn}/w_q", f"{attn}/w_k", f"{attn}/w_v"),
                       present(f"{block}attn_norm/scale", f"{block}attn_norm/bias")))
      plan.append(Fold(present(f"{block}mlp/w_in", f"{block}mlp/w_gate", f"{block}mlp/w_up"),
                       present(f"{block}mlp_norm/scale", f"{block}mlp_norm/bias")))
    plan.append(Fold((f"{attn}/w_o",), present(f"{attn}/w_v", f"{attn}/b_v")))
    if f"{block}mlp/w_down" in names:
      plan.append(Fold((f"{block}mlp/w_down",), (f"{block}mlp/w_up",)))
  if "lm_head/embedding" in names and "final_norm/scale" in names:
    plan.append(Fold(("lm_head/embedding",), present("final_norm/scale", "final_norm/bias")))
  return [fold for fold in plan if fold.consumers and fold.producers]


def factors(act_absmax: np.ndarray, weight_absmax: np.ndarray, strength: float) -> np.ndarray:
  """s = act^strength / weight^(1 - strength) per channel; 1 where a channel is all zero on either side."""
  act, weight = np.asarray(act_absmax, np.float64), np.asarray(weight_absmax, np.float64)
  valid = (act > 0) & (weight > 0)
  s = np.power(np.where(valid, act, 1.0), strength) / np.power(np.where(valid, weight, 1.0), 1.0 - strength)
  return np.where(valid, s, 1.0)


def helps(s: np.ndarray, act_absmax: np.ndarray, weight_energy: np.ndarray, stacked: bool) -> np.ndarray:
  """Whether smoothing by `s` [L?, *C] lowers the int8 noise at the matmul's output, per layer ([L], or one bool).
  With one input scale per tensor that noise goes as max_c(a_c / s_c)^2 * sum_c s_c^2 |W_c|^2 (a_c: the input's
  absmax, |W_c|^2: the weight's energy in input channel c). Smoothing lowers it when the input's outlier channels
  meet ordinary weights; where they meet outlier weights too (BERT's MLP output projections), it raises it."""
  axes = tuple(range(int(stacked), s.ndim))
  noise = lambda f: np.max(act_absmax / f, axis=axes) ** 2 * np.sum(f ** 2 * weight_energy, axis=axes)  # noqa: E731
  return noise(s) < noise(np.ones_like(s))


def _per_layer(mask: np.ndarray, ndim: int) -> np.ndarray:
  return np.reshape(mask, np.shape(mask) + (1,) * (ndim - np.ndim(mask)))


def _output_axes(w: np.ndarray, contracted: tuple[int, ...], stacked: bool) -> tuple[int, ...]:
  """Every axis of a weight that is neither the layer axis nor a contracted (input channel) one."""
  keep = set(contracted) | ({0} if stacked else set())
  return tuple(a for a in range(w.ndim) if a not in keep)


def _weight_energy(w: np.ndarray, contracted: tuple[int, ...], stacked: bool) -> np.ndarray:
  """sum W^2 per input channel: [L?, *C]."""
  return np.sum(np.square(w), axis=_output_axes(w, contracted, stacked))


def _weight_absmax(w: np.ndarray, contracted: tuple[int, ...], stacked: bool) -> np.ndarray:
  """max |W| per input channel: [L?, *C]."""
  return np.max(np.abs(w), axis=_output_axes(w, contracted, stacked))


def _along(s: np.ndarray, ndim: int, axes: tuple[int, ...], stacked: bool) -> np.ndarray:
  """s [L?, *C] reshaped to broadcast against an array of rank `ndim` whose channels are `axes`."""
  shape = [1] * ndim
  if stacked:
    shape[0] = s.shape[0]
  for i, axis in enumerate(axes):
    shape[axis] = s.shape[int(stacked) + i]
  return s.reshape(shape)


def smooth(model: nnx.Module, statistics: dict, strength: float) -> tuple[nnx.Module, dict[str, np.ndarray]]:
  """A smoothed float copy of `model` (the same function up to rounding) and the factors s of every smoothed weight,
  {path: [L?, *C]} (what its matmul's input is divided by); `statistics` from `calibration.input_statistics`."""
  if not 0.0 <= strength <= 1.0:
    raise ValueError(f"smoothing strength {strength} is out of range: it must be in [0, 1] (0.5 is SmoothQuant's)")
  graphdef, state = nnx.split(model)
  variables = {"/".join(map(str, p)): v for p, v in nnx.to_flat_state(state)}
  values = {n: np.asarray(v.get_value(), np.float64) for n, v in variables.items()
            if not isinstance(v.get_value(), (int8.Int8Weight, int8.SmoothedWeight))}
  layout = {}  # matmul weight -> (contracted axes, stacked)
  for path, variable in nnx.to_flat_state(state):
    contracted = int8.quantizable(path, variable)
    name = "/".join(map(str, path))
    if contracted is not None and name in statistics and name in values:
      layout[name] = (contracted, statistics[name].stacked)
  scales: dict[str, np.ndarray] = {}
  changed: set[str] = set()

  def input_absmax(name):
    return np.max(statistics[name].absmax, axis=0)  # over calls: [L?, *C]

  plus_one = model.config.norm_plus_one
  for fold in fold_plan(model, set(variables)):
    if not all(c in layout for c in fold.consumers) or not all(p in values for p in fold.producers):
      continue
    contracted, stacked = layout[fold.consumers[0]]
    act = np.max([input_absmax(c) for c in fold.consumers], axis=0)
    weight = np.max([_weight_absmax(values[c], *layout[c]) for c in fold.consumers], axis=0)
    channels = act.shape[int(stacked):]
    producer_channels = values[fold.producers[0]].shape[-len(channels):]
    repeat = channels[0] // producer_channels[0]  # query heads per key/value head (w_o's input), else 1
    group = lambda x: x.reshape(x.shape[:int(stacked)] + (producer_channels[0], repeat) + x.shape[int(stacked) + 1:]
                                ).max(axis=int(stacked) + 1)  # noqa: E731
    s_producer = factors(group(act), group(weight), strength)
    s = np.repeat(s_producer, repeat, axis=int(stacked))  # query head h reads key/value head h // repeat
    energy = np.sum([_weight_energy(values[c], *layout[c]) for c in fold.consumers], axis=0)
    useful = helps(s, act, energy, stacked)  # a layer where smoothing adds noise keeps its weights as they are
    s_producer, s = (np.where(_per_layer(useful, f.ndim), f, 1.0) for f in (s_producer, s))
    for p in fold.producers:
      v = values[p]
      divisor = _along(s_producer, v.ndim, tuple(range(v.ndim - len(channels), v.ndim)), stacked)
      # Gemma's norms scale by (1 + w): the stored w must become (1 + w) / s - 1.
      values[p] = (1 + v) / divisor - 1 if plus_one and p.endswith("norm/scale") else v / divisor
      changed.add(p)
    for c in fold.consumers:
      values[c] = values[c] * _along(s, values[c].ndim, layout[c][0], stacked)
      scales[c] = s
      changed.add(c)
  runtime = {}
  for name, (contracted, stacked) in layout.items():
    if name in scales or name.endswith("embedding"):
      continue
    s = factors(input_absmax(name), _weight_absmax(values[name], contracted, stacked), strength)
    useful = helps(s, input_absmax(name), _weight_energy(values[name], contracted, stacked), stacked)
    s = np.where(_per_layer(useful, s.ndim), s, 1.0)
    values[name] = values[name] * _along(s, values[name].ndim, contracted, stacked)
    scales[name], runtime[name] = s, 1.0 / s
    changed.add(name)
  state = jax.tree.map(lambda x: x, state)  # a copy: the float model is left as it was
  for path, variable in nnx.to_flat_state(state):
    name = "/".join(map(str, path))
    if name in changed:
      new = jnp.asarray(values[name], variable.get_value().dtype)
      variable.set_value(int8.SmoothedWeight(new, jnp.asarray(runtime[name], jnp.float32)) if name in runtime
                         else new)
  return nnx.merge(graphdef, state), {n: s.astype(np.float32) for n, s in scales.items()}
