"""Optimizer (AdamW, or Muon on the weight matrices: jaxlm/training/muon.py; warmup + cosine, global-norm clipping)
and exact gradient accumulation.

Accumulation is written here rather than with `optax.MultiSteps`: MultiSteps averages the micro-batch mean losses,
which weights a token in a half-padded micro-batch twice as much as one in a full micro-batch. We sum the token losses
and their gradients over all micro-batches in f32 and divide once by the global count of valid tokens, so k
micro-batches give the same update as one batch k times larger, whatever the padding.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from jaxlm.config import OPTIMIZERS, TrainConfig
from jaxlm.training import muon

# loss_fn(params, batch) -> (sum of token losses, (number of valid tokens, aux metrics))
SumLossFn = Callable[[Any, dict], tuple[jax.Array, tuple[jax.Array, dict]]]


def warmup_steps(config: TrainConfig) -> int:
  """train.warmup_steps, or with -1 train.warmup_fraction of train.steps (rounded), at most steps - 1."""
  warmup = config.warmup_steps if config.warmup_steps >= 0 else round(config.warmup_fraction * config.steps)
  return min(warmup, max(config.steps - 1, 0))


def learning_rate_schedule(config: TrainConfig) -> optax.Schedule:
  if config.steps < 1:
    raise ValueError(f"train.steps={config.steps}: derive the steps from the data first "
                     "(jaxlm.recipes.data_defaults.resolve_steps)")
  warmup = warmup_steps(config)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=config.learning_rate, warmup_steps=warmup,
      decay_steps=max(config.steps, warmup + 1), end_value=config.learning_rate * config.min_lr_ratio)


def follow_up_config(run: TrainConfig, learning_rate: float, steps: int, schedule: str = "constant") -> TrainConfig:
  """The run's TrainConfig for a short follow-up training (e.g. the masked fine-tune after pruning): its optimizer
  settings, `steps` long, peaking at `learning_rate`. `constant` holds that rate (no warm-up, a cosine that ends where
  it starts); `run` keeps the run's warm-up share and cosine end (train.min_lr_ratio) over the new steps."""
  if schedule == "run":
    warmup = round(warmup_steps(run) * steps / max(run.steps, 1))
    return dataclasses.replace(run, learning_rate=learning_rate, steps=steps, warmup_steps=warmup)
  if schedule != "constant":
    raise ValueError(f"follow-up schedule {schedule!r} is not one of constant, run")
  return dataclasses.replace(run, learning_rate=learning_rate, steps=steps, warmup_steps=0, min_lr_ratio=1.0)


def _decay_mask(params: Any) -> Any:
  # Decay weight matrices and embeddings only (names `w_*`, `embedding`): decaying norm scales and biases pulls them
  # towards zero for no regularisation benefit. Names, not ndim, decide: scanned blocks add a layer axis to vectors.
  def decays(path, _):
    name = muon.leaf_name(path)
    return name.startswith("w_") or name == "embedding"
  return jax.tree_util.tree_map_with_path(decays, params)


EMBEDDING_MODULES = ("token_embed", "position_embed", "type_embed", "embed_norm")


def layer_lr_scales(params: Any, decay: float) -> Any:
  """Learning-rate factors of layer-wise decay, one per leaf: pretrained block l of L (stacked [L, ...]) gets
  decay^(L-1-l), the embeddings below the blocks decay^L, everything above them (final norm, pooler, heads) 1. LoRA
  adapters are new parameters, not pretrained features to protect: they learn at the full rate wherever they sit."""
  def keys(path) -> list[str]:
    return [str(getattr(k, "key", k)) for k in path]

  depths = [x.shape[0] for p, x in jax.tree_util.tree_leaves_with_path(params) if "blocks" in keys(p)]
  num_layers = depths[0] if depths else 0

  def scale(path, x):
    if any(k.startswith("lora_") for k in keys(path)):
      return jnp.float32(1.0)
    if "blocks" in keys(path):
      powers = num_layers - 1 - jnp.arange(num_layers, dtype=jnp.float32)
      return (decay ** powers).reshape((num_layers,) + (1,) * (x.ndim - 1))
    if any(k in EMBEDDING_MODULES for k in keys(path)):
      return jnp.float32(decay ** num_layers)
    return jnp.float32(1.0)
  return jax.tree_util.tree_map_with_path(scale, params)


def scale_by_layer_depth(decay: float) -> optax.GradientTransformation:
  """Multiplies each update by its layer_lr_scales factor (after the optimizer: the rate and the weight decay both
  scale). Written here because optax's per-group tools (multi_transform) give whole leaves one rate, not a stacked
  leaf's layers one each."""
  def update(updates, state, params=None):
    del params
    return jax.tree.map(lambda u, s: u * s.astype(u.dtype), updates, layer_lr_scales(updates, decay)), state
  return optax.GradientTransformation(lambda params: optax.EmptyState(), update)


def make_optimizer(config: TrainConfig) -> optax.GradientTransformation:
  """train.optimizer between the global-norm clipping and the layer-wise rate decay: AdamW on every parameter, or
  Muon on the weight matrices and that AdamW on the rest."""
  if config.optimizer not in OPTIMIZERS:
    raise ValueError(f"train.optimizer={config.optimizer!r} is not one of {', '.join(OPTIMIZERS)}; set "
                     "train.optimizer=adamw or train.optimizer=muon")
  parts = []
  if config.grad_clip > 0:
    parts.append(optax.clip_by_global_norm(config.grad_clip))
  schedule = learning_rate_schedule(config)
  adamw = optax.adamw(schedule, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay,
                      mask=_decay_mask)
  parts.append(muon.muon_with_adamw(config, schedule, adamw) if config.optimizer == "muon" else adamw)
  if config.layer_lr_decay != 1.0:
    parts.append(scale_by_layer_depth(config.layer_lr_decay))
  return optax.chain(*parts)


def split_micro_batches(batch: dict, num_micro: int) -> dict:
  """[B, ...] -> [k, B/k, ...]. Micro-batch j takes rows j, j+k, j+2k, ...: a device holding a contiguous block of
  rows then holds an equal share of every micro-batch, so the split moves no data between devices."""
  def split(x):
    return jnp.swapaxes(x.reshape(x.shape[0] // num_micro, num_micro, *x.shape[1:]), 0, 1)
  return jax.tree.map(split, batch)


def accumulate_gradients(loss_fn: SumLossFn, params: Any, batch: dict, num_micro: int,
                         reduce_sums: Callable[[Any], Any] = lambda sums: sums
                         ) -> tuple[jax.Array, jax.Array, Any, dict]:
  """Returns (mean loss, valid-token count, gradient of the mean loss, summed aux) over `num_micro` micro-batches.

  The mean is over all valid tokens of the whole batch (global count), exactly as for one unsplit batch.
  `reduce_sums` combines the (loss sum, count, gradient sum, aux) of this shard with those of the others before
  dividing, e.g. a `psum` over the data axes inside `shard_map`; under plain `jit` the sums are already global.
  """
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if num_micro == 1:
    (loss_sum, (count, aux)), grad_sum = grad_fn(params, batch)
  else:
    micro = split_micro_batches(batch, num_micro)

    def step(carry, micro_batch):
      loss_acc, count_acc, grad_acc, aux_acc = carry
      (loss_sum, (count, aux)), grads = grad_fn(params, micro_batch)
      grad_acc = jax.tree.map(lambda a, g: a + g.astype(jnp.float32), grad_acc, grads)
      aux_acc = jax.tree.map(jnp.add, aux_acc, aux)
      return (loss_acc + loss_sum, count_acc + count, grad_acc, aux_acc), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    first = jax.tree.map(lambda x: x[0], micro)
    aux_zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(lambda: loss_fn(params, first)[1][1]))
    init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros, aux_zeros)
    (loss_sum, count, grad_sum, aux), _ = jax.lax.scan(step, init, micro)
  loss_sum, count, grad_sum, aux = reduce_sums((loss_sum, count, grad_sum, aux))
  denominator = jnp.maximum(count, 1.0)
  grads = jax.tree.map(lambda g: (g / denominator).astype(jnp.float32), grad_sum)
  return loss_sum / denominator, count, grads, aux
