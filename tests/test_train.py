"""Train steps: loss goes down, accumulation is exact, meshes agree; the loop's resume is bit-exact for pretraining
and fine-tuning alike."""

import dataclasses
import json
import os
import signal

import chex
import jax
import numpy as np
import pytest
from conftest import write_labelled_words

from jaxlm.config import CheckpointConfig, Config, DataConfig, LogConfig, MeshConfig, ModelConfig, TrainConfig
from jaxlm.parallel import sharding
from jaxlm.recipes import classifier_finetuning, pretraining
from jaxlm.training import loop, optim
from jaxlm.recipes import features as features_lib
from jaxlm.training import steps as steps_lib
from jaxlm.training.state import check_mesh_fits_model

MODEL = ModelConfig(vocab_size=512, num_layers=2, d_model=64, num_heads=4, max_seq_len=32, compute_dtype="float32")
SEQ = 16


def _config(batch_size=8, grad_accum=1, mesh=MeshConfig(data=1, fsdp=1, tensor=1), steps=10, **train_kw):
  return Config(model=MODEL, mesh=mesh, data=DataConfig(seq_len=SEQ),
                train=TrainConfig(steps=steps, batch_size=batch_size, grad_accum=grad_accum, warmup_steps=2,
                                  learning_rate=3e-3, **train_kw))


def _batch(batch_size, seed=0, pad_rows=None):
  """A packed-looking batch; `pad_rows[i] = n` pads the last n positions of row i (segment 0, masked)."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, MODEL.vocab_size, size=(batch_size, SEQ + 1)).astype(np.int32)
  segments = np.ones((batch_size, SEQ), np.int32)
  segments[:, SEQ // 2:] = 2  # two documents per row
  positions = np.concatenate([np.arange(SEQ // 2), np.arange(SEQ - SEQ // 2)])[None].repeat(batch_size, 0)
  loss_mask = np.ones((batch_size, SEQ), np.float32)
  loss_mask[:, SEQ // 2 - 1] = 0.0  # no target across the document boundary
  for row, n in (pad_rows or {}).items():
    segments[row, SEQ - n:] = 0
    loss_mask[row, SEQ - n - 1:] = 0.0
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments,
          "positions": positions.astype(np.int32), "loss_mask": loss_mask}


def _setup(config, devices=None):
  mesh = sharding.make_mesh(config.mesh, devices)
  optimizer = optim.make_optimizer(config.train)
  graphdef, state, shardings, features = features_lib.train_state_from_config(
      config, mesh, optimizer, features_lib.decoder_factory(config, mesh))
  train_step, eval_step = steps_lib.jit_steps(graphdef, optimizer, config, mesh, shardings, features)
  _setup.graphdef = graphdef
  return mesh, state, train_step


def _gradients(state, batch):
  """Gradient of the mean token loss, computed on whatever mesh `state` and `batch` live on."""
  loss_fn = steps_lib.make_loss_fn(_setup.graphdef)
  return jax.device_get(jax.jit(lambda p, b: optim.accumulate_gradients(loss_fn, p, b, 1)[2])(state["params"], batch))


def test_a_few_steps_reduce_the_loss_on_a_fixed_batch():
  config = _config(steps=100)
  mesh, state, train_step = _setup(config, jax.devices()[:1])
  batch = steps_lib.to_global_batch(_batch(8), mesh)
  losses = []
  for _ in range(15):
    state, metrics = train_step(state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < 0.6 * losses[0], losses
  assert int(state["step"]) == 15


def test_accumulation_equals_one_large_batch_with_uneven_padding():
  """4 micro-batches holding different numbers of valid tokens give the update of the unsplit batch."""
  batch = _batch(8, pad_rows={0: 12, 4: 3, 1: 15, 6: 7})
  results = []
  for accum in (1, 4):
    config = _config(grad_accum=accum)
    mesh, state, train_step = _setup(config, jax.devices()[:1])
    new_state, metrics = train_step(state, steps_lib.to_global_batch(batch, mesh))
    results.append((jax.device_get(new_state["params"]), jax.device_get(metrics)))
  (params_1, metrics_1), (params_4, metrics_4) = results
  assert float(metrics_1["tokens"]) == float(metrics_4["tokens"])
  np.testing.assert_allclose(metrics_1["loss"], metrics_4["loss"], rtol=1e-6)
  np.testing.assert_allclose(metrics_1["grad_norm"], metrics_4["grad_norm"], rtol=1e-5)
  chex.assert_trees_all_close(params_1, params_4, rtol=1e-5, atol=1e-7)


def test_mean_of_micro_batch_means_would_differ():
  """Guards the test above: with this padding the biased MultiSteps-style average is measurably different."""
  batch = _batch(8, pad_rows={0: 12, 4: 3, 1: 15, 6: 7})
  micro = optim.split_micro_batches(batch, 4)
  counts = np.asarray(micro["loss_mask"]).sum(axis=(1, 2))
  assert len(set(counts.tolist())) > 1



def test_layer_lr_decay_scales_each_layers_update_by_its_depth():
  """train.layer_lr_decay=d: block l of L moves d^(L-1-l) as far as without it, the embeddings d^L, the head and
  LoRA adapters 1."""
  rng = np.random.default_rng(0)
  params = {"bert": {"token_embed": {"embedding": rng.normal(size=(7, 4))},
                     "blocks": {"mlp": {"w_in": rng.normal(size=(3, 4, 5)), "b_in": rng.normal(size=(3, 5))},
                                "attn": {"w_q": {"lora_a": rng.normal(size=(3, 4, 2))}}}},
            "classifier": {"w": rng.normal(size=(4, 2))}}
  grads = jax.tree.map(lambda x: np.float32(rng.normal(size=x.shape)), params)
  params = jax.tree.map(np.float32, params)

  def first_update(decay):
    optimizer = optim.make_optimizer(TrainConfig(steps=10, warmup_steps=0, layer_lr_decay=decay))
    return optimizer.update(grads, optimizer.init(params), params)[0]

  plain, decayed = first_update(1.0), first_update(0.5)
  depth = np.array([0.25, 0.5, 1.0])
  np.testing.assert_allclose(decayed["bert"]["blocks"]["mlp"]["w_in"],
                             plain["bert"]["blocks"]["mlp"]["w_in"] * depth[:, None, None], rtol=1e-6)
  np.testing.assert_allclose(decayed["bert"]["blocks"]["mlp"]["b_in"],
                             plain["bert"]["blocks"]["mlp"]["b_in"] * depth[:, None], rtol=1e-6)
  np.testing.assert_allclose(decayed["bert"]["token_embed"]["embedding"],
                             plain["bert"]["token_embed"]["embedding"] * 0.125, rtol=1e-6)
  np.testing.assert_array_equal(decayed["classifier"]["w"], plain["classifier"]["w"])
  np.testing.assert_array_equal(decayed["bert"]["blocks"]["attn"]["w_q"]["lora_a"],  # new parameters: full rate
                                plain["bert"]["blocks"]["attn"]["w_q"]["lora_a"])
  with pytest.raises(ValueError, match="train.layer_lr_decay=1.5 must be in"):
    from jaxlm import config as config_lib  # noqa: PLC0415
    config_lib.validate(Config(train=TrainConfig(layer_lr_decay=1.5)))

@pytest.mark.parametrize("mesh", [(4, 1, 1), (1, 4, 1), (2, 1, 2)])  # against the reference run on (1, 1, 1)
def test_meshes_give_the_same_loss_and_update(mesh):
  config = _config(mesh=MeshConfig(*mesh))
  devices = jax.devices()[:int(np.prod(mesh))]
  mesh_obj, state, train_step = _setup(config, devices)
  batch = steps_lib.to_global_batch(_batch(8, pad_rows={2: 5}), mesh_obj)
  grads = _gradients(state, batch)
  for _ in range(2):
    state, metrics = train_step(state, batch)
  reference = _reference_run()
  # The step-2 loss also checks that the step-1 update was the same.
  np.testing.assert_allclose(float(metrics["loss"]), reference["loss"], rtol=2e-5)
  np.testing.assert_allclose(float(metrics["grad_norm"]), reference["grad_norm"], rtol=1e-4)
  chex.assert_trees_all_close(grads, reference["grads"], rtol=1e-4, atol=1e-6)


_REFERENCE = {}


def _reference_run():
  if not _REFERENCE:
    config = _config()
    mesh, state, train_step = _setup(config, jax.devices()[:1])
    batch = steps_lib.to_global_batch(_batch(8, pad_rows={2: 5}), mesh)
    grads = _gradients(state, batch)
    for _ in range(2):
      state, metrics = train_step(state, batch)
    _REFERENCE.update({k: float(v) for k, v in jax.device_get(metrics).items()})
    _REFERENCE["grads"] = grads
  return _REFERENCE


def test_mesh_errors_are_one_line_and_actionable():
  with pytest.raises(ValueError, match="does not divide|but there are 4 devices"):
    sharding.make_mesh(MeshConfig(data=3, fsdp=1, tensor=1))
  with pytest.raises(ValueError, match="model.num_heads=2 is not divisible by mesh.tensor=4"):
    config = _config(mesh=MeshConfig(data=1, fsdp=1, tensor=4))
    check_mesh_fits_model(dataclasses.replace(MODEL, num_heads=2, d_model=64), sharding.make_mesh(config.mesh))
  chex.assert_equal(sharding.mesh_shape(MeshConfig(data=-1, fsdp=2, tensor=1), 4), (2, 2, 1))


def _write_corpus(path):
  rng = np.random.default_rng(0)
  words = ["alpha", "beta", "gamma", "delta", "return", "def", "value", "(", ")", ":", "=", "+", "1", "2"]
  with open(path, "w") as f:
    for i in range(400):
      f.write(json.dumps({"text": " ".join(rng.choice(words, size=rng.integers(5, 40)))}) + "\n")


def _file_config(tmp_path, steps):
  corpus = tmp_path / "corpus.jsonl"
  if not corpus.exists():
    _write_corpus(corpus)
  return Config(
      model=dataclasses.replace(MODEL, vocab_size=320),
      mesh=MeshConfig(data=2, fsdp=2, tensor=1),
      data=DataConfig(source="files", train_files=(str(corpus),), seq_len=SEQ, eval_fraction=0.05),
      train=TrainConfig(steps=steps, batch_size=8, warmup_steps=2, learning_rate=3e-3, eval_batches=1),
      checkpoint=CheckpointConfig(every_steps=3, keep=2),
      log=LogConfig(every_steps=1, progress_bar=False, sample_tokens=8, sample_prompt="def"),
  )


def _losses(workdir):
  with open(workdir / "metrics.jsonl") as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)}


def _classifier_config(tmp_path, steps):
  """A 1-layer BERT from scratch on labelled CSV rows, with a word-level tokenizer of the rows' words."""
  vocab_size = write_labelled_words(tmp_path, 48, 12)
  return Config(
      model=ModelConfig(flavour="bert", vocab_size=vocab_size, num_layers=1, d_model=32, num_heads=2, d_ff=64,
                        max_seq_len=16, compute_dtype="float32"),
      mesh=MeshConfig(data=4, fsdp=1, tensor=1),  # FSDP is the pretraining case's; here it only slows the CPU
      data=DataConfig(source="files", train_files=(str(tmp_path / "train.csv"),),
                      eval_files=(str(tmp_path / "eval.csv"),), tokenizer=str(tmp_path / "tokenizer.json"),
                      seq_len=16, batching="max"),
      train=TrainConfig(steps=steps, batch_size=8, warmup_steps=2, learning_rate=3e-3, eval_every_steps=4,
                        best_metric="accuracy"),
      checkpoint=CheckpointConfig(every_steps=4, keep=2), log=LogConfig(every_steps=1, progress_bar=False))


class _SigtermAt:
  """The loop's batches; a SIGTERM (what a preempted machine gets) arrives while the batch of `step` is fetched."""

  def __init__(self, batches, step):
    self.batches, self.step, self.served = batches, step, 0

  def __next__(self):
    self.served += 1
    if self.served == self.step:
      os.kill(os.getpid(), signal.SIGTERM)
    return next(self.batches)

  def get_state(self):
    return self.batches.get_state()

  def set_state(self, state):
    self.batches.set_state(state)


@pytest.mark.parametrize("kind", ["finetuning"])  # pretraining's: tests/test_reliability_soak.py, tests/test_slurm.py
def test_sigterm_then_resume_equals_uninterrupted_training_bit_for_bit(tmp_path, monkeypatch, kind):
  """Pretraining and fine-tuning share loop.run_loop: the kill (through the loop's batches) and the resume are the
  same code, so the same check holds for both; pretraining is killed at random moments in the soak test."""
  run, config = {"pretraining": (pretraining.train, _file_config(tmp_path, steps=8)),
                 "finetuning": (classifier_finetuning.finetune, _classifier_config(tmp_path, steps=8))}[kind]
  straight, resumed = tmp_path / "straight", tmp_path / "resumed"
  run(config, str(straight))

  real_loop = loop.run_loop

  def sigterm_at_step_5(config, workdir, mesh, task, *args, **kwargs):
    task.batches = _SigtermAt(task.batches, step=5)
    return real_loop(config, workdir, mesh, task, *args, **kwargs)

  with monkeypatch.context() as patch:
    patch.setattr(loop, "run_loop", sigterm_at_step_5)
    stopped = run(config, str(resumed))
  assert stopped["preempted_at_step"] == 5 and max(_losses(resumed)) == 5
  assert sorted(os.listdir(resumed / "checkpoints")) == ["4", "5"]  # the stop saved its step
  summary = run(config, str(resumed))
  expected, got = _losses(straight), _losses(resumed)
  assert sorted(got) == list(range(1, 9))
  assert got == expected  # exact float equality, step by step
  assert (resumed / "report.md").exists() and (resumed / "loss.png").exists()
  assert "auto" not in json.loads((resumed / "config.json").read_text())["kernels"].values()  # what ran
  if kind == "pretraining":
    assert summary["resumed_from_step"] == 5
  else:  # the best model and the final evaluation are those of the uninterrupted run
    again = json.loads((straight / "eval.json").read_text())
    assert summary["best_step"] == again["best_step"] and summary["eval_loss"] == again["eval_loss"]
    assert (resumed / "best_model" / "model.safetensors").exists()
