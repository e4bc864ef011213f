"""Reading a decoder back from a jaxlm training run folder (config.json, tokenizer.json, checkpoints/), for the tools
that use a trained model: experiments/generate.py and experiments/lm_eval.py.

  config, graphdef, params, tokenizer, step = runs.load_decoder_run("runs/demo", mesh_tensor=1)
  graphdef, params = runs.with_weights(graphdef, params, "weight_only")   # int8 weights, same mesh
"""

from __future__ import annotations

import dataclasses
import os

import jax
from flax import nnx

from jaxlm import config as config_lib
from jaxlm import data as data_lib
from jaxlm import generate, optim, quant, quant_io, sharding
from jaxlm import steps as steps_lib
from jaxlm.checkpoint import Checkpointer, abstract_with_shardings


def load_decoder_run(workdir: str, mesh_tensor: int = 1):
  """(config, graphdef, params, tokenizer, step) of a run's newest checkpoint, params sharded on this host's
  devices (heads over `mesh_tensor` devices, replicated over the rest)."""
  config_path = os.path.join(workdir, "config.json")
  if not os.path.exists(config_path):
    raise ValueError(f"{config_path} not found: --workdir must be a jaxlm training run folder")
  config = config_lib.from_run_file(config_path)
  config = dataclasses.replace(config, mesh=config_lib.MeshConfig(data=-1, fsdp=1, tensor=mesh_tensor))
  mesh = sharding.make_mesh(config.mesh)
  optimizer = optim.make_optimizer(config.train)
  built = {}

  def init():  # traced only (eval_shape): shapes and shardings of the train state, nothing allocated
    graphdef, state, state_shardings = steps_lib.init_train_state(config, mesh, optimizer)
    built.update(graphdef=graphdef, shardings=state_shardings)
    return state

  abstract_state = jax.eval_shape(init)
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=0, keep=config.checkpoint.keep)
  try:
    restored = checkpointer.restore_latest(abstract_with_shardings(abstract_state, built["shardings"]), config.model)
  finally:
    checkpointer.close()
  if restored is None:
    raise ValueError(f"no checkpoint in {workdir}/checkpoints; train first (experiments/train_lm.py)")
  step, state, _ = restored
  tokenizer = data_lib.load_tokenizer(os.path.join(workdir, "tokenizer.json"))
  return config, built["graphdef"], state["params"], tokenizer, step


WEIGHTS = ("float", "weight_only", "w8a8_dynamic")  # the trained weights, or jaxlm.quant's calibration-free int8


def with_weights(graphdef, params, weights: str = "float"):
  """(graphdef, params) of the decoder with `weights`: "float" as trained, or int8 weights quantized with
  jaxlm.quant's `weight_only` or `w8a8_dynamic` mode, placed on the mesh of `params` (if any)."""
  if weights not in WEIGHTS:
    raise ValueError(f"weights={weights!r} is not one of {', '.join(WEIGHTS)}")
  if weights == "float":
    return graphdef, params
  model = quant.quantize(nnx.merge(graphdef, params), weights)
  mesh = generate.mesh_of(params)
  return nnx.split(model if mesh is None else quant_io.place(model, mesh))
