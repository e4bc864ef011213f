"""Dynamic loss scaling for float16 compute (V100, T4 and other GPUs without bf16).

float16 has 5 exponent bits: gradients below 2^-24 round to zero and above 65504 overflow to inf. The train step
multiplies the loss by a scale before differentiating, so the cotangents that flow back through the float16
activations sit inside that range, then divides the float32 gradients by the same scale before clipping and the
optimizer update (which therefore see the true gradients). The scale adapts:

  overflow   the loss is finite but a gradient is inf/nan: the update is skipped (params and optimizer state keep
             their values), the scale is divided by `factor` (not below `min_scale`), the good-step count restarts
  good step  the update is applied: one more good step; after `growth_interval` of them the scale is multiplied by
             `factor` (up to LOSS_SCALE_MAX) and the count restarts
  other      a skip for another reason (a non-finite loss, i.e. the forward pass itself, or a non-finite update)
             leaves the scale alone: it is not the scale's doing

An overflow skip is expected behaviour and does not count towards train.max_consecutive_nonfinite; once the scale is
at its floor an overflow does, because a smaller scale is no longer available to fix it (docs/reliability.md).

Only float16 runs scale: with bf16 (float32's exponent range) or float32 compute the train step and its state are
exactly those of an unscaled run. The scale state lives in the train state (checkpointed, resumed exactly):
{"scale": f32 [], "good_steps": int32 [], "overflow_steps": int32 [] (skips for overflow in the whole run)}.
jmp's `DynamicLossScale` and flax's `flax.training.dynamic_scale.DynamicScale` follow the same rule; written out here
because flax's is fused into its own `jax.value_and_grad` (ours come from optim.accumulate_gradients, shard_map or
the pipeline), jmp is unmaintained, and neither tells an overflow from a non-finite loss, which the loop needs.
"""

from __future__ import annotations

import dataclasses


import jax
import jax.numpy as jnp

from jaxlm.config import LOSS_SCALE_MAX, Config


LossScaleState = dict  # {"scale": f32 [], "good_steps": int32 [], "overflow_steps": int32 []}


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """The update rule of the module docstring, as a train-state entry (jaxlm.training.state.StateEntry);
  `from_config` takes the values from the config's `loss_scale`."""
  initial_scale: float
  growth_interval: int
  factor: float
  min_scale: float
  key = "loss_scale"
  summed_metrics = ("overflow_steps",)
  last_metrics = ("loss_scale", "overflow_steps_total")
  expected_skip_metric = "overflow_steps"  # an overflow skip lowers the scale: expected, not a divergence

  def init(self) -> LossScaleState:
    return {"scale": jnp.asarray(self.initial_scale, jnp.float32), "good_steps": jnp.zeros((), jnp.int32),
            "overflow_steps": jnp.zeros((), jnp.int32)}

  def loss_multiplier(self, state: LossScaleState) -> jax.Array:
    return state["scale"]

  def update(self, state: LossScaleState, loss: jax.Array, grad_norm: jax.Array,
             applied: jax.Array) -> tuple[LossScaleState, dict]:
    """The next scale state after a step whose (unscaled) loss and gradient norm are given and whose update was
    `applied` or skipped, and the step's metrics: `loss_scale` (the new scale), `overflow_steps` (1 when this step
    was skipped as an overflow: it does not count as non-finite) and `overflow_steps_total`."""
    scale, good = state["scale"], state["good_steps"]
    gradient_overflow = jnp.isfinite(loss) & ~jnp.isfinite(grad_norm)
    # At the floor an overflow is left to the non-finite count: no smaller scale remains to avoid it.
    overflow = gradient_overflow & (scale > self.min_scale)
    grow = applied & (good + 1 >= self.growth_interval)
    new_scale = jnp.where(gradient_overflow, jnp.maximum(scale / self.factor, self.min_scale),
                          jnp.where(grow, jnp.minimum(scale * self.factor, LOSS_SCALE_MAX), scale))
    new_good = jnp.where(applied & ~grow, good + 1, jnp.where(applied | gradient_overflow, 0, good))
    new_state = {"scale": new_scale.astype(jnp.float32), "good_steps": new_good.astype(jnp.int32),
                 "overflow_steps": state["overflow_steps"] + overflow.astype(jnp.int32)}
    metrics = {"loss_scale": new_state["scale"], "overflow_steps": overflow.astype(jnp.float32),
               "overflow_steps_total": new_state["overflow_steps"].astype(jnp.float32)}
    return new_state, metrics


def from_config(config: Config) -> DynamicLossScale | None:
  """The loss scaling of a run: None (no scaling, the unchanged step) unless model.compute_dtype is float16."""
  if config.model.compute_dtype != "float16":
    return None
  c = config.loss_scale
  return DynamicLossScale(initial_scale=c.init, growth_interval=c.growth_interval, factor=c.factor,
                          min_scale=c.min)
