"""Pipeline parallelism: 4 stages, or 2 stages x 2 data / FSDP devices, under each schedule, compute the per-step
losses and gradients of one device (with accumulation); checkpoints move between pipeline and plain layouts; the
schedules' figures; the one-line errors."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from jaxlm import config as config_lib
from jaxlm.config import Config, DataConfig, KernelsConfig, MeshConfig, ModelConfig, TrainConfig
from jaxlm.parallel import sharding
from jaxlm.recipes import pretraining
from jaxlm.training import pipeline
from jaxlm.recipes import features as features_lib
from jaxlm.training import steps as steps_lib
from jaxlm.training.checkpoint import Checkpointer, abstract_with_shardings

SEQ, BATCH, MICRO = 16, 8, 4
GPT2 = ModelConfig(vocab_size=64, num_layers=4, d_model=32, num_heads=2, max_seq_len=SEQ, compute_dtype="float32")
LLAMA = dataclasses.replace(GPT2, flavour="llama", num_kv_heads=1, tie_embeddings=False)
# The reference kernels everywhere: `auto` picks by device count, and this test compares layouts, not kernels.
KERNELS = KernelsConfig(attention="xla", matmul="xla", cross_entropy="logits", norm="xla", glu="xla",
                        fuse_qkv="separate", layers="scan", remat="none")
LEARNING_RATE = 0.5  # plain SGD: each step's update is -lr * gradient, so equal parameters mean equal gradients


def _config(model, mesh, grad_accum=MICRO):
  return Config(model=model, kernels=KERNELS, mesh=mesh, data=DataConfig(seq_len=SEQ),
                train=TrainConfig(steps=10, batch_size=BATCH, grad_accum=grad_accum, warmup_steps=0))


def _batch(seed):
  """Two packed documents per row, some rows padded: micro-batches hold different numbers of valid tokens."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, GPT2.vocab_size, size=(BATCH, SEQ + 1)).astype(np.int32)
  segments = np.ones((BATCH, SEQ), np.int32)
  segments[:, SEQ // 2:] = 2
  positions = np.concatenate([np.arange(SEQ // 2), np.arange(SEQ // 2)])[None].repeat(BATCH, 0).astype(np.int32)
  loss_mask = np.ones((BATCH, SEQ), np.float32)
  loss_mask[:, SEQ // 2 - 1] = 0.0
  segments[1, -6:], loss_mask[1, -7:] = 0, 0.0
  segments[6, -3:], loss_mask[6, -4:] = 0, 0.0
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments, "positions": positions,
          "loss_mask": loss_mask}


BATCHES = (_batch(0), _batch(1))


class Run:
  """Two SGD steps of `model` on `mesh`; keeps the compiled step, the states and the shardings for reuse.

  `start_from` (a reference Run): its initial state, laid out on this mesh with the same specs, instead of a sharded
  init of our own (one compile less; the four-stage fixture runs the sharded init on a pipeline)."""

  def __init__(self, model, mesh_config, devices=None, grad_accum=MICRO, start_from=None):
    self.config = _config(model, mesh_config, grad_accum)
    config_lib.validate(self.config)
    self.mesh = sharding.make_mesh(mesh_config, devices)
    optimizer = optax.sgd(LEARNING_RATE)
    if start_from is None:
      self.graphdef, state, self.shardings, self.features = features_lib.train_state_from_config(
          self.config, self.mesh, optimizer, features_lib.decoder_factory(self.config, self.mesh))
      self.initial_state = jax.device_get(state)
    else:  # the reference's specs name every mesh axis (all of size 1 there), so they carry over as they are
      self.graphdef = start_from.graphdef
      self.shardings = jax.tree.map(lambda s: NamedSharding(self.mesh, s.spec), start_from.shardings)
      state = jax.device_put(start_from.initial_state, self.shardings)
      self.features = features_lib.features_from_config(self.config, self.mesh,
                                                        features_lib.decoder_factory(self.config, self.mesh))
    self.train_step, _ = steps_lib.jit_steps(
        self.graphdef, optimizer, self.config, self.mesh, self.shardings, self.features)
    self.params = [jax.device_get(state["params"])]
    self.losses, self.metrics = [], []
    for batch in BATCHES:
      state, metrics = self.train_step(state, steps_lib.to_global_batch(batch, self.mesh))
      self.losses.append(float(metrics["loss"]))
      self.metrics.append(jax.device_get(metrics))
      self.params.append(jax.device_get(state["params"]))
    self.state = state


@pytest.fixture(scope="module")
def references():
  """One device, the whole batch at once (no accumulation)."""
  return {name: Run(model, MeshConfig(data=1, fsdp=1, tensor=1), jax.devices()[:1], grad_accum=1)
          for name, model in (("gpt2", GPT2), ("llama", LLAMA))}


@pytest.fixture(scope="module")
def four_stages(references):
  return Run(GPT2, MeshConfig(pipeline=4, data=1, pipeline_schedule="gpipe"))


def _assert_same_steps(run, reference):
  np.testing.assert_allclose(run.losses, reference.losses, rtol=1e-5)
  for step in (1, 2):  # gradient of each step = (params before - params after) / lr
    grads = jax.tree.map(lambda before, after: (before - after) / LEARNING_RATE, run.params[step - 1], run.params[step])
    ref = jax.tree.map(lambda before, after: (before - after) / LEARNING_RATE, reference.params[step - 1],
                       reference.params[step])
    # atol: the key biases' exact gradient is zero (a softmax ignores a constant shift), so both are rounding noise.
    jax.tree.map(lambda g, r: np.testing.assert_allclose(g, r, rtol=2e-4, atol=2e-6), grads, ref)


def test_four_stages_gpipe_gpt2_matches_one_device(references, four_stages):
  _assert_same_steps(four_stages, references["gpt2"])
  # The stacked layer axis is split over the stages: each device holds one layer of every block parameter.
  w_q = four_stages.state["params"]["blocks"]["attn"]["w_q"]
  assert w_q.shape[0] == 4 and {s.data.shape[0] for s in w_q.addressable_shards} == {1}
  assert four_stages.metrics[0]["pipeline_bubble"] == pytest.approx(3 / 7)
  facts = pipeline.report_facts(four_stages.config, four_stages.mesh, four_stages.state)
  assert facts["pipeline_bubble"] == pytest.approx(3 / 7, abs=1e-4) and facts["pipeline_kept_inputs"] == MICRO
  per_stage = [float(mib) for mib in facts["pipeline_state_mib_per_stage"].split("/")]
  whole = sum(x.nbytes for x in jax.tree.leaves(jax.device_get(four_stages.state))) / 2**20
  blocks = sum(x.nbytes for x in jax.tree.leaves(four_stages.params[-1]["blocks"])) / 2**20
  assert len(per_stage) == 4 and all(mib == pytest.approx(whole - 3 / 4 * blocks, abs=0.01) for mib in per_stage)


@pytest.mark.parametrize("name, mesh_config", [
    ("gpt2", MeshConfig(pipeline=2, data=2, pipeline_schedule="1f1b")),
    ("gpt2", MeshConfig(pipeline=2, data=1, fsdp=2, pipeline_schedule="gpipe")),
    ("llama", MeshConfig(pipeline=4, data=1, pipeline_schedule="1f1b")),
    ("llama", MeshConfig(pipeline=2, data=2, pipeline_schedule="gpipe")),
])
def test_pipeline_layouts_and_schedules_match_one_device(references, name, mesh_config):
  model = GPT2 if name == "gpt2" else LLAMA
  _assert_same_steps(Run(model, mesh_config, start_from=references[name]), references[name])


def test_a_checkpoint_moves_from_four_stages_to_one_device_and_back(tmp_path, references, four_stages):
  """Parameters keep their global shapes, so orbax reshards: restored on one device the state continues exactly as
  the pipeline does, and saved from there it restores onto the four stages again."""
  reference = references["gpt2"]
  saved = Checkpointer(str(tmp_path / "four"), every_steps=1, keep=1)
  saved.save(2, four_stages.state, {}, GPT2)
  saved.wait()
  abstract_one = abstract_with_shardings(reference.state, reference.shardings)
  one_device_state, _ = Checkpointer(str(tmp_path / "four"), 1, 1).restore(2, abstract_one, GPT2)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(one_device_state["params"]), four_stages.params[-1])

  back = Checkpointer(str(tmp_path / "one"), every_steps=1, keep=1)
  back.save(2, one_device_state, {}, GPT2)
  back.wait()
  abstract_four = abstract_with_shardings(four_stages.state, four_stages.shardings)
  four_state, _ = Checkpointer(str(tmp_path / "one"), 1, 1).restore(2, abstract_four, GPT2)
  w_in = four_state["params"]["blocks"]["mlp"]["w_in"]
  assert w_in.sharding == four_stages.shardings["params"]["blocks"]["mlp"]["w_in"]
  assert w_in.sharding.spec[0] == "pipeline"
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(four_state["params"]), four_stages.params[-1])
  batch = BATCHES[0]
  _, one_metrics = reference.train_step(one_device_state, steps_lib.to_global_batch(batch, reference.mesh))
  _, four_metrics = four_stages.train_step(four_state, steps_lib.to_global_batch(batch, four_stages.mesh))
  np.testing.assert_allclose(float(four_metrics["loss"]), float(one_metrics["loss"]), rtol=1e-5)


def test_schedule_figures():
  for stages, micro in ((4, 8), (4, 16), (2, 4)):
    for schedule in config_lib.SCHEDULES:
      assert pipeline.bubble_fraction(stages, micro, schedule) == pytest.approx((stages - 1) / (micro + stages - 1))
  assert pipeline.bubble_fraction(1, 4, "gpipe") == 0.0
  assert pipeline.stash_slots(4, 16, "gpipe") == 16 and pipeline.stash_slots(4, 16, "1f1b") == 7
  assert pipeline.stash_slots(4, 4, "1f1b") == 4
  assert config_lib.stage_layer_counts(12, 4) == (3, 3, 3, 3)
  # Every micro-batch runs forward and backward once on every stage, the backward after the forward and after
  # the next stage's backward.
  for schedule in config_lib.SCHEDULES:
    table = pipeline.make_schedule(4, 6, schedule)
    for s in range(4):
      assert sorted(table.forward[:, s][table.forward[:, s] >= 0]) == list(range(6))
      assert sorted(table.backward[:, s][table.backward[:, s] >= 0]) == list(range(6))
    tick = lambda rows, m, s: int(np.argwhere(rows[:, s] == m)[0, 0])
    for m in range(6):
      for s in range(3):
        assert tick(table.forward, m, s + 1) == tick(table.forward, m, s) + 1
        assert tick(table.backward, m, s) == tick(table.backward, m, s + 1) + 1
      assert tick(table.backward, m, 3) >= tick(table.forward, m, 3)


def _with(config, **sections):
  return {**dataclasses.asdict(config), **{k: {**dataclasses.asdict(config)[k], **v} for k, v in sections.items()}}


@pytest.mark.parametrize("sections, message", [
    ({"mesh": {"pipeline": 3}}, r"model.num_layers=4 is not divisible by mesh.pipeline=3"),
    ({"mesh": {"pipeline": 4}, "train": {"grad_accum": 2}},
     r"train.grad_accum=2 is smaller than mesh.pipeline=4; the gpipe schedule needs at least one micro-batch"),
    ({"mesh": {"pipeline": 2, "pipeline_schedule": "zero_bubble"}},
     r"mesh.pipeline_schedule='zero_bubble' is not one of gpipe, 1f1b"),
    ({"mesh": {"pipeline": 2, "tensor": 2, "data": 1}}, r"mesh.pipeline=2 with mesh.tensor=2 is not supported"),
    ({"mesh": {"pipeline": 2, "preset": "dp_tp", "data": -1}}, r"mesh.pipeline=2 with mesh.tensor=2"),
    ({"mesh": {"pipeline": 2, "sequence_parallel": True}}, r"mesh.sequence_parallel needs mesh.tensor > 1"),
    ({"mesh": {"pipeline": 2, "gradient_sync": "shard_map"}}, r"mesh.gradient_sync=shard_map does not apply"),
    ({"mesh": {"pipeline": 2}, "model": {"flavour": "bert"}}, r"serves the decoders .* not model.flavour=bert"),
    ({"mesh": {"pipeline": 2}, "lora": {"rank": 4}}, r"lora.rank=4 with mesh.pipeline=2 is not supported"),
    ({"mesh": {"pipeline": 0}}, r"mesh.pipeline=0 must be >= 1"),
])
def test_bad_pipeline_configs_are_one_line_errors(sections, message):
  raw = _with(_config(GPT2, MeshConfig()), **sections)
  with pytest.raises(ValueError, match=message) as error:
    config_lib.from_config_dict(raw)
  assert "\n" not in str(error.value)


def test_a_pipeline_that_does_not_fit_the_devices_stops_before_anything_is_written(tmp_path):
  """4 devices, 3 stages: the mesh error comes first, and the workdir's files stay."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  (workdir / "notes.txt").write_text("keep me")
  config = dataclasses.replace(_config(dataclasses.replace(GPT2, num_layers=3), MeshConfig(pipeline=3)),
                               train=TrainConfig(steps=1, batch_size=BATCH, grad_accum=3))
  with pytest.raises(ValueError, match=r"mesh.pipeline=3 does not divide the 4 devices"):
    pretraining.train(config, str(workdir))
  assert sorted(p.name for p in workdir.iterdir()) == ["notes.txt"]


def test_a_task_with_its_own_loss_is_refused_on_a_pipeline(four_stages):
  with pytest.raises(ValueError, match=r"a task with another loss \(fine-tuning\) needs mesh.pipeline=1"):
    features_lib.features_from_config(four_stages.config, four_stages.mesh, lambda rngs: None,
                                      language_model_loss=False)


def test_a_loss_scale_seeds_the_backward_and_scales_loss_and_gradients(four_stages):
  """float16 runs (jaxlm/training/loss_scale.py) get the loss and gradients times the scale, as steps.scaled_loss_fn
  gives them."""
  mesh = four_stages.mesh
  gradient_fn = pipeline.make_gradient_fn(four_stages.graphdef, mesh, MICRO, "1f1b")
  run = jax.jit(sharding.traced_on(mesh, lambda p, b, scale: gradient_fn(p, b, loss_scale=scale)))
  batch, params = steps_lib.to_global_batch(BATCHES[0], mesh), four_stages.state["params"]
  loss, _, grads, _ = jax.device_get(run(params, batch, 1.0))
  scaled_loss, _, scaled_grads, _ = jax.device_get(run(params, batch, 1024.0))
  np.testing.assert_allclose(scaled_loss, 1024.0 * loss, rtol=1e-6)
  jax.tree.map(lambda s, g: np.testing.assert_allclose(s, 1024.0 * g, rtol=1e-5, atol=1e-6), scaled_grads, grads)
