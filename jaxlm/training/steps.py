"""The pure train and eval steps: the token-weighted loss, exact gradient accumulation (GSPMD or an explicit
shard_map reduction), the update with non-finite skipping, and their jit.

The model is split once into a static graph definition and a pure-dict parameter tree; the steps are plain
`jax.jit` functions of (state, batch) with explicit shardings and a donated state, so nothing walks the module graph
in the hot loop. Optional features come in as a `state.Features` (a trainable/frozen split, extra state entries, a
replacement gradient function) that the step composes without knowing which they are. The train state is built by
jaxlm/training/state.py; the loop that runs the steps is loop.py.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxlm.config import Config
from jaxlm.parallel import sharding
from jaxlm.training import optim
from jaxlm.training.metrics import lm_metrics
from jaxlm.training.state import Features, TrainState

# (params, batch) -> (mean loss, token count, gradients, aux): what a gradient function computes.
GradientFn = Callable[[Any, dict], tuple[jax.Array, jax.Array, Any, dict]]


# ----------------------------------------------------------------------------------------------- steps


def make_loss_fn(graphdef: nnx.GraphDef, objective: bool = True) -> optim.SumLossFn:
  """Sum of token cross-entropies over valid tokens (plus the model's `aux_loss` sum when `objective`: what training
  minimises; evaluation reports the cross-entropy alone), the valid-token count, and the model's summed metrics
  (`correct` and any others, each weighted by tokens). The model's kernels compute the loss from the final hidden
  states and the output table (with or without [B, T, V] logits)."""

  def loss_fn(params, batch):
    mask_BT = batch["loss_mask"].astype(jnp.float32)
    loss_sum, sums = nnx.merge(graphdef, params).loss_sums(batch["inputs"], batch["targets"], mask_BT,
                                                           batch["positions"], batch["segment_ids"])
    if objective and "aux_loss" in sums:
      loss_sum = loss_sum + sums["aux_loss"]
    return loss_sum, (mask_BT.sum(), sums)

  return loss_fn


def resolve_gradient_sync(gradient_sync: str, mesh_shape: dict[str, int], grad_accum: int) -> str:
  """`auto` -> `shard_map` for pure data parallelism with accumulation, else `gspmd`.

  Under GSPMD every micro-batch's gradient is all-reduced inside the accumulation loop (the replicated accumulator
  needs a replicated addend): grad_accum times the bytes on the CPU (XLA:CPU has no pass that hoists the
  reduction out of the loop; XLA:GPU/TPU may). The shard_map path accumulates each device's own sums and reduces
  once. With FSDP or TP the parameters are sharded and GSPMD's per-micro-batch reduce-scatter is what keeps the
  gradient memory sharded, so `auto` keeps GSPMD there."""
  if gradient_sync != "auto":
    return gradient_sync
  pure_data = (mesh_shape.get("fsdp", 1) == 1 and mesh_shape.get("tensor", 1) == 1
               and mesh_shape.get(sharding.EXPERT_AXIS, 1) == 1 and mesh_shape.get(sharding.CONTEXT_AXIS, 1) == 1
               and mesh_shape.get("data", 1) > 1)
  return "shard_map" if pure_data and grad_accum > 1 else "gspmd"


def make_gradient_fn(loss_fn: optim.SumLossFn, grad_accum: int, mesh: Mesh | None = None,
                     gradient_sync: str = "auto") -> GradientFn:
  """(params, batch) -> (mean loss, token count, gradients, aux) of the data-parallel mesh axes.

  `gspmd` leaves the collectives to GSPMD. `shard_map` writes the data-parallel reduction by hand: each device
  computes its shard's loss and gradient sums, one `psum` over the batch axes adds them up, then every device
  divides by the global token count. Parameters enter replicated (FSDP/TP shards are all-gathered at the boundary),
  so this path is data parallelism with an explicit collective, tested equal to `gspmd`. `auto`: see
  `resolve_gradient_sync`.
  """
  if resolve_gradient_sync(gradient_sync, dict(mesh.shape) if mesh is not None else {}, grad_accum) == "gspmd":
    return lambda params, batch: optim.accumulate_gradients(loss_fn, params, batch, grad_accum)
  batch_axes = sharding.batch_axes(mesh)

  def per_shard(params, batch):
    return optim.accumulate_gradients(loss_fn, params, batch, grad_accum,
                                      reduce_sums=lambda sums: jax.lax.psum(sums, batch_axes))

  # check_vma=False: with it on, autodiff already sums the gradient of a replicated input over devices (the
  # transpose of its implicit broadcast), and the psum above would count every shard once per device.
  return jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P(batch_axes)), out_specs=P(), check_vma=False)


@dataclasses.dataclass(frozen=True)
class DataParallelGradients:
  """A run's gradient function on the data-parallel axes (`make_gradient_fn`); a Features may carry another.
  Called with the step's loss and loss multiplier, it returns the GradientFn."""
  grad_accum: int
  mesh: Mesh | None = None
  gradient_sync: str = "auto"
  metrics = {}  # constant step metrics of this gradient function: none

  def __call__(self, loss_fn: optim.SumLossFn, multiplier: jax.Array | None) -> GradientFn:
    return make_gradient_fn(scaled_loss_fn(loss_fn, multiplier), self.grad_accum, self.mesh, self.gradient_sync)

  def report_facts(self, config, mesh, state) -> dict:
    return {}


def scaled_loss_fn(loss_fn: optim.SumLossFn, scale: jax.Array | None) -> optim.SumLossFn:
  """`loss_fn` with its loss sum multiplied by `scale` (the count and aux metrics unchanged); None: `loss_fn`."""
  if scale is None:
    return loss_fn

  def scaled(params, batch):
    loss_sum, (count, aux) = loss_fn(params, batch)
    return loss_sum * scale, (count, aux)

  return scaled


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, schedule: optax.Schedule,
                    gradients, features: Features = Features(), loss_fn: optim.SumLossFn | None = None):
  """(state, batch) -> (state, metrics). `gradients` (DataParallelGradients or a Features's own) turns the loss into
  gradients; `loss_fn` (default: the LM's token cross-entropy) returns (loss sum, (count, {"correct": ...})), and
  the metric `token_accuracy` is correct / count, i.e. example accuracy for a classification loss. `features`: the
  run's trainable/frozen split and state entries (module docstring)."""
  loss_fn = loss_fn or make_loss_fn(graphdef)

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    frozen = state.get("frozen")  # a constant of the loss: gradients of the trainable params only
    trainable_loss_fn = lambda params, b: loss_fn(features.split.combine(params, frozen), b)
    factors = [f for e in features.entries if (f := e.loss_multiplier(state[e.key])) is not None]
    scale = functools.reduce(operator.mul, factors) if factors else None  # None: the loss as it is
    loss, count, grads, aux = gradients(trainable_loss_fn, scale)(state["params"], batch)
    if scale is not None:  # back to the true loss and float32 gradients (exact for a power-of-two scale)
      loss, grads = loss / scale, jax.tree.map(lambda g: g / scale, grads)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    grad_norm, update_norm = global_norm(grads), global_norm(updates)
    # A NaN/inf loss, gradient or update skips the update on the device (no host sync): params and optimizer
    # state keep their old values bit for bit (so Adam's count only counts applied updates); `step` still
    # advances, as it counts batches consumed. The loop counts skips and stops after too many in a row.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
    params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                     (params, opt_state), (state["params"], state["opt_state"]))
    metrics = {
        "loss": loss,
        "token_accuracy": aux["correct"] / jnp.maximum(count, 1.0),
        "tokens": count,
        "grad_norm": grad_norm,
        "update_norm": update_norm,
        "param_norm": global_norm(params),
        "learning_rate": schedule(state["step"]),
        "skipped_steps": 1.0 - finite.astype(jnp.float32),  # 1 when this step's update was skipped
        **gradients.metrics,
        # The model's other sums (a mixture of experts' router statistics) are weighted by tokens: their means.
        **{name: value / jnp.maximum(count, 1.0) for name, value in aux.items() if name != "correct"},
    }
    new_state = {**state, "step": state["step"] + 1, "params": params, "opt_state": opt_state}
    for entry in features.entries:
      new_state[entry.key], entry_metrics = entry.update(state[entry.key], loss, grad_norm, finite)
      metrics.update(entry_metrics)
    return new_state, metrics

  return train_step


def global_norm(tree: Any) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def make_eval_step(graphdef: nnx.GraphDef):
  loss_fn = make_loss_fn(graphdef, objective=False)

  def eval_step(params, batch):
    loss_sum, (count, aux) = loss_fn(params, batch)
    return {"loss_sum": loss_sum, "tokens": count, "correct": aux["correct"]}

  return eval_step


@dataclasses.dataclass(frozen=True)
class FrozenInputs:
  """Arrays a task's loss reads but never trains (a distillation teacher's parameters): every train and eval step
  takes them as an argument, in their own shardings, outside the train state (so outside the checkpoints).
  `loss_of(values)` and `eval_of(values)` build the step's loss and eval functions from the traced arrays."""
  values: Any
  shardings: Any
  loss_of: Callable[[Any], optim.SumLossFn]
  eval_of: Callable[[Any], Callable]


def jit_steps(graphdef, optimizer, config: Config, mesh: Mesh, state_shardings, features: Features = Features(),
              loss_fn: optim.SumLossFn | None = None, eval_fn=None, inputs: FrozenInputs | None = None):
  """The train and eval steps, each compiled once, with explicit shardings and the train state donated.

  `loss_fn` (default: the LM's `make_loss_fn`) and `eval_fn` ((params, batch) -> outputs to sum or gather; default:
  `make_eval_step`) give another task's steps (fine-tuning's classification loss); `inputs` gives both instead, from
  frozen arrays that every step takes, bound so that the steps are still called and lowered as (state, batch) and
  (params, batch). A batch is a dict of [B, ...] arrays of any rank, each split over
  the batch axes."""
  if inputs is None:
    loss_of, eval_of, extra, extra_shardings = (lambda: loss_fn), (lambda: eval_fn), (), ()
  elif loss_fn is not None or eval_fn is not None:
    raise ValueError("jit_steps takes a task's loss either as loss_fn/eval_fn or from inputs, not both")
  else:
    loss_of, eval_of, extra, extra_shardings = inputs.loss_of, inputs.eval_of, (inputs.values,), (inputs.shardings,)
  batch_sharding = sharding.batch_sharding(mesh, 1)  # a prefix for every rank: axis 0 split, the rest whole
  schedule = optim.learning_rate_schedule(config.train)
  overrides = sharding.rule_overrides(config.mesh)
  gradients = features.gradients or DataParallelGradients(config.train.grad_accum, mesh, config.mesh.gradient_sync)

  def train_step(state, batch, *values):
    step = make_train_step(graphdef, optimizer, schedule, gradients, features, loss_of(*values))
    return step(state, batch)

  def eval_step(params, batch, *values):
    return (eval_of(*values) or make_eval_step(graphdef))(params, batch)

  jitted_train = jax.jit(sharding.traced_on(mesh, train_step, overrides),
                         in_shardings=(state_shardings, batch_sharding, *extra_shardings),
                         out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=0)
  jitted_eval = jax.jit(sharding.traced_on(mesh, eval_step, overrides),
                        in_shardings=(features.model_params(state_shardings), batch_sharding, *extra_shardings),
                        out_shardings=sharding.replicated(mesh))
  return _bound(jitted_train, extra), _bound(jitted_eval, extra)


class _Bound:
  """A jitted step with its trailing frozen inputs bound: called and lowered with the leading arguments only (the
  compiled executable of `lower(...).compile()` takes the frozen inputs too: `frozen` holds them)."""

  def __init__(self, jitted, frozen: tuple):
    self.jitted, self.frozen = jitted, frozen

  def __call__(self, *args):
    return self.jitted(*args, *self.frozen)

  def lower(self, *args):
    return self.jitted.lower(*args, *self.frozen)


def _bound(jitted, extra: tuple):
  return _Bound(jitted, extra) if extra else jitted


def to_global_batch(local_batch: dict, mesh: Mesh) -> dict:
  """Assembles each process's rows into one global array sharded over the batch axes."""
  return {k: jax.make_array_from_process_local_data(sharding.batch_sharding(mesh, v.ndim), v)
          for k, v in local_batch.items()}


def evaluate(eval_step, params, batches: list[dict], mesh: Mesh) -> dict:
  totals = None
  for batch in batches:
    out = eval_step(params, to_global_batch(batch, mesh))
    totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
  totals = jax.device_get(totals)
  # Sums an eval function adds beside the loss (a distillation's divergence) are averaged over the same tokens.
  extra = {f"eval_{k}": float(v) / max(float(totals["tokens"]), 1.0) for k, v in totals.items()
           if k not in ("loss_sum", "tokens", "correct")}
  return {**lm_metrics(totals["loss_sum"], totals["tokens"], totals["correct"]), **extra}
