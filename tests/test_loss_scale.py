"""float16 with dynamic loss scaling (jaxlm/training/loss_scale.py): unscaled float16 gradients underflow where scaled
ones match float32; overflow skips, lowers the scale and leaves params bit-identical; growth after N good steps; the
scale is checkpointed and resumes exactly; overflow skips do not trip train.max_consecutive_nonfinite, a divergence
does; bf16 and f32 steps are the unscaled step, unchanged.

The model's small init (init_std=1e-3) makes attention scores nearly constant, so the query and key gradients are
second-order small: at scale 1 nearly all of them are below float16's smallest subnormal (2^-24) and round to zero.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxlm import kernels as kernels_lib
from jaxlm.config import (
  LOSS_SCALE_MAX,
  CheckpointConfig,
  Config,
  DataConfig,
  KernelsConfig,
  LogConfig,
  LossScaleConfig,
  MeshConfig,
  ModelConfig,
  TrainConfig,
  default_config,
  from_config_dict,
)
from jaxlm.models.gpt import GPT
from jaxlm.parallel import sharding
from jaxlm.training import loop, loss_scale, optim, reliability
from jaxlm.recipes import features as features_lib
from jaxlm.training import steps as steps_lib
from jaxlm.training.state import abstract_model
from jaxlm.training.checkpoint import Checkpointer, CheckpointMismatchError

MODEL = ModelConfig(vocab_size=320, num_layers=1, d_model=64, num_heads=4, max_seq_len=32, compute_dtype="float16",
                    init_std=1e-3)
SEQ, BATCH = 16, 8
GROWTH = 4  # growth interval of the trained run: short, so it grows within the test


def _config(model=MODEL, mesh=MeshConfig(data=1, fsdp=1, tensor=1), grad_accum=1, steps=12, scale=LossScaleConfig(),
            **train_kw):
  return Config(model=model, mesh=mesh, data=DataConfig(seq_len=SEQ), loss_scale=scale,
                train=TrainConfig(steps=steps, batch_size=BATCH, grad_accum=grad_accum, warmup_steps=1,
                                  learning_rate=3e-3, weight_decay=0.0, **train_kw))


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, MODEL.vocab_size, size=(BATCH, SEQ + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((BATCH, SEQ), np.int32),
          "positions": np.arange(SEQ, dtype=np.int32)[None].repeat(BATCH, 0),
          "loss_mask": np.ones((BATCH, SEQ), np.float32)}


def _setup(config, devices):
  mesh = sharding.make_mesh(config.mesh, devices)
  optimizer = optim.make_optimizer(config.train)
  graphdef, state, shardings, features = features_lib.train_state_from_config(
      config, mesh, optimizer, features_lib.decoder_factory(config, mesh))
  train_step, _ = steps_lib.jit_steps(graphdef, optimizer, config, mesh, shardings, features)
  return mesh, optimizer, graphdef, state, shardings, train_step


def _host(tree):
  return jax.tree.map(np.asarray, jax.device_get(tree))


def _bitwise_equal(a, b):
  return all(x.tobytes() == y.tobytes() for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


# --------------------------------------------------------------------------------------------- the update rule


def test_the_scale_falls_on_overflow_grows_after_n_good_steps_and_stays_within_floor_and_ceiling():
  rule = loss_scale.DynamicLossScale(initial_scale=8.0, growth_interval=2, factor=2.0, min_scale=2.0)
  finite, inf = jnp.float32(1.0), jnp.float32(jnp.inf)
  state, update = rule.init(), jax.jit(rule.update)

  def step(state, loss, grad_norm, applied):
    state, metrics = update(state, loss, grad_norm, jnp.asarray(applied))
    return state, float(state["scale"]), int(state["good_steps"]), float(metrics["overflow_steps"])

  state, scale, good, overflow = step(state, finite, finite, True)
  assert (scale, good, overflow) == (8.0, 1, 0.0)
  state, scale, good, overflow = step(state, finite, finite, True)  # the 2nd good step in a row: growth
  assert (scale, good, overflow) == (16.0, 0, 0.0)
  state, scale, good, overflow = step(state, finite, finite, True)
  state, scale, good, overflow = step(state, finite, inf, False)  # gradient overflow: halve, restart the count
  assert (scale, good, overflow) == (8.0, 0, 1.0)
  state, scale, good, overflow = step(state, finite, finite, True)
  state, scale, good, overflow = step(state, jnp.float32(jnp.nan), inf, False)  # a NaN loss: not the scale's doing
  assert (scale, good, overflow) == (8.0, 1, 0.0)
  state, *_ = step(state, finite, inf, False)
  state, scale, good, overflow = step(state, finite, inf, False)  # reaches the floor: still an overflow skip
  assert (scale, overflow) == (2.0, 1.0)
  state, scale, good, overflow = step(state, finite, inf, False)  # at the floor: left to the non-finite count
  assert (scale, overflow) == (2.0, 0.0)
  assert int(state["overflow_steps"]) == 3

  ceiling = dataclasses.replace(rule, initial_scale=LOSS_SCALE_MAX, growth_interval=1)
  assert float(ceiling.update(ceiling.init(), finite, finite, jnp.asarray(True))[0]["scale"]) == LOSS_SCALE_MAX


def test_loss_scale_keys_are_validated_with_one_line_errors():
  for key, value, message in (("factor", 1.0, r"loss_scale.factor=1.0 must be > 1"),
                              ("growth_interval", 0, r"loss_scale.growth_interval=0 must be >= 1"),
                              ("min", 0.0, r"loss_scale.min=0.0 must be > 0"),
                              ("init", 2.0**30, r"loss_scale.init=1073741824.0 .* <= 1.67772e\+07")):
    config = default_config()
    config.loss_scale[key] = value
    with pytest.raises(ValueError, match=message):
      from_config_dict(config)


# --------------------------------------------------------------------------------------------- kernels for float16


def test_auto_kernels_route_float16_on_the_cpu_and_impossible_choices_fail_clearly():
  kernels = kernels_lib.resolve(KernelsConfig(), compute_dtype="float16", head_dim=16, platform="cpu", devices=1)
  # The C++ CPU kernels compute in float32 only: auto falls back to the XLA paths that take float16.
  assert (kernels.attention, kernels.matmul, kernels.cross_entropy) == ("causal_blocks", "xla", "chunked")
  for key, name in (("attention", "cpu_fused"), ("matmul", "blas")):
    with pytest.raises(ValueError, match=rf"kernels.{key}={name} computes in float32, not model.compute_dtype=float16"):
      kernels_lib.resolve(KernelsConfig(**{key: name}), compute_dtype="float16", platform="cpu", devices=1)


# --------------------------------------------------------------------------------------------- underflow


@pytest.fixture(scope="module")
def float32():
  """The float32 run's set-up, its initial state on the host, and the unscaled step written out from its parts
  (gradients, optimizer update, apply), compiled once."""
  config = _config(model=dataclasses.replace(MODEL, compute_dtype="float32"), steps=3)
  mesh, optimizer, graphdef, state, shardings, train_step = _setup(config, jax.devices()[:1])
  gradient_fn = steps_lib.make_gradient_fn(steps_lib.make_loss_fn(graphdef), 1, mesh)

  @jax.jit
  def reference(params, opt_state, batch):
    loss, _, grads, _ = gradient_fn(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return loss, grads, optax.apply_updates(params, updates), opt_state

  return {"mesh": mesh, "state": state, "initial": _host(state), "train_step": train_step, "reference": reference}


# --------------------------------------------------------------------------------------------- underflow


def test_unscaled_float16_gradients_underflow_to_zero_and_scaled_ones_match_float32(float32):
  initial = float32["initial"]
  batch = steps_lib.to_global_batch(_batch(), float32["mesh"])
  loss32, g32, *_ = _host(float32["reference"](initial["params"], initial["opt_state"], batch))
  # The same float32 master weights, computed in float16 with the kernels `auto` picks for it.
  kernels = kernels_lib.resolve(compute_dtype="float16", head_dim=MODEL.head_dim, devices=1)
  graphdef, _ = abstract_model(lambda rngs: GPT(MODEL, kernels=kernels, rngs=rngs))

  @jax.jit
  def float16_gradients(params, batch, scale):  # scale 1.0 is the unscaled step exactly (x * 1.0 == x)
    loss_fn = steps_lib.scaled_loss_fn(steps_lib.make_loss_fn(graphdef), scale)
    loss, _, grads, _ = optim.accumulate_gradients(loss_fn, params, batch, 1)
    return loss / scale, jax.tree.map(lambda g: g / scale, grads)

  (loss16, g16), (loss16_scaled, g16_scaled) = (
      _host(float16_gradients(initial["params"], batch, jnp.float32(s))) for s in (1.0, 1024.0))
  np.testing.assert_allclose([loss16, loss16_scaled], loss32, rtol=1e-4)
  error = lambda g, reference: np.linalg.norm(g - reference) / np.linalg.norm(reference)
  for name in ("w_q", "w_k"):
    reference, unscaled, scaled = (g["blocks"]["attn"][name] for g in (g32, g16, g16_scaled))
    assert np.all(reference != 0)
    # Unscaled: nearly every entry rounds to exactly zero (the rest are subnormal), the gradient is lost.
    assert np.mean(unscaled == 0) > 0.95 and error(unscaled, reference) > 0.9, f"float16 {name} should underflow"
    assert np.mean(scaled == 0) < 0.01 and error(scaled, reference) < 0.03
  # Where nothing underflows, the scaled gradients are as accurate as the float16 ones at scale 1.
  for a, b, c in zip(jax.tree.leaves(g16_scaled["blocks"]["mlp"]), jax.tree.leaves(g16["blocks"]["mlp"]),
                     jax.tree.leaves(g32["blocks"]["mlp"]), strict=True):
    assert np.linalg.norm(a - c) <= 2 * np.linalg.norm(b - c) + 1e-9


# --------------------------------------------------------------------------------------------- bf16/f32 unchanged


UNSCALED_METRICS = {"loss", "token_accuracy", "tokens", "grad_norm", "update_norm", "param_norm", "learning_rate",
                    "skipped_steps"}


def test_float32_and_bfloat16_steps_are_the_unscaled_step_unchanged(float32):
  state, mesh = float32["state"], float32["mesh"]
  assert set(state) == {"step", "params", "opt_state"}  # no loss-scale state
  for dtype in ("bfloat16", "float32"):  # both take the unscaled step (no state entry) and keep their state
    config = _config(model=dataclasses.replace(MODEL, compute_dtype=dtype))
    assert loss_scale.from_config(config) is None
    assert features_lib.features_from_config(config, mesh, lambda rngs: None).entries == ()
  params, opt_state = float32["initial"]["params"], float32["initial"]["opt_state"]
  for i in range(3):
    batch = steps_lib.to_global_batch(_batch(seed=i), mesh)
    state, metrics = float32["train_step"](state, batch)
    loss, _, params, opt_state = float32["reference"](params, opt_state, batch)
    assert set(metrics) == UNSCALED_METRICS
    assert np.asarray(metrics["loss"]).tobytes() == np.asarray(loss).tobytes()
  assert set(state) == {"step", "params", "opt_state"}
  assert _bitwise_equal(_host((state["params"], state["opt_state"])), _host((params, opt_state)))


# --------------------------------------------------------------------------------------------- a float16 run


@pytest.fixture(scope="module")
def trained():
  """16 float16 steps from scale 2^18 (the first steps overflow) with growth every 4 good steps, on 2 data devices
  with 2 micro-batches (the shard_map gradient path); the host copy of each state along the way."""
  config = _config(mesh=MeshConfig(data=2, fsdp=1, tensor=1), grad_accum=2, steps=16,
                   scale=LossScaleConfig(init=2.0**18, growth_interval=GROWTH))
  mesh, optimizer, graphdef, state, shardings, train_step = _setup(config, jax.devices()[:2])
  states, metrics = [_host(state)], []
  batch = steps_lib.to_global_batch(_batch(), mesh)  # one batch throughout: its loss must fall
  for _ in range(config.train.steps):
    state, m = train_step(state, batch)
    states.append(_host(state))
    metrics.append(_host(m))
  return {"config": config, "mesh": mesh, "shardings": shardings, "train_step": train_step, "states": states,
          "metrics": metrics}


def test_loss_scaled_float16_trains_and_overflow_skips_leave_params_bit_identical(trained):
  states, metrics = trained["states"], trained["metrics"]
  overflow = [bool(m["overflow_steps"]) for m in metrics]
  assert overflow[:3] == [True] * 3, "scale 2^18 should overflow this model's float16 backward at first"
  assert not all(overflow)
  for i, m in enumerate(metrics):
    assert bool(m["skipped_steps"]) == overflow[i]
    before, after = states[i], states[i + 1]
    if overflow[i]:  # skipped: params and optimizer state bit for bit, the scale halved
      assert _bitwise_equal((before["params"], before["opt_state"]), (after["params"], after["opt_state"]))
      assert after["loss_scale"]["scale"] == before["loss_scale"]["scale"] / 2
  assert int(states[-1]["loss_scale"]["overflow_steps"]) == sum(overflow) == metrics[-1]["overflow_steps_total"]

  losses = [float(m["loss"]) for m in metrics]
  assert losses[-1] < losses[0] - 0.1
  # With no weight decay only a gradient moves a weight: the attention queries, whose unscaled gradient is zero, do.
  w_q = [s["params"]["blocks"]["attn"]["w_q"] for s in (states[0], states[-1])]
  assert np.abs(w_q[1] - w_q[0]).max() > 1e-4


def test_the_scale_grows_after_n_good_steps_as_the_rule_says(trained):
  scale, good = float(trained["states"][0]["loss_scale"]["scale"]), 0
  grew = False
  for m in trained["metrics"]:
    if m["overflow_steps"]:
      scale, good = scale / 2, 0
    else:
      good += 1
      if good == GROWTH:
        scale, good, grew = scale * 2, 0, True
    assert float(m["loss_scale"]) == scale
  assert grew, "the run should have had 4 good steps in a row"


# --------------------------------------------------------------------------------------------- the loop


class _Batches:
  """The fixture's batch at every step, resumable; the given steps get a NaN loss mask: a non-finite loss, i.e. a
  real divergence rather than an overflow."""

  def __init__(self, poisoned=()):
    self.served, self.poisoned = 0, set(poisoned)

  def __iter__(self):
    return self

  def __next__(self):
    batch = _batch()
    self.served += 1
    if self.served in self.poisoned:
      batch = dict(batch, loss_mask=batch["loss_mask"] * np.float32(np.nan))
    return batch

  def get_state(self):
    return {"served": self.served}

  def set_state(self, state):
    self.served = state["served"]


def _run_loop(trained, workdir, steps, poisoned=(), stop_at_step=None, max_consecutive_nonfinite=5):
  """jaxlm.training.loop.run_loop on the fixture's compiled float16 step from its initial state; the metrics.jsonl
  lines."""
  config = dataclasses.replace(
      trained["config"], train=dataclasses.replace(trained["config"].train, steps=steps,
                                                   max_consecutive_nonfinite=max_consecutive_nonfinite),
      checkpoint=CheckpointConfig(every_steps=100, keep=2), log=LogConfig(every_steps=1, progress_bar=False))
  task = loop.Task(
      title="fp16 run", state=jax.device_put(trained["states"][0], trained["shardings"]),
      state_shardings=trained["shardings"], train_step=trained["train_step"], batches=_Batches(poisoned),
      count=lambda batch: {"tokens": batch["loss_mask"].size}, evaluate=lambda step, params: {},
      finish=lambda end: loop.Report(summary=end.last),
      features=features_lib.features_from_config(config, trained["mesh"], lambda rngs: None))
  with reliability.StopSignals(announce=False) as stop:
    loop.run_loop(config, str(workdir), trained["mesh"], task, stop, stop_at_step=stop_at_step)
  return [json.loads(line) for line in open(workdir / "metrics.jsonl")]


def test_overflow_skips_do_not_trip_max_consecutive_nonfinite_but_a_divergence_does(trained, tmp_path):
  """The run's first 3 steps overflow in a row, more than max_consecutive_nonfinite=2: it goes on. Two NaN-loss
  steps in a row (9 and 10) stop it."""
  with pytest.raises(reliability.NonFiniteError, match=r"2 consecutive non-finite steps \(9 to 10"):
    _run_loop(trained, tmp_path / "run", steps=12, poisoned={9, 10}, max_consecutive_nonfinite=2)
  lines = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  assert [line["step"] for line in lines] == list(range(1, 11))
  overflows = [line["overflow_steps"] for line in lines]
  assert overflows[:3] == [1, 1, 1] and overflows[8:] == [0, 0]
  assert [line["skipped_steps"] for line in lines][8:] == [1, 1]
  assert lines[-1]["overflow_steps_total"] == sum(overflows)
  assert lines[-1]["skipped_steps_total"] == sum(overflows) + 2  # every skip, of either kind
  assert [line["loss_scale"] for line in lines[:3]] == [2.0**17, 2.0**16, 2.0**15]


def test_the_scale_is_checkpointed_and_a_resumed_run_continues_bit_for_bit(trained, tmp_path):
  first = _run_loop(trained, tmp_path / "run", steps=8, stop_at_step=5)
  resumed = _run_loop(trained, tmp_path / "run", steps=8)  # restores step 5's checkpoint, scale state included
  assert [line["step"] for line in first] == [1, 2, 3, 4, 5] and [line["step"] for line in resumed] == list(range(1, 9))
  # The uninterrupted run: the fixture's steps (the same compiled step, initial state and batch).
  keys = ("loss", "grad_norm", "loss_scale", "overflow_steps", "overflow_steps_total")
  uninterrupted = [[float(m[k]) if np.isfinite(m[k]) else None for k in keys]  # metrics.jsonl writes inf as null
                   for m in trained["metrics"][:8]]
  assert [[line[k] for k in keys] for line in resumed] == uninterrupted
  assert resumed[4]["loss_scale"] != trained["config"].loss_scale.init  # step 5's scale was restored, not reset


def test_resuming_across_compute_dtypes_names_the_loss_scale(tmp_path):
  state = {"step": jnp.zeros((), jnp.int32), "params": {"w": jnp.ones(2)}}
  checkpointer = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=1)
  checkpointer.save(1, state, {"position": 0}, MODEL)
  checkpointer.close()
  float16_state = {**state, "loss_scale": loss_scale.from_config(_config()).init()}
  one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one_device), float16_state)
  with pytest.raises(CheckpointMismatchError, match=r"no array at loss_scale/.*another model.compute_dtype"):
    Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=1).restore_latest(abstract, MODEL)


def test_the_chunked_cross_entropy_keeps_its_saved_float16_gradients_for_the_loss_scale():
  """The fused kernel computes its gradients in the forward pass, at scale 1: saved in float16 they would flush to
  zero before the backward pass scales them. They are saved in float32, so scaling rescues them as on the logits
  path."""
  from jaxlm.kernels import cross_entropy, xla

  rng = np.random.default_rng(0)
  x = rng.normal(size=(256, 64)).astype(np.float32)
  table = (rng.normal(size=(320, 64)) * 1e-6).astype(np.float32)  # tiny outputs: d(loss)/dx near 2^-24
  targets, weights = rng.integers(0, 320, size=256).astype(np.int32), np.ones(256, np.float32)

  def dx(cross_entropy_sums, dtype, scales):
    loss = lambda x, scale: cross_entropy_sums(x.astype(dtype), table.astype(dtype), targets, weights)[0] * scale
    gradient = jax.jit(jax.grad(loss))
    return [np.asarray(gradient(x, jnp.float32(scale))) / scale for scale in scales]

  [reference] = dx(xla.cross_entropy_sums, jnp.float32, [1.0])
  unscaled, scaled = dx(lambda *args: cross_entropy.fused_cross_entropy(*args, chunk=64), jnp.float16, [1.0, 1024.0])
  assert np.mean((unscaled == 0) & (reference != 0)) > 0.01  # unscaled: underflow
  assert not np.any((scaled == 0) & (reference != 0))
  error = lambda g: np.linalg.norm(g - reference) / np.linalg.norm(reference)
  [logits_path] = dx(xla.cross_entropy_sums, jnp.float16, [1024.0])
  assert error(scaled) <= 1.01 * error(logits_path)
