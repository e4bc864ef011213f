"""train.optimizer=muon (jaxlm/training/muon.py): in every decoder family each layer's (and each expert's) weight
matrix, as its logical axis names define it, gets optax's plain 2-D Muon update, and the other leaves the run's AdamW
update; accumulated gradients on an FSDP x tensor mesh train as one device does; float16 overflow skips leave the
momentum alone; a resumed run continues bit for bit; the planner counts Muon's single moment."""

import dataclasses
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import test_loss_scale
import test_train
from flax import nnx

from jaxlm.adapters import lora
from jaxlm.config import Config, LoRAConfig, LossScaleConfig, MeshConfig, ModelConfig, TrainConfig, validate
from jaxlm.models.gpt import GPT
from jaxlm.planner import estimates
from jaxlm.training import muon, optim
from jaxlm.training import steps as steps_lib
from jaxlm.training.checkpoint import Checkpointer, abstract_with_shardings
from jaxlm.training.state import abstract_model

GPT2 = ModelConfig(vocab_size=64, num_layers=2, d_model=32, num_heads=4, d_ff=48, max_seq_len=16,
                   compute_dtype="float32")
LLAMA = dataclasses.replace(GPT2, flavour="llama", num_kv_heads=2, tie_embeddings=False)
FAMILIES = {
    "gpt2": GPT2,
    "llama": LLAMA,
    "gemma3": dataclasses.replace(LLAMA, qk_norm="head", block_norms="sandwich", norm_plus_one=True,
                                  scale_embeddings=True, glu_activation="gelu_tanh", sliding_window=5,
                                  global_attention_every=2, attention_head_dim=16),
    "moe": dataclasses.replace(LLAMA, num_experts=4, experts_per_token=2, expert_d_ff=24, shared_expert_d_ff=16),
}
MUON = TrainConfig(optimizer="muon", steps=10, warmup_steps=0, grad_clip=0.0, learning_rate=0.02, weight_decay=0.1)


def _matrix_axes(names: tuple) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
  """(batch, input, output) axes of a weight from its logical names alone: layers and experts are batch axes, and
  every block matrix reads or writes the residual stream: `embed` first is its input, `embed` last its output."""
  batch = tuple(i for i, n in enumerate(names) if n in ("layers", "experts"))
  matrix = [i for i in range(len(names)) if i not in batch]
  if names[matrix[0]] == "embed":
    return batch, tuple(matrix[:1]), tuple(matrix[1:])
  assert names[matrix[-1]] == "embed", names
  return batch, tuple(matrix[:-1]), tuple(matrix[-1:])


def _as_matrices(x: np.ndarray, axes) -> np.ndarray:
  batch, inputs, outputs = axes
  fan_in, fan_out = (math.prod(x.shape[a] for a in side) for side in (inputs, outputs))
  return np.transpose(x, batch + inputs + outputs).reshape(-1, fan_in, fan_out)


@pytest.mark.parametrize("family", FAMILIES)
def test_each_layers_matrix_gets_plain_2d_muon_and_the_rest_the_runs_adamw(family):
  """Two updates of every leaf: a `w_*` leaf's, cut into the matrices its logical axes name, are optax.contrib.muon's
  on each matrix alone (momentum, Newton-Schulz, consistent RMS, decoupled decay); every other leaf's are train.
  optimizer=adamw's, decay mask included."""
  abstract = abstract_model(lambda rngs: GPT(FAMILIES[family], rngs=rngs))[1]
  names = {}
  for path, variable in nnx.to_flat_state(abstract):
    axes, shape = variable.get_metadata()["axes"], variable.get_value().shape
    names[tuple(map(str, path))] = ("layers",) * (len(shape) - len(axes)) + tuple(axes)
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), abstract.to_pure_dict())
  grads = [jax.tree.map(lambda x: rng.normal(size=x.shape).astype(np.float32), params) for _ in range(2)]

  ours = _two_updates(_Compiled(optim.make_optimizer(MUON)), params, grads)
  adamw = _two_updates(_Compiled(optim.make_optimizer(dataclasses.replace(MUON, optimizer="adamw"))), params, grads)
  plain = _Compiled(optax.contrib.muon(optim.learning_rate_schedule(MUON), weight_decay=MUON.weight_decay,
                                       consistent_rms=0.2))
  matrices = 0
  for path, x in jax.tree_util.tree_leaves_with_path(params):
    key = tuple(k.key for k in path)
    got = [_at(u, key) for u in ours]
    if not key[-1].startswith("w_"):
      for got_u, want_u in zip(got, (_at(u, key) for u in adamw), strict=True):
        np.testing.assert_array_equal(got_u, want_u, err_msg=str(key))
      continue
    axes = _matrix_axes(names[key])
    leaf_grads = [_as_matrices(np.asarray(_at(g, key)), axes) for g in grads]
    for i, p in enumerate(_as_matrices(x, axes)):
      want = _two_updates(plain, p, [g[i] for g in leaf_grads])
      for step in range(2):
        np.testing.assert_allclose(_as_matrices(np.asarray(got[step]), axes)[i], want[step], rtol=2e-4, atol=2e-6,
                                   err_msg=f"{key} matrix {i} update {step}")
      matrices += 1
  assert matrices >= 6 * FAMILIES[family].num_layers


class _Compiled:
  """An optimizer with its update compiled once (per shape)."""

  def __init__(self, optimizer):
    self.init, self.update = optimizer.init, jax.jit(optimizer.update)


def _two_updates(optimizer: _Compiled, params, grads):
  state, updates = optimizer.init(params), []
  for g in grads:
    u, state = optimizer.update(g, state, params)
    params = optax.apply_updates(params, u)
    updates.append(u)
  return updates


def _at(tree, key):
  for k in key:
    tree = tree[k]
  return tree


def test_lora_adapters_and_heads_stay_with_adamw_and_unknown_layouts_are_one_line_errors():
  abstract = abstract_model(lambda rngs: GPT(LLAMA, rngs=rngs))[1]
  plan = lora.make_plan(abstract, LoRAConfig(rank=2))
  params = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), abstract.to_pure_dict())
  adapters = lora.init_adapters(plan, params, jax.random.key(0))
  assert set(jax.tree.leaves(muon.labels(adapters))) == {"adamw"}
  grads = jax.tree.map(jnp.ones_like, adapters)
  updates = [jax.jit(lambda o: o.update(grads, o.init(adapters), adapters)[0], static_argnums=0)(
      optim.make_optimizer(config)) for config in (MUON, dataclasses.replace(MUON, optimizer="adamw"))]
  chex.assert_trees_all_equal(*updates)
  assert muon.labels({"classifier": {"w": np.zeros((4, 2)), "b": np.zeros(2)}}) == {"classifier": {"w": "adamw",
                                                                                                    "b": "adamw"}}
  unstacked = muon.dimension_numbers((jax.tree_util.DictKey("w_o"),), (4, 8, 32))  # one layer's [H, K, D]
  assert unstacked == optax.contrib.MuonDimensionNumbers(reduction_axis=(0, 1), output_axis=(2,))
  optimizer = optim.make_optimizer(MUON)
  with pytest.raises(ValueError, match=r"no matrix layout for weight \['blocks'\]\['w_qkv'\]: add its"):
    optimizer.init({"blocks": {"w_qkv": np.zeros((2, 8, 24), np.float32)}})
  with pytest.raises(ValueError, match=r"\['w_o'\] has shape \(8, 4\), not 2 input and 1 output axes"):
    optimizer.init({"w_o": np.zeros((8, 4), np.float32)})
  with pytest.raises(ValueError, match="train.optimizer='sgd' is not one of adamw, muon; set train.optimizer=adamw"):
    validate(Config(train=TrainConfig(optimizer="sgd")))


def _muon_config(mesh=MeshConfig(data=1, fsdp=1, tensor=1), grad_accum=1):
  # Llama: no key bias, whose gradient is zero up to rounding, and which AdamW would turn into rate-sized noise.
  config = test_train._config(mesh=mesh, grad_accum=grad_accum, optimizer="muon")
  return dataclasses.replace(config, model=dataclasses.replace(config.model, flavour="llama", d_ff=128))


def _train(config, devices, steps):
  mesh, state, train_step = test_train._setup(config, devices)
  batch = steps_lib.to_global_batch(test_train._batch(8, pad_rows={1: 6, 5: 2}), mesh)
  for _ in range(steps):
    state, _ = train_step(state, batch)
  return state, lambda state: train_step(state, batch)[0]


def test_accumulated_muon_steps_on_fsdp_and_tensor_devices_equal_one_device():
  """Newton-Schulz on matrices split 2 ways over FSDP and 2 over heads/MLP (GSPMD), with 2 micro-batches."""
  one, _ = _train(_muon_config(), jax.devices()[:1], steps=3)
  sharded, _ = _train(_muon_config(MeshConfig(data=1, fsdp=2, tensor=2), grad_accum=2), jax.devices()[:4], steps=3)
  w_up = sharded["params"]["blocks"]["mlp"]["w_up"]  # [L, D, F]
  assert w_up.sharding.shard_shape(w_up.shape) == (2, 32, 64)
  chex.assert_trees_all_close(jax.device_get((sharded["params"], sharded["opt_state"])),
                              jax.device_get((one["params"], one["opt_state"])), atol=1e-5, rtol=0)


def test_a_resumed_muon_run_continues_bit_for_bit(tmp_path):
  config = _muon_config()
  state, step = _train(config, jax.devices()[:1], steps=2)
  checkpointer = Checkpointer(str(tmp_path / "ckpt"), every_steps=1, keep=1)
  checkpointer.save(2, state, {"next_index": 2}, config.model)
  checkpointer.close()
  target = abstract_with_shardings(state, jax.tree.map(lambda x: x.sharding, state))
  straight = jax.device_get(step(step(state)))
  _, restored, _ = Checkpointer(str(tmp_path / "ckpt"), 1, 1).restore_latest(target, config.model)
  resumed = jax.device_get(step(step(restored)))
  assert test_loss_scale._bitwise_equal(straight, resumed)
  assert jax.tree.leaves(resumed["opt_state"])  # the momentum is in the state that resumed


def test_float16_overflow_skips_leave_the_muon_momentum_bit_identical():
  config = test_loss_scale._config(steps=6, scale=LossScaleConfig(init=2.0**16), optimizer="muon")
  mesh, _, _, state, _, train_step = test_loss_scale._setup(config, jax.devices()[:1])
  batch = steps_lib.to_global_batch(test_loss_scale._batch(), mesh)
  skipped = []
  for _ in range(5):
    before = test_loss_scale._host((state["params"], state["opt_state"]))
    state, metrics = train_step(state, batch)
    skipped.append(bool(metrics["skipped_steps"]))
    unchanged = test_loss_scale._bitwise_equal(before, test_loss_scale._host((state["params"], state["opt_state"])))
    assert unchanged == skipped[-1], skipped
  assert skipped[0] and not all(skipped), skipped


def test_the_planner_counts_one_moment_for_muon_leaves():
  config = Config(model=GPT2, train=TrainConfig(batch_size=8))
  muon_config = dataclasses.replace(config, train=dataclasses.replace(config.train, optimizer="muon"))
  params = abstract_model(lambda rngs: GPT(GPT2, rngs=rngs))[1].to_pure_dict()
  muon_f32 = sum(4 * math.prod(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(params)
                 if muon.is_muon_leaf(p))
  saved = estimates.state_bytes(config, (1, 1, 1)).state - estimates.state_bytes(muon_config, (1, 1, 1)).state
  assert abs(saved - muon_f32) <= 64, (saved, muon_f32)  # beside a few step counters
  assert estimates.optimizer_passes(muon_config) > estimates.OPTIMIZER_PASSES
  assert estimates.optimizer_flops(muon_config, (1, 1, 1)) == 2 * estimates.optimizer_flops(muon_config, (4, 2, 1))
