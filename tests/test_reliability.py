"""Reliability: preemption signals, non-finite steps, checkpoint checks and fallbacks, restore on fewer devices.

One in-process training run covers the non-finite skip, its count and the stop; the checkpoint tests use small
pytrees, so they compile almost nothing. Kills of real runs are in tests/test_reliability_soak.py.
"""

import json
import os
import re
import shutil
import signal

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlm import data as data_lib
from jaxlm.config import CheckpointConfig, Config, DataConfig, LogConfig, MeshConfig, ModelConfig, TrainConfig
from jaxlm.parallel import sharding
from jaxlm.recipes import pretraining
from jaxlm.training import optim, reliability
from jaxlm.recipes import features as features_lib
from jaxlm.training.checkpoint import Checkpointer, CheckpointMismatchError, abstract_with_shardings

MODEL = ModelConfig(vocab_size=320, num_layers=2, d_model=64, num_heads=4, max_seq_len=32, compute_dtype="float32")


# --------------------------------------------------------------------------------------------- preemption signals


def test_first_signal_sets_the_flag_second_interrupts_and_handlers_are_restored():
  previous = signal.getsignal(signal.SIGTERM)
  with reliability.StopSignals(announce=False) as stop:
    assert not stop.requested
    os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread before the next bytecode
    assert stop.requested and stop.signal_name == "SIGTERM"
    assert reliability.should_stop(stop.requested, step=7)
    with pytest.raises(KeyboardInterrupt, match="second stop signal"):
      os.kill(os.getpid(), signal.SIGINT)
  assert signal.getsignal(signal.SIGTERM) is previous


def test_a_notice_signal_stops_but_never_counts_as_the_second_signal():
  """SIGUSR1 (what launch/slurm.sbatch and launch/local.sh pass on) beside the SIGTERM of the same preemption, in
  either order, is one stop request; only a second SIGTERM/SIGINT interrupts."""
  previous = signal.getsignal(signal.SIGUSR1)
  for first, second in ((signal.SIGUSR1, signal.SIGTERM), (signal.SIGTERM, signal.SIGUSR1)):
    with reliability.StopSignals(announce=False) as stop:
      os.kill(os.getpid(), first)
      os.kill(os.getpid(), signal.SIGUSR1)
      os.kill(os.getpid(), second)
      assert stop.requested and stop.signal_name == signal.Signals(first).name
      with pytest.raises(KeyboardInterrupt, match="second stop signal"):
        os.kill(os.getpid(), signal.SIGINT)
  assert signal.getsignal(signal.SIGUSR1) is previous


def test_multi_process_stop_agreement_runs_every_n_steps():
  # The collective path (an all-gather of the flags) on one process: only every `every` steps, then the OR.
  assert not reliability.should_stop(True, step=3, collective=True, every=10)
  assert reliability.should_stop(True, step=10, collective=True, every=10)
  assert not reliability.should_stop(False, step=10, collective=True, every=10)


# --------------------------------------------------------------------------------------------- non-finite steps


class _PoisonedIterator:
  """Wraps the train iterator; the batches of the given steps get NaN or inf in their loss mask."""

  def __init__(self, iterator, poison: dict[int, float]):
    self.iterator, self.poison, self.served = iterator, poison, 0

  def __iter__(self):
    return self

  def __next__(self):
    batch = next(self.iterator)
    self.served += 1
    if self.served in self.poison:
      with np.errstate(invalid="ignore"):  # inf * 0 on padding is NaN, as intended
        batch = dict(batch, loss_mask=batch["loss_mask"] * np.float32(self.poison[self.served]))
    return batch

  def get_state(self):
    return self.iterator.get_state()

  def set_state(self, state):
    self.iterator.set_state(state)


def _write_corpus(path):
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "delta", "return", "def", "value", "(", ")", ":", "=", "+", "1", "2"]
  with open(path, "w") as f:
    for _ in range(300):
      f.write(json.dumps({"text": " ".join(rng.choice(words, size=rng.integers(5, 40)))}) + "\n")


def _run_config(tmp_path, steps, **train_kw):
  corpus = tmp_path / "corpus.jsonl"
  _write_corpus(corpus)
  return Config(
      model=MODEL, mesh=MeshConfig(data=2, fsdp=2, tensor=1),
      data=DataConfig(source="files", train_files=(str(corpus),), seq_len=16, eval_fraction=0.05),
      train=TrainConfig(steps=steps, batch_size=8, warmup_steps=2, learning_rate=3e-3, eval_batches=1, **train_kw),
      checkpoint=CheckpointConfig(every_steps=1, keep=20),
      log=LogConfig(every_steps=1, progress_bar=False, sample_tokens=0))


def test_nonfinite_steps_are_skipped_bit_for_bit_counted_and_stop_the_run(tmp_path, monkeypatch):
  """Step 3 (NaN) is skipped alone; steps 5 (inf) and 6 (NaN) make 2 in a row, which stops the run at step 6."""
  make_iterator = data_lib.make_pretraining_batches
  monkeypatch.setattr(data_lib, "make_pretraining_batches",
                      lambda *a, **k: _PoisonedIterator(make_iterator(*a, **k), {3: np.nan, 5: np.inf, 6: np.nan}))
  config = _run_config(tmp_path, steps=9, max_consecutive_nonfinite=2)
  workdir = tmp_path / "run"
  with pytest.raises(reliability.NonFiniteError, match=r"2 consecutive non-finite steps \(5 to 6.*stopped at step 6"):
    pretraining.train(config, str(workdir))

  lines = {r["step"]: r for r in map(json.loads, open(workdir / "metrics.jsonl"))}
  assert sorted(lines) == [1, 2, 3, 4, 5, 6]
  assert [lines[s]["skipped_steps"] for s in range(1, 7)] == [0, 0, 1, 0, 1, 1]
  assert [lines[s]["skipped_steps_total"] for s in range(1, 7)] == [0, 0, 1, 1, 2, 3]
  assert lines[3]["loss"] is None and np.isfinite(lines[4]["loss"])  # NaN is written as null

  # Every step was checkpointed: a skipped step leaves params and optimizer state bit-identical.
  manager = ocp.CheckpointManager(str(workdir / "checkpoints"),
                                  item_handlers={"state": ocp.StandardCheckpointHandler()})
  assert manager.all_steps() == [1, 2, 3, 4, 5, 6]  # nothing after the stop
  states = {s: manager.restore(s, args=ocp.args.Composite(state=ocp.args.StandardRestore()))["state"]
            for s in (2, 3, 4, 6)}
  host = {s: jax.device_get({"params": v["params"], "opt_state": v["opt_state"]}) for s, v in states.items()}
  for before, after in ((2, 3), (4, 6)):
    for a, b in zip(jax.tree.leaves(host[before]), jax.tree.leaves(host[after]), strict=True):
      assert a.tobytes() == b.tobytes()
  assert not all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(host[3]), jax.tree.leaves(host[4])))
  assert int(states[6]["step"]) == 6  # the step counter counts batches, skipped or not


def test_a_nonfinite_state_is_never_saved(tmp_path):
  state = {"step": jnp.zeros((), jnp.int32), "params": {"w": jnp.array([1.0, jnp.nan]), "b": jnp.ones(2)}}
  checkpointer = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=2)
  with pytest.raises(reliability.NonFiniteError, match=r"step 4 holds non-finite values \(first at params/w\)"):
    checkpointer.save(4, state, {"next_index": 4}, MODEL)
  checkpointer.close()
  assert os.listdir(tmp_path / "ckpt") == []


# --------------------------------------------------------------------------------------------- checkpoints


def _tiny_state(scale=1.0, shape=(4, 8), dtype=jnp.float32):
  return {"step": jnp.array(3, jnp.int32),
          "params": {"w": jnp.arange(np.prod(shape), dtype=dtype).reshape(shape) * scale, "b": jnp.ones(8, dtype)},
          "opt_state": (jnp.zeros(shape, dtype), jnp.array(0, jnp.int32))}


def _abstract(state):
  one = NamedSharding(sharding.make_mesh(MeshConfig(1, 1, 1), jax.devices()[:1]), P())
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), state)


def _saved(tmp_path, steps=(2, 4), state=None):
  checkpointer = Checkpointer(str(tmp_path / "ckpt"), every_steps=2, keep=5)
  for step in steps:
    checkpointer.save(step, state or _tiny_state(scale=step), {"next_index": step}, MODEL)
  checkpointer.close()
  return Checkpointer(str(tmp_path / "ckpt"), every_steps=2, keep=5)


def test_a_save_killed_midway_is_ignored_and_cleaned_up(tmp_path):
  checkpointer = _saved(tmp_path)
  # What a kill -9 during the save of step 6 leaves: orbax's temporary folder, never renamed to 6/.
  shutil.copytree(tmp_path / "ckpt" / "4", tmp_path / "ckpt" / "6.orbax-checkpoint-tmp-1700000000")
  checkpointer = Checkpointer(str(tmp_path / "ckpt"), every_steps=2, keep=5)
  assert checkpointer.latest_step() == 4
  step, state, data_state = checkpointer.restore_latest(_abstract(_tiny_state()), MODEL)
  assert step == 4 and data_state == {"next_index": 4}
  np.testing.assert_array_equal(state["params"]["w"], _tiny_state(scale=4)["params"]["w"])
  checkpointer.save(6, _tiny_state(scale=6), {"next_index": 6}, MODEL)  # the step can be saved again
  checkpointer.close()
  assert sorted(os.listdir(tmp_path / "ckpt")) == ["2", "4", "6"]  # the leftover was deleted at start-up


@pytest.mark.parametrize("damage", ["truncate_array_data", "truncate_tree_metadata", "delete_state"])
def test_a_truncated_checkpoint_falls_back_to_the_previous_one(tmp_path, damage, capfd):
  checkpointer = _saved(tmp_path)
  folder = tmp_path / "ckpt" / "4" / "state"
  if damage == "delete_state":
    shutil.rmtree(folder)
  else:
    files = [os.path.join(d, f) for d, _, fs in os.walk(folder) for f in fs]
    path = (max(files, key=os.path.getsize) if damage == "truncate_array_data" else str(folder / "_METADATA"))
    os.truncate(path, os.path.getsize(path) // 2)
  step, state, data_state = checkpointer.restore_latest(_abstract(_tiny_state()), MODEL)
  assert step == 2 and data_state == {"next_index": 2}
  np.testing.assert_array_equal(state["params"]["w"], _tiny_state(scale=2)["params"]["w"])
  assert re.search(r"checkpoint .*/4 is unreadable .* moved it to .*/4\.corrupt-\d+", capfd.readouterr().err)
  assert checkpointer.all_steps() == [2]


def test_no_readable_checkpoint_is_an_error_naming_the_steps(tmp_path):
  checkpointer = _saved(tmp_path, steps=(4,))
  os.truncate(tmp_path / "ckpt" / "4" / "state" / "_METADATA", 10)
  with pytest.raises(ValueError, match=r"no readable checkpoint in .*: steps \[4\] are truncated or corrupted"):
    checkpointer.restore_latest(_abstract(_tiny_state()), MODEL)


@pytest.mark.parametrize("target, message", [
    (lambda s: {**s, "params": {**s["params"], "w": jnp.zeros((4, 9))}},
     r"holds params/w with shape \(4, 8\) but this run expects \(4, 9\)"),
    (lambda s: {**s, "params": {**s["params"], "w": s["params"]["w"].astype(jnp.bfloat16)}},
     r"holds params/w as float32 but this run expects bfloat16"),
    (lambda s: {**s, "params": {**s["params"], "extra": jnp.ones(3)}}, r"has no array at params/extra"),
    (lambda s: {**s, "opt_state": (s["opt_state"][0],)}, r"holds opt_state/1, which this run does not have"),
], ids=["shape", "dtype", "missing", "extra"])
def test_a_tree_mismatch_names_the_first_mismatched_path(tmp_path, target, message):
  checkpointer = _saved(tmp_path, steps=(2,))
  with pytest.raises(CheckpointMismatchError, match=message):
    checkpointer.restore_latest(_abstract(target(_tiny_state())), MODEL)
  assert checkpointer.all_steps() == [2]  # a mismatch is not corruption: nothing is moved aside


def test_restore_onto_fewer_devices_is_bit_identical(tmp_path):
  """Saved from a 2x2 (data x fsdp) mesh of 4 devices, restored onto 2 devices and onto 1."""
  config = Config(model=MODEL, mesh=MeshConfig(data=2, fsdp=2, tensor=1), train=TrainConfig(batch_size=8))
  optimizer = optim.make_optimizer(config.train)
  _, state, shardings, features = features_lib.train_state_from_config(
      config, sharding.make_mesh(config.mesh), optimizer,
      features_lib.decoder_factory(config, sharding.make_mesh(config.mesh)))
  saved = jax.device_get(state)
  checkpointer = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=2)
  checkpointer.save(1, state, {"next_index": 1}, MODEL)
  checkpointer.close()
  for mesh_config, devices in ((MeshConfig(data=1, fsdp=2, tensor=1), jax.devices()[2:4]),
                               (MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[1:2])):
    mesh = sharding.make_mesh(mesh_config, devices)
    target = abstract_with_shardings(state, jax.tree.map(lambda s: NamedSharding(mesh, s.spec), shardings))
    step, restored, _ = Checkpointer(str(tmp_path / "ckpt"), 1, 2).restore_latest(target, MODEL)
    assert step == 1
    for leaf in jax.tree.leaves(restored):
      assert leaf.sharding.device_set == set(devices)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(jax.device_get(restored)), strict=True):
      assert a.dtype == b.dtype and a.tobytes() == b.tobytes()


def test_result_files_are_replaced_whole_or_not_at_all(tmp_path):
  from jaxlm.training import atomic_files  # noqa: PLC0415
  path = str(tmp_path / "plan.json")
  atomic_files.write_json(path, {"step_sec": 1.5})
  with pytest.raises(TypeError):
    atomic_files.write_json(path, {"step_sec": object()})  # fails while serialising: the old file must survive
  assert json.loads(open(path).read()) == {"step_sec": 1.5}
  assert sorted(os.listdir(tmp_path)) == ["plan.json"]
