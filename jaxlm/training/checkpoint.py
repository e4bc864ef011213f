"""Checkpoints with orbax: the train state, the data-iterator position and the model config, saved together.

Guarantees, and what gives them:
  * A run killed at any moment, during a save too, never leaves a checkpoint that restores wrong. Orbax writes a
    step into `<step>.orbax-checkpoint-tmp-<time>/` and renames it to `<step>/` only once every item is written, so
    `latest_step()` never sees a partial save; leftover temporary folders are deleted when the next run starts.
  * A step folder that is complete but unreadable later (a truncated or corrupted file, a partial copy) is moved
    aside to `<step>.corrupt-<time>/` with a warning, and the next older checkpoint is restored instead: losing a
    few steps beats losing the run. Only when no checkpoint is readable does restore fail, naming the steps.
  * A checkpoint that is readable but does not fit the run (another model, vocabulary, optimizer or dtype) is an
    error naming the first mismatched config key or tree path, never a silent partial restore (google/orbax#2972).
    Nothing falls back in that case: the workdir belongs to another run.
  * A state holding NaN or inf is never saved (`NonFiniteError`).
  * Arrays are restored straight into the shardings of the current mesh, whatever mesh or device count saved them.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxlm.config import ModelConfig
from jaxlm.training.reliability import NonFiniteError, all_finite, first_nonfinite_path, path_str

# Model config keys that change parameter shapes; a mismatch here gets the friendliest message.
_SHAPE_KEYS = ("vocab_size", "num_layers", "d_model", "num_heads", "d_ff", "max_seq_len")


class CheckpointMismatchError(ValueError):
  """The checkpoint is readable but holds another model, optimizer or dtype than this run."""


class _Unreadable(Exception):
  """A checkpoint step that could not be read (truncated or corrupted files)."""


def write_arrays_from_one_replica() -> None:
  """In a single-process job, orbax writes each replicated array from one device instead of splitting it into
  per-replica slices. Orbax's default on CPUs and TPUs slices every replicated array eagerly to spread the writing
  over its replicas, which on one host all write to the same disk anyway, and each distinct slice shape is a
  fresh compile: 3.9 of a tiny BERT fine-tune's 28 s went to the first save's 290 slices. Multi-process jobs keep
  orbax's default, where the replicas are on different hosts. (orbax's ArrayHandler is registered globally; it is
  the same handler with this one setting.)"""
  if jax.process_count() == 1:
    ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=False),
                                            override=True)


class Checkpointer:

  def __init__(self, directory: str, every_steps: int, keep: int):
    write_arrays_from_one_replica()
    self.every_steps = every_steps
    self.directory = os.path.abspath(directory)
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, cleanup_tmp_directories=True)
    # Registering the handlers up front lets a fresh manager read a step's metadata before restoring anything.
    self.manager = ocp.CheckpointManager(self.directory, options=options, item_handlers={
        "state": ocp.StandardCheckpointHandler(),
        "data": ocp.JsonCheckpointHandler(),
        "model": ocp.JsonCheckpointHandler(),
    })

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def should_save(self, step: int) -> bool:
    return self.every_steps > 0 and step % self.every_steps == 0

  def save(self, step: int, state: Any, data_state: dict, model_config: ModelConfig) -> None:
    """Saves asynchronously; the arrays are copied before this returns, so training may go on donating them.

    Raises NonFiniteError, writing nothing, when the state holds NaN or inf: a poisoned checkpoint would be
    restored by every later run.
    """
    if self.manager.latest_step() == step:
      return
    if not bool(all_finite(state)):
      raise NonFiniteError(
          f"the train state at step {step} holds non-finite values (first at {first_nonfinite_path(state)}); "
          f"not saved; the latest checkpoint is step {self.manager.latest_step()}")
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        data=ocp.args.JsonSave(data_state),
        model=ocp.args.JsonSave(dataclasses.asdict(model_config)),
    ))

  def restore(self, step: int, abstract_state: Any, model_config: ModelConfig) -> tuple[Any, dict]:
    """Restores `step` onto the shardings in `abstract_state` (ShapeDtypeStructs with `.sharding`).

    Raises CheckpointMismatchError when the checkpoint does not fit, and ValueError when it can not be read.
    """
    try:
      return self._restore(step, abstract_state, model_config)
    except _Unreadable as e:
      raise ValueError(str(e)) from e.__cause__

  def restore_latest(self, abstract_state: Any, model_config: ModelConfig) -> tuple[int, Any, dict] | None:
    """(step, state, data position) of the newest readable checkpoint, or None when there is none.

    Unreadable steps are moved aside (see the module docstring) and the next older one is tried.
    """
    steps = self.all_steps()
    failures = []
    for step in reversed(steps):
      try:
        state, data_state = self._restore(step, abstract_state, model_config)
      except _Unreadable as e:
        failures.append(step)
        moved = self._move_aside(step)
        print(f"warning: {e}; moved it to {moved}; trying the previous checkpoint", file=sys.stderr, flush=True)
        continue
      return step, state, data_state
    if failures:
      raise ValueError(f"no readable checkpoint in {self.directory}: steps {failures} are truncated or corrupted "
                       f"(moved aside as <step>.corrupt-*); use a new --workdir or restore a backup")
    return None

  def _restore(self, step: int, abstract_state: Any, model_config: ModelConfig) -> tuple[Any, dict]:
    where = f"checkpoint {self.directory}/{step}"
    try:
      saved_model = self.manager.restore(step, args=ocp.args.Composite(model=ocp.args.JsonRestore()))["model"]
      saved_tree = self.manager.item_metadata(step)["state"]
    except Exception as e:  # noqa: BLE001 (orbax, tensorstore and json raise many types for a damaged file)
      raise _Unreadable(f"{where} is unreadable ({_first_line(e)})") from e
    check_model_config(saved_model, model_config, where)
    check_tree(saved_tree, abstract_state, where)
    try:
      restored = self.manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state),
          data=ocp.args.JsonRestore(),
      ))
    except Exception as e:  # noqa: BLE001
      raise _Unreadable(f"{where} is unreadable ({_first_line(e)})") from e
    return restored["state"], restored["data"]

  def _move_aside(self, step: int) -> str:
    """Renames an unreadable step folder so that orbax no longer lists it and a later save may reuse the step."""
    source = os.path.join(self.directory, str(step))
    target = f"{source}.corrupt-{int(time.time())}"
    if jax.process_index() == 0 and os.path.isdir(source):
      os.rename(source, target)
    if jax.process_count() > 1:  # every process must see the rename before listing steps again
      from jax.experimental import multihost_utils  # noqa: PLC0415

      multihost_utils.sync_global_devices(f"jaxlm_checkpoint_move_aside_{step}")
    self.manager.reload()
    return target

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()


def check_model_config(saved: dict, expected: ModelConfig, where: str) -> None:
  """One-line error for a checkpoint of another model shape (vocabulary, width, depth, ...)."""
  expected_dict = dataclasses.asdict(expected)
  for key in _SHAPE_KEYS:
    if saved.get(key) != expected_dict[key]:
      raise CheckpointMismatchError(
          f"{where} holds a model with {key}={saved.get(key)} but the config asks for model.{key}="
          f"{expected_dict[key]}; use another --workdir or the checkpoint's model config")


def check_tree(saved_metadata: Any, abstract_state: Any, where: str) -> None:
  """Compares the saved arrays' paths, shapes and dtypes with the restore target; names the first difference.

  Orbax would otherwise restore silently and partially when the trees differ (google/orbax#2972).
  """
  saved = _leaf_specs(saved_metadata)
  target = _leaf_specs(abstract_state)
  for path, (shape, dtype) in target.items():
    if path not in saved:
      raise CheckpointMismatchError(
          f"{where} has no array at {path}, which this run needs ({_likely_cause(path)}); "
          f"use another --workdir or the config that wrote it")
    saved_shape, saved_dtype = saved[path]
    if saved_shape != shape:
      raise CheckpointMismatchError(
          f"{where} holds {path} with shape {saved_shape} but this run expects {shape}; "
          f"use another --workdir or the config that wrote it")
    if saved_dtype != dtype:
      raise CheckpointMismatchError(
          f"{where} holds {path} as {saved_dtype} but this run expects {dtype} (model.param_dtype?); "
          f"use another --workdir or the config that wrote it")
  extra = [path for path in saved if path not in target]
  if extra:
    raise CheckpointMismatchError(
        f"{where} holds {extra[0]}, which this run does not have ({_likely_cause(extra[0])}); "
        f"use another --workdir or the config that wrote it")


def _likely_cause(path: str) -> str:
  if path.startswith("loss_scale/"):  # jaxlm/training/loss_scale.py: only float16 runs keep one
    return "another model.compute_dtype? only float16 runs keep a loss scale"
  return "another optimizer or model code?"


def _leaf_specs(tree: Any) -> dict[str, tuple[tuple[int, ...], str]]:
  # Orbax metadata stores namedtuple fields as dict keys; path_str writes both as plain names, so paths compare.
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {path_str(path): (tuple(leaf.shape), str(leaf.dtype)) for path, leaf in leaves}


def _first_line(error: BaseException) -> str:
  text = str(error).strip().splitlines()
  return f"{type(error).__name__}: {text[0][:200] if text else ''}"


def abstract_with_shardings(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)
