"""Train state and the pure train and eval steps: sharded initialisation, the token-weighted loss, exact gradient
accumulation (GSPMD or an explicit shard_map reduction), the update with non-finite skipping, and their jit.

The model is split once into a static graph definition and a pure-dict parameter tree; the steps are plain
`jax.jit` functions of (state, batch) with explicit shardings and a donated state, so nothing walks the module graph
in the hot loop. The loop that runs them is jaxlm/training/loop.py.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxlm import kernels as kernels_lib
from jaxlm.adapters import lora
from jaxlm.training import optim
from jaxlm.training import pipeline
from jaxlm.parallel import sharding
from jaxlm.training import loss_scale as loss_scale_lib
from jaxlm.config import Config, ModelConfig
from jaxlm.training.metrics import lm_metrics
from jaxlm.kernels import Kernels
from jaxlm.models.gpt import GPT

TrainState = dict  # {"step": int32 [], "params": pure dict of f32 arrays, "opt_state": optax state}; LoRA adds
                   # "frozen" (the base; "params" are then the adapters and head only: see jaxlm/adapters/lora.py)
ModelFactory = Any  # Callable[[nnx.Rngs], nnx.Module]: builds the model to train (default: the GPT of the config)


# ----------------------------------------------------------------------------------------------- model and state


def abstract_model(make_model: ModelFactory) -> tuple[nnx.GraphDef, nnx.State]:
  """Graph definition and parameter shapes of `make_model(rngs)`'s model, without allocating any parameter."""
  return nnx.split(nnx.eval_shape(lambda: make_model(nnx.Rngs(0))))


def check_mesh_fits_model(config: ModelConfig, mesh: Mesh) -> None:
  hint = "choose a mesh.tensor that divides it"
  sharding.check_divisible("model.num_heads", config.num_heads, mesh, "tensor", hint)
  sharding.check_divisible("model MLP width", config.mlp_width, mesh, "tensor", hint)


def init_train_state(config: Config, mesh: Mesh, optimizer: optax.GradientTransformation,
                     make_model: ModelFactory | None = None,
                     kernels: Kernels | None = None) -> tuple[nnx.GraphDef, TrainState, Any]:
  """Initialises parameters and optimizer state directly in their shardings (never whole on one device).

  The default model is the config's GPT with `kernels` (None: config.kernels resolved for `mesh`);
  `make_model(rngs)` builds another one (fine-tuning passes a BERT classifier)."""
  check_mesh_fits_model(config.model, mesh)
  if make_model is None:
    if kernels is None:
      kernels = kernels_lib.resolve(config.kernels, compute_dtype=config.model.compute_dtype, causal=True,
                                    head_dim=config.model.head_dim, mesh=mesh)
    make_model = lambda rngs: GPT(config.model, kernels=kernels, rngs=rngs)
  graphdef, abstract_params = abstract_model(make_model)
  if config.lora.rank:  # adapters: the frozen base beside the trainable params, out of the optimizer (jaxlm/adapters/lora.py)
    # With init_from the frozen base starts empty: the start loads the checkpoint into it leaf by leaf.
    _, state, state_shardings = lora.init_train_state(config.lora, config.train.seed, mesh, optimizer, make_model,
                                                      abstract_params, empty_base=bool(config.init_from))
    return graphdef, *loss_scale_lib.with_loss_scale(config, mesh, state, state_shardings)
  param_shardings = sharding.param_shardings(abstract_params, mesh)

  def init():
    params = nnx.split(make_model(nnx.Rngs(config.train.seed)))[1].to_pure_dict()
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}

  abstract_state = jax.eval_shape(init)
  state_shardings = {
      "step": sharding.replicated(mesh),
      "params": param_shardings,
      # Optimizer moments mirror the parameters' shardings; counters and other scalars are replicated.
      "opt_state": optax.tree_map_params(
          optimizer, lambda _, s: s, abstract_state["opt_state"], param_shardings,
          transform_non_params=lambda _: sharding.replicated(mesh)),
  }
  state = jax.jit(init, out_shardings=state_shardings)()
  # float16 only: the dynamic loss scale joins the state (checkpointed with it); bf16/f32 states are unchanged.
  return graphdef, *loss_scale_lib.with_loss_scale(config, mesh, state, state_shardings)


# ----------------------------------------------------------------------------------------------- steps


def make_loss_fn(graphdef: nnx.GraphDef) -> optim.SumLossFn:
  """Sum of token cross-entropies over valid tokens, the valid-token count, and summed aux metrics. The model's
  kernels compute the loss from the final hidden states and the output table (with or without [B, T, V] logits)."""

  def loss_fn(params, batch):
    mask_BT = batch["loss_mask"].astype(jnp.float32)
    loss_sum, correct = nnx.merge(graphdef, params).loss_sums(batch["inputs"], batch["targets"], mask_BT,
                                                              batch["positions"], batch["segment_ids"])
    return loss_sum, (mask_BT.sum(), {"correct": correct})

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
  pure_data = mesh_shape.get("fsdp", 1) == 1 and mesh_shape.get("tensor", 1) == 1 and mesh_shape.get("data", 1) > 1
  return "shard_map" if pure_data and grad_accum > 1 else "gspmd"


def make_gradient_fn(loss_fn: optim.SumLossFn, grad_accum: int, mesh: Mesh | None = None,
                     gradient_sync: str = "auto", pipeline_schedule: str = "gpipe",
                     graphdef: nnx.GraphDef | None = None):
  """(params, batch) -> (mean loss, token count, gradients, aux).

  A mesh with a `pipeline` axis > 1 takes jaxlm/training/pipeline.py's path instead: the language model's loss computed
  stage by stage under `pipeline_schedule` (it needs the model's `graphdef`, and takes an optional loss scale).

  `gspmd` leaves the collectives to GSPMD. `shard_map` writes the data-parallel reduction by hand: each device
  computes its shard's loss and gradient sums, one `psum` over the batch axes adds them up, then every device
  divides by the global token count. Parameters enter replicated (FSDP/TP shards are all-gathered at the boundary),
  so this path is data parallelism with an explicit collective, tested equal to `gspmd`. `auto`: see
  `resolve_gradient_sync`.
  """
  if pipeline.num_stages(mesh) > 1:
    if graphdef is None:
      raise ValueError("mesh.pipeline > 1 trains the language model's own loss; a task with another loss "
                       "(fine-tuning) needs mesh.pipeline=1")
    return pipeline.make_gradient_fn(graphdef, mesh, grad_accum, pipeline_schedule)
  if resolve_gradient_sync(gradient_sync, dict(mesh.shape) if mesh is not None else {}, grad_accum) == "gspmd":
    return lambda params, batch: optim.accumulate_gradients(loss_fn, params, batch, grad_accum)
  batch_axes = sharding.RULES["act_batch"]

  def per_shard(params, batch):
    return optim.accumulate_gradients(loss_fn, params, batch, grad_accum,
                                      reduce_sums=lambda sums: jax.lax.psum(sums, batch_axes))

  # check_vma=False: with it on, autodiff already sums the gradient of a replicated input over devices (the
  # transpose of its implicit broadcast), and the psum above would count every shard once per device.
  return jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P(batch_axes)), out_specs=P(), check_vma=False)


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, grad_accum: int,
                    schedule: optax.Schedule, mesh: Mesh | None = None, gradient_sync: str = "auto",
                    loss_fn: optim.SumLossFn | None = None,
                    loss_scaling: loss_scale_lib.DynamicLossScale | None = None,
                    pipeline_schedule: str = "gpipe"):
  """`loss_fn` (default: the LM's token cross-entropy) returns (loss sum, (count, {"correct": ...})); the metric
  `token_accuracy` is correct / count, i.e. example accuracy for a classification loss. `loss_scaling` (float16
  runs: loss_scale.from_config) scales the loss by the state's "loss_scale" and adapts it; None: no scaling."""
  language_model_loss = loss_fn is None
  loss_fn = loss_fn or make_loss_fn(graphdef)
  gradient_fn = make_gradient_fn(loss_fn, grad_accum, mesh, gradient_sync, pipeline_schedule,
                                 graphdef if language_model_loss else None)
  piped = pipeline.num_stages(mesh) > 1

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    step_loss_fn, step_gradient_fn = loss_fn, gradient_fn
    if "frozen" in state:  # LoRA: gradients of the trainable params only, the frozen base a constant of the loss
      frozen = state["frozen"]
      step_loss_fn = lambda params, b: loss_fn(lora.combine(params, frozen), b)
    if loss_scaling is not None:  # float16: gradients of the scaled loss, unscaled in f32 (jaxlm/training/loss_scale.py)
      step_loss_fn = loss_scaling.scaled_loss_fn(step_loss_fn, state["loss_scale"]["scale"])
    if piped:  # the pipeline computes the loss itself (LoRA: refused by config.validate); fp16 seeds its backward
      scale = state["loss_scale"]["scale"] if loss_scaling is not None else None
      step_gradient_fn = lambda params, b: gradient_fn(params, b, loss_scale=scale)
    elif step_loss_fn is not loss_fn:  # built per trace: the loss closes over values of this state
      step_gradient_fn = make_gradient_fn(step_loss_fn, grad_accum, mesh, gradient_sync)
    loss, count, grads, aux = step_gradient_fn(state["params"], batch)
    if loss_scaling is not None:
      loss, grads = loss_scaling.unscale(loss, grads, state["loss_scale"]["scale"])
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
    }
    if piped:  # the schedule's idle share of the step (a constant of the layout, reported beside its throughput)
      metrics["pipeline_bubble"] = jnp.float32(
          pipeline.bubble_fraction(pipeline.num_stages(mesh), grad_accum, pipeline_schedule))
    new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state}
    if "frozen" in state:
      new_state["frozen"] = state["frozen"]
    if loss_scaling is not None:  # an overflow lowers the scale; its skip is not counted as non-finite
      new_state["loss_scale"], scale_metrics = loss_scaling.update(state["loss_scale"], loss, grad_norm, finite)
      metrics.update(scale_metrics)
    return new_state, metrics

  return train_step


def model_params(state: TrainState) -> Any:
  """The model's parameter tree of a train state (or of its shardings): what nnx.merge, eval and saving take."""
  return lora.combine(state["params"], state["frozen"]) if "frozen" in state else state["params"]


def global_norm(tree: Any) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def make_eval_step(graphdef: nnx.GraphDef):
  loss_fn = make_loss_fn(graphdef)

  def eval_step(params, batch):
    loss_sum, (count, aux) = loss_fn(params, batch)
    return {"loss_sum": loss_sum, "tokens": count, "correct": aux["correct"]}

  return eval_step


def jit_steps(graphdef, optimizer, config: Config, mesh: Mesh, state_shardings,
              loss_fn: optim.SumLossFn | None = None, eval_fn=None):
  """The train and eval steps, each compiled once, with explicit shardings and the train state donated.

  `loss_fn` (default: the LM's `make_loss_fn`) and `eval_fn` ((params, batch) -> outputs to sum or gather; default:
  `make_eval_step`) give another task's steps (fine-tuning's classification loss). A batch is a dict of [B, ...]
  arrays of any rank, each split over the batch axes."""
  batch_sharding = sharding.batch_sharding(mesh, 1)  # a prefix for every rank: axis 0 split, the rest whole
  schedule = optim.learning_rate_schedule(config.train)
  overrides = sharding.rule_overrides(config.mesh)
  train_step = jax.jit(sharding.traced_on(mesh, make_train_step(graphdef, optimizer, config.train.grad_accum,
                                                                  schedule, mesh, config.mesh.gradient_sync, loss_fn,
                                                                  loss_scale_lib.from_config(config),
                                                                  config.mesh.pipeline_schedule),
                                          overrides),
                       in_shardings=(state_shardings, batch_sharding),
                       out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=0)
  eval_step = jax.jit(sharding.traced_on(mesh, eval_fn or make_eval_step(graphdef), overrides),
                      in_shardings=(model_params(state_shardings), batch_sharding),
                      out_shardings=sharding.replicated(mesh))
  return train_step, eval_step


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
  return lm_metrics(totals["loss_sum"], totals["tokens"], totals["correct"])
