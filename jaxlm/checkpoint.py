"""Checkpoints with orbax: the train state, the data-iterator position and the model config, saved together.

Re-running with the same workdir restores the latest complete checkpoint (orbax writes to a temporary folder and
renames it when complete, so a run killed mid-save leaves the previous checkpoint as the latest). Arrays are restored
straight into the shardings of the current mesh.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxlm.config import ModelConfig


class Checkpointer:

  def __init__(self, directory: str, every_steps: int, keep: int):
    self.every_steps = every_steps
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
    self.manager = ocp.CheckpointManager(os.path.abspath(directory), options=options)

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def should_save(self, step: int) -> bool:
    return self.every_steps > 0 and step % self.every_steps == 0

  def save(self, step: int, state: Any, data_state: dict, model_config: ModelConfig) -> None:
    """Saves asynchronously; the arrays are copied before this returns, so training may go on donating them."""
    if self.manager.latest_step() == step:
      return
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        model=ocp.args.JsonSave(dataclasses.asdict(model_config)),
    ))

  def restore(self, step: int, abstract_state: Any, model_config: ModelConfig) -> tuple[Any, dict]:
    """Restores `step` onto the shardings in `abstract_state` (ShapeDtypeStructs with `.sharding`)."""
    saved_model = self.manager.restore(step, args=ocp.args.Composite(model=ocp.args.JsonRestore()))["model"]
    expected = dataclasses.asdict(model_config)
    shape_keys = ("vocab_size", "num_layers", "d_model", "num_heads", "d_ff", "max_seq_len")
    for key in shape_keys:
      if saved_model.get(key) != expected[key]:
        raise ValueError(
            f"checkpoint {self.manager.directory}/{step} holds a model with {key}={saved_model.get(key)} but the "
            f"config asks for model.{key}={expected[key]}; use another --workdir or the checkpoint's model config")
    restored = self.manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore(),
    ))
    return restored["state"], restored["data"]

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
