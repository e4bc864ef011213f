"""Muon (momentum orthogonalized by Newton-Schulz, optax.contrib) on the blocks' weight matrices beside the run's
AdamW on everything else: what `train.optimizer=muon` adds to jaxlm/training/optim.py's one optimizer builder.

Muon trains the leaves named `w_*` (attention q/k/v/o, MLP and expert weights, the MoE router). AdamW keeps the
embeddings and the output table, norms, biases, the encoder's poolers and classifier heads (named `w`, not `w_*`)
and LoRA adapters. Our weights are stacked over layers ([L, ...], experts [L, E, ...]) and the attention weights keep
their heads as axes of their own ([D, H, K], [H, K, D]), so each Muon leaf gets a `MuonDimensionNumbers`: its
trailing axes are one layer's (one expert's) matrix, split into its input (reduction) and output axes, and every
axis before them is a batch axis that Newton-Schulz runs over separately.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from optax import contrib

from jaxlm.config import TrainConfig

# One matrix of each weight as the models store it (jaxlm/models/layers.py, moe.py): (input axes, output axes), the
# leaf's trailing ones. tests/test_muon.py checks this table against every family's logical axis names.
MATRIX_AXES = {
    "w_q": (1, 2), "w_k": (1, 2), "w_v": (1, 2),  # [D, H|G, K]
    "w_o": (2, 1),  # [H, K, D]
    "w_in": (1, 1), "w_out": (1, 1), "w_gate": (1, 1), "w_up": (1, 1), "w_down": (1, 1),  # [D, F], [F, D]
    "w_router": (1, 1),  # [D, E]
}
BATCH_AXES = ("layers", "experts")  # at most these lead a matrix: [L, ...] stacked blocks, [L, E, ...] experts


def leaf_name(path: tuple) -> str:
  return str(getattr(path[-1], "key", path[-1]))


def is_muon_leaf(path: tuple) -> bool:
  # LoRA adapters (leaves lora_a / lora_b under a w_* key) stay with AdamW: orthogonalizing A and B one by one does
  # not orthogonalize their product, and B starts at zero.
  return leaf_name(path).startswith("w_")


def dimension_numbers(path: tuple, shape: tuple[int, ...]) -> contrib.MuonDimensionNumbers:
  """The Muon leaf's per-layer matrix: its input and output axes; the axes in front are batch axes."""
  name, where = leaf_name(path), jax.tree_util.keystr(path)
  if name not in MATRIX_AXES:
    raise ValueError(f"train.optimizer=muon has no matrix layout for weight {where}: add its (input axes, output "
                     "axes) to jaxlm.training.muon.MATRIX_AXES, or use train.optimizer=adamw")
  num_in, num_out = MATRIX_AXES[name]
  batch = len(shape) - num_in - num_out
  if not 0 <= batch <= len(BATCH_AXES):
    raise ValueError(f"train.optimizer=muon: weight {where} has shape {shape}, not {num_in} input and {num_out} "
                     f"output axes behind at most {len(BATCH_AXES)} of {', '.join(BATCH_AXES)}; fix "
                     "jaxlm.training.muon.MATRIX_AXES or use train.optimizer=adamw")
  return contrib.MuonDimensionNumbers(reduction_axis=tuple(range(batch, batch + num_in)),
                                      output_axis=tuple(range(batch + num_in, len(shape))))


def _fans(shape: tuple[int, ...], numbers: contrib.MuonDimensionNumbers) -> tuple[int, int]:
  return math.prod(shape[a] for a in numbers.reduction_axis), math.prod(shape[a] for a in numbers.output_axis)


def labels(params: Any) -> Any:
  """"muon" or "adamw" per leaf; checks every Muon leaf's layout as soon as the optimizer is initialised."""
  def label(path, x):
    if not is_muon_leaf(path):
      return "adamw"
    dimension_numbers(path, x.shape)
    return "muon"
  return jax.tree_util.tree_map_with_path(label, params)


def _muon_dimension_numbers(updates: Any) -> Any:
  # optax.partition hands the Muon group a tree whose AdamW leaves are optax.MaskedNode, which have no leaves of
  # their own: the map keeps them where the Muon state has them too.
  return jax.tree_util.tree_map_with_path(lambda path, x: dimension_numbers(path, x.shape), updates)


def scale_by_matrix_shape(consistent_rms: float) -> optax.GradientTransformation:
  """optax's Muon shape scaling per layer matrix (optax.contrib exports its scale_by_shape only inside `muon`):
  rms * sqrt(max(fan_in, fan_out)) with `consistent_rms` > 0, else sqrt(max(1, fan_out / fan_in))."""
  def scale(path, u):
    fan_in, fan_out = _fans(u.shape, dimension_numbers(path, u.shape))
    factor = consistent_rms * math.sqrt(max(fan_in, fan_out)) if consistent_rms else math.sqrt(max(1, fan_out / fan_in))
    return u * jnp.asarray(factor, u.dtype)

  def update(updates, state, params=None):
    del params
    return jax.tree_util.tree_map_with_path(scale, updates), state
  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def scale_by_muon(config: TrainConfig, schedule: optax.Schedule) -> optax.GradientTransformation:
  """Muon's update of the weight matrices: Nesterov momentum orthogonalized per layer matrix, scaled by its shape,
  plus decoupled weight decay, times the (ratio-scaled) learning rate. `train.muon_consistent_rms` > 0 scales by
  rms * sqrt(max(fan_in, fan_out)) (Moonlight: an AdamW-sized update, so AdamW's rate and decay carry over); 0 by
  sqrt(max(1, fan_out / fan_in)) (Keller Jordan's width scaling, which wants its own, larger rate)."""
  ratio = config.muon_learning_rate_ratio
  return optax.chain(
      contrib.scale_by_muon(ns_steps=config.muon_ns_steps, beta=config.muon_beta, nesterov=config.muon_nesterov,
                            weight_dimension_numbers=_muon_dimension_numbers),
      scale_by_matrix_shape(config.muon_consistent_rms),
      optax.add_decayed_weights(config.weight_decay),
      optax.scale_by_learning_rate(schedule if ratio == 1.0 else lambda step: ratio * schedule(step)),
  )


def muon_with_adamw(config: TrainConfig, schedule: optax.Schedule,
                    adamw: optax.GradientTransformation) -> optax.GradientTransformation:
  """Muon on the `w_*` leaves, `adamw` (the run's own, decay mask included) on the rest."""
  return optax.partition({"muon": scale_by_muon(config, schedule), "adamw": adamw}, labels)


def newton_schulz_flops(params: Any, ns_steps: int) -> float:
  """Matmul FLOPs of the Newton-Schulz iterations of one Muon update of `params` (shapes suffice): per layer matrix
  of sides m <= n, each iteration forms X X^T (2 m^2 n), its square (2 m^3) and that times X (2 m^2 n)."""
  total = 0.0
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    if is_muon_leaf(path):
      m, n = sorted(_fans(x.shape, dimension_numbers(path, x.shape)))
      total += math.prod(x.shape) // (m * n) * ns_steps * (4 * m * m * n + 2 * m**3)
  return total
