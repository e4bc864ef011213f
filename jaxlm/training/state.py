"""THE train-state builder, and the two ways an optional feature plugs into a run's state.

  {"step": int32 [], "params": what the optimizer trains, "opt_state": its optax state,
   "frozen": the fixed rest of the model (only with a ParamSplit that keeps one: LoRA's base),
   <entry.key>: each StateEntry's value (float16: "loss_scale")}

A `ParamSplit` divides the model's parameters into the trainable tree and a frozen one, lays both out on the mesh
and joins them back for the model (`combine`); full training is `WholeModel`. A `StateEntry` adds its own value to
the state, may scale the loss, and updates its value after each step from the step's loss and gradient norm. A run
hands both in as `Features`; the builder, the step (jaxlm/training/steps.py) and the loop (loop.py) use them without
knowing which feature they are. The state is initialised directly in its shardings (never whole on one device), or
only as shapes with shardings for the planner (`abstract_only`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from jaxlm.config import ModelConfig
from jaxlm.parallel import sharding

TrainState = dict  # the module docstring's layout
ModelFactory = Callable[[nnx.Rngs], nnx.Module]  # builds the model to train


class ParamSplit(Protocol):
  """How a run's parameters divide into what the optimizer trains and a frozen part."""

  def init(self, params: dict, seed: int) -> tuple[dict, dict | None]:
    """(trainable, frozen or None) from the model's freshly initialised plain parameter tree (traced under jit)."""

  def shardings(self, abstract_params: nnx.State, trainable: Any, frozen: Any, mesh: Mesh) -> tuple[Any, Any]:
    """Shardings of the (abstract) trainable and frozen trees; `abstract_params` carries the logical axes."""

  def combine(self, trainable: Any, frozen: Any) -> Any:
    """The model's parameter tree (for nnx.merge) from the two parts; works on arrays, shapes and shardings."""


@dataclasses.dataclass(frozen=True)
class WholeModel:
  """Full training: every parameter is trainable, nothing is frozen."""

  def init(self, params: dict, seed: int) -> tuple[dict, None]:
    return params, None

  def shardings(self, abstract_params: nnx.State, trainable: Any, frozen: Any, mesh: Mesh) -> tuple[Any, None]:
    return sharding.param_shardings(abstract_params, mesh), None

  def combine(self, trainable: Any, frozen: Any) -> Any:
    return trainable


class StateEntry(Protocol):
  """An extra value in the train state (replicated, checkpointed with it) and what it does in each step."""
  key: str  # its name in the state
  summed_metrics: tuple[str, ...]  # its step metrics that a metrics line sums over its steps (others: the mean)
  last_metrics: tuple[str, ...]  # ... that a metrics line takes at its last step
  expected_skip_metric: str | None  # a step metric that is 1 when a skipped update was expected, not a divergence

  def init(self) -> Any:
    """The entry's value at step 0."""

  def loss_multiplier(self, value: Any) -> jax.Array | None:
    """A factor for the loss before differentiation (the gradients are divided by it after), or None."""

  def update(self, value: Any, loss: jax.Array, grad_norm: jax.Array, applied: jax.Array) -> tuple[Any, dict]:
    """The value after a step with this (unscaled) loss and gradient norm whose update was `applied` or skipped,
    and the entry's step metrics."""


@dataclasses.dataclass(frozen=True)
class Features:
  """A run's optional features, as the state builder, the step and the loop take them. `gradients` replaces the
  data-parallel gradient function (a pipeline); None: jaxlm/training/steps.py's."""
  split: ParamSplit = WholeModel()
  entries: tuple[StateEntry, ...] = ()
  gradients: Any = None  # steps.Gradients

  def model_params(self, state: TrainState) -> Any:
    """The model's parameter tree of a train state (or of its shardings): what nnx.merge, eval and saving take."""
    return self.split.combine(state["params"], state.get("frozen"))

  def report_facts(self, config, mesh: Mesh, state: TrainState) -> dict:
    """Facts of the finished run that the features know (a pipeline's bubble and per-stage memory)."""
    return {} if self.gradients is None else self.gradients.report_facts(config, mesh, state)


def abstract_model(make_model: ModelFactory) -> tuple[nnx.GraphDef, nnx.State]:
  """Graph definition and parameter shapes of `make_model(rngs)`'s model, without allocating any parameter."""
  return nnx.split(nnx.eval_shape(lambda: make_model(nnx.Rngs(0))))


def check_mesh_fits_model(config: ModelConfig, mesh: Mesh) -> None:
  hint = "choose a mesh.tensor that divides it"
  sharding.check_divisible("model.num_heads", config.num_heads, mesh, "tensor", hint)
  sharding.check_divisible("model MLP width", config.mlp_width, mesh, "tensor", hint)
  if config.num_experts and sharding.EXPERT_AXIS in mesh.shape:
    sharding.check_divisible("model.num_experts", config.num_experts, mesh, sharding.EXPERT_AXIS,
                             "choose a mesh.expert that divides the experts")


def optimizer_state_shardings(optimizer: optax.GradientTransformation, opt_state: Any, param_shardings: Any,
                              replicated: jax.sharding.Sharding) -> Any:
  """Shardings of `optimizer`'s (abstract) state: moments mirror the parameters' shardings, counters and other
  scalars are replicated. The leaves a partitioned group leaves out (optax.MaskedNode: train.optimizer=muon's AdamW
  leaves in its Muon state and the reverse) stay out."""
  masked = lambda x: isinstance(x, optax.MaskedNode)
  return optax.tree_map_params(optimizer, lambda x, s: x if masked(x) else s, opt_state, param_shardings,
                               transform_non_params=lambda _: replicated, is_leaf=masked)


def init_train_state(make_model: ModelFactory, seed: int, mesh: Mesh, optimizer: optax.GradientTransformation,
                     features: Features = Features(), abstract_only: bool = False
                     ) -> tuple[nnx.GraphDef, TrainState, TrainState]:
  """(graphdef, state, state shardings) of `make_model`'s model under `features`, initialised in its shardings.
  `abstract_only`: the state as ShapeDtypeStructs with shardings, nothing allocated (memory estimates)."""
  graphdef, abstract_params = abstract_model(make_model)

  def init():
    params = nnx.split(make_model(nnx.Rngs(seed)))[1].to_pure_dict()
    trainable, frozen = features.split.init(params, seed)
    state = {"step": jnp.zeros((), jnp.int32), "params": trainable, "opt_state": optimizer.init(trainable)}
    if frozen is not None:
      state["frozen"] = frozen
    return {**state, **{entry.key: entry.init() for entry in features.entries}}

  abstract = jax.eval_shape(init)
  replicated = sharding.replicated(mesh)
  param_shardings, frozen_shardings = features.split.shardings(abstract_params, abstract["params"],
                                                               abstract.get("frozen"), mesh)
  shardings = {
      "step": replicated,
      "params": param_shardings,
      "opt_state": optimizer_state_shardings(optimizer, abstract["opt_state"], param_shardings, replicated),
  }
  if frozen_shardings is not None:
    shardings["frozen"] = frozen_shardings
  shardings.update({entry.key: jax.tree.map(lambda _: replicated, abstract[entry.key]) for entry in features.entries})
  if abstract_only:
    return graphdef, jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract,
                                  shardings), shardings
  return graphdef, jax.jit(init, out_shardings=shardings)(), shardings
