"""Where a config's optional features become plug-ins of the training core: `lora.rank > 0` a LoRA split of the
parameters (jaxlm/adapters/lora.py), a float16 `model.compute_dtype` the dynamic loss scale as a state entry
(jaxlm/training/loss_scale.py), `mesh.pipeline > 1` the pipeline's gradient function (jaxlm/training/pipeline.py).
Every kind of run, the planner and the benchmarks build their train state and steps through here, so a feature is
chosen in this one place and the state builder, the step and the loop never ask which features a run has."""

from __future__ import annotations

from flax import nnx
from jax.sharding import Mesh

from jaxlm import kernels as kernels_lib
from jaxlm.adapters import lora
from jaxlm.config import Config
from jaxlm.kernels import Kernels
from jaxlm.models.gpt import GPT
from jaxlm.training import loss_scale, pipeline
from jaxlm.training.state import Features, ModelFactory, WholeModel, abstract_model, check_mesh_fits_model, \
    init_train_state


def decoder_factory(config: Config, mesh: Mesh, kernels: Kernels | None = None) -> ModelFactory:
  """The config's GPT with `kernels` (None: config.kernels resolved for `mesh`): what pretraining trains."""
  if kernels is None:
    kernels = kernels_lib.resolve(config.kernels, compute_dtype=config.model.compute_dtype, causal=True,
                                  mesh=mesh, **config.model.kernel_needs)
  return lambda rngs: GPT(config.model, kernels=kernels, rngs=rngs)


def features_from_config(config: Config, mesh: Mesh, make_model: ModelFactory,
                         language_model_loss: bool = True) -> Features:
  """The run's Features. `language_model_loss`: the task trains the decoder's own next-token loss (the only one a
  pipeline computes)."""
  split = WholeModel()
  if config.lora.rank:  # with init_from the frozen base starts empty: the start loads the checkpoint into it
    split = lora.split_for(make_model, config.lora, empty_base=bool(config.init_from))
  entries = tuple(entry for entry in (loss_scale.from_config(config),) if entry is not None)
  gradients = None
  if pipeline.num_stages(mesh) > 1:
    if not language_model_loss:
      raise ValueError("mesh.pipeline > 1 trains the language model's own loss; a task with another loss "
                       "(fine-tuning) needs mesh.pipeline=1")
    gradients = pipeline.PipelineGradients(abstract_model(make_model)[0], mesh, config.train.grad_accum,
                                           config.mesh.pipeline_schedule)
  return Features(split, entries, gradients)


def train_state_from_config(config: Config, mesh: Mesh, optimizer, make_model: ModelFactory,
                            language_model_loss: bool = True, abstract_only: bool = False
                            ) -> tuple[nnx.GraphDef, dict, dict, Features]:
  """(graphdef, state, state shardings, features) of a run: the one builder (jaxlm.training.state.init_train_state)
  with the config's features and seed."""
  check_mesh_fits_model(config.model, mesh)
  features = features_from_config(config, mesh, make_model, language_model_loss)
  graphdef, state, shardings = init_train_state(make_model, config.train.seed, mesh, optimizer, features,
                                                abstract_only)
  return graphdef, state, shardings, features
