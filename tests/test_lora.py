"""LoRA and QLoRA (jaxlm/adapters/lora.py): zero-B adapters are the base model, the adapters' own backward equals
autodiff, the frozen base stays bit-identical and out of the optimizer, a step on a sharded mesh with accumulation
equals the single-device unaccumulated one, merging equals base + adapters, QLoRA's state is small, resume is exact,
and bad input is a one-line error."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import write_labelled_words
from flax import nnx

from jaxlm.adapters import lora, nf4
from jaxlm.compress import int8
from jaxlm.config import (
  CheckpointConfig,
  Config,
  DataConfig,
  LogConfig,
  LoRAConfig,
  MeshConfig,
  ModelConfig,
  TrainConfig,
  default_config,
  from_config_dict,
)
from jaxlm.kernels import Kernels
from jaxlm.models.bert import BertForSequenceClassification
from jaxlm.models.gpt import GPT
from jaxlm.parallel import sharding
from jaxlm.recipes import classifier_finetuning
from jaxlm.training import optim
from jaxlm.recipes import features as features_lib
from jaxlm.training import steps as steps_lib
from jaxlm.training.state import Features, abstract_model, init_train_state
from jaxlm.training.checkpoint import Checkpointer, abstract_with_shardings

SEQ = 16
GPT2 = ModelConfig(vocab_size=128, num_layers=2, d_model=64, num_heads=4, max_seq_len=32, compute_dtype="float32")
LLAMA = dataclasses.replace(GPT2, flavour="llama", d_model=128, num_kv_heads=2, d_ff=256, tie_embeddings=False)


def _config(model=GPT2, mesh=MeshConfig(data=1, fsdp=1, tensor=1), grad_accum=1, **lora_kw):
  return Config(model=model, mesh=mesh, data=DataConfig(seq_len=SEQ), lora=LoRAConfig(**{"rank": 4, **lora_kw}),
                train=TrainConfig(steps=4, batch_size=8, grad_accum=grad_accum, warmup_steps=0, learning_rate=1e-2))


def _batch(batch_size=8, seed=0, vocab=128):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, size=(batch_size, SEQ + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((batch_size, SEQ), np.int32),
          "positions": np.tile(np.arange(SEQ, dtype=np.int32), (batch_size, 1)),
          "loss_mask": np.ones((batch_size, SEQ), np.float32)}


def _setup(config, devices=None):
  mesh = sharding.make_mesh(config.mesh, devices)
  optimizer = optim.make_optimizer(config.train)
  graphdef, state, shardings, features = features_lib.train_state_from_config(
      config, mesh, optimizer, features_lib.decoder_factory(config, mesh, Kernels()))
  train_step, _ = steps_lib.jit_steps(graphdef, optimizer, config, mesh, shardings, features)
  return mesh, graphdef, state, train_step


@pytest.fixture(scope="module")
def trained():
  """Three QLoRA (int8 base) steps of a GPT-2 on an FSDP x tensor mesh with 2 micro-batches."""
  config = _config(mesh=MeshConfig(data=1, fsdp=2, tensor=2), grad_accum=2, base="int8")
  mesh, graphdef, state, train_step = _setup(config)
  before = jax.device_get(state)
  losses = []
  for _ in range(3):
    state, metrics = train_step(state, steps_lib.to_global_batch(_batch(), mesh))
    losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
  return config, mesh, graphdef, before, state, losses, train_step


# One family and base here (the int8 base trains in `trained`; every family's LoRA outputs: tests/test_peft_folders.py).
@pytest.mark.parametrize("flavour, base", [("llama", "nf4")])
def test_zero_b_adapters_are_the_base_model(flavour, base):
  model_config = dataclasses.replace(LLAMA if flavour == "llama" else GPT2, flavour=flavour, vocab_size=64,
                                     num_layers=1, d_ff=128)
  if flavour == "bert":
    make = lambda rngs: BertForSequenceClassification(model_config, 3, kernels=Kernels(), rngs=rngs)
  else:
    make = lambda rngs: GPT(model_config, kernels=Kernels(), rngs=rngs)
  graphdef, abstract = abstract_model(make)
  plan = lora.make_plan(abstract, LoRAConfig(rank=4, base=base))
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, SEQ)))

  @jax.jit
  def run():  # one program: the base model's output, the LoRA model's, and the merged weights
    params = nnx.split(make(nnx.Rngs(0)))[1].to_pure_dict()
    lora_params = lora.combine(lora.init_adapters(plan, params, jax.random.key(1)), lora.freeze(plan, params))
    merged = lora.merge(lora_params)
    forward = lambda p: nnx.merge(graphdef, p)(ids)
    return forward(lora_params), forward(merged), merged, lora._flat(lora_params)
  lora_out, base_out, merged, flat = run()
  # Equal up to float rounding: the two forward passes are other fusions of the same math.
  np.testing.assert_allclose(np.asarray(lora_out), np.asarray(base_out), rtol=1e-5, atol=1e-6)
  for path, value in lora._flat(merged).items():  # B = 0: the merge is exactly the (dequantized) frozen base
    if path in plan.targets:
      np.testing.assert_array_equal(value, lora.dense(flat[path].base))


def test_adapter_gradients_equal_autodiff_through_the_merged_weights():
  """The adapters' own backward (lora.low_rank_product: every target, w_o and the MLP on their own) and fused q/k/v
  (one weight with block-diagonal B) against plain autodiff of the model with W + scale * A B written out."""
  make = lambda rngs: GPT(LLAMA, kernels=Kernels(fuse_qkv="fused"), rngs=rngs)
  graphdef, abstract = abstract_model(make)
  plan = lora.make_plan(abstract, LoRAConfig(rank=4))
  params = nnx.split(make(nnx.Rngs(0)))[1].to_pure_dict()
  trainable = lora.init_adapters(plan, params, jax.random.key(1))
  trainable = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape), trainable)  # B != 0
  frozen = lora.freeze(plan, params)
  loss_fn = steps_lib.make_loss_fn(graphdef)
  batch = {k: jnp.asarray(v) for k, v in _batch().items()}
  adapted = jax.jit(jax.value_and_grad(lambda t: loss_fn(lora.combine(t, frozen), batch)[0]))(trainable)
  merged = jax.jit(jax.value_and_grad(lambda t: loss_fn(lora.merge(lora.combine(t, frozen)), batch)[0]))(trainable)
  # float32 rounding of two orders of the same sums: within 1e-4 of each leaf's largest entry
  close = lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-3,  # noqa: E731
                                                  atol=1e-4 * float(np.abs(np.asarray(y)).max()))
  jax.tree.map(close, adapted, merged)


def test_only_adapters_train_and_the_frozen_base_stays_bit_identical(trained):
  config, mesh, graphdef, before, state, losses, _ = trained
  after = jax.device_get(state)
  jax.tree.map(np.testing.assert_array_equal, before["frozen"], after["frozen"])
  assert losses[-1][0] < losses[0][0]
  flat = lora._flat(after["params"])
  weights = ("attn/w_q", "attn/w_k", "attn/w_v", "attn/w_o", "mlp/w_in", "mlp/w_out")
  assert set(flat) == {f"blocks/{w}/lora_{x}" for w in weights for x in "ab"}
  assert np.abs(flat["blocks/attn/w_q/lora_b"]).max() > 0  # B left zero
  # The optimizer state holds the adapters' moments only.
  assert lora.count_params(after["opt_state"]) < 3 * lora.count_params(after["params"])
  # Adapters are sharded like their base weight: A's input axes, B's output axes (heads over tensor).
  spec = lambda x: tuple(x.sharding.spec) + (None,) * (x.ndim - len(x.sharding.spec))
  adapters, frozen = state["params"]["blocks"]["attn"], state["frozen"]["blocks"]["attn"]
  w_q, w_o = spec(frozen["w_q"]["lora_base"].q.qvalue), spec(frozen["w_o"]["lora_base"].q.qvalue)  # int8 values
  # [L, D, H, K] and [L, H, K, D]
  assert w_q[2] == "tensor" and w_o[1] == "tensor"
  fsdp = w_q[1]  # the embed axis's mesh axis (None on this mesh without FSDP): also the rank axis of B_q and A_o
  assert spec(adapters["w_q"]["lora_a"]) == (*w_q[:2], None) and spec(adapters["w_q"]["lora_b"]) == (w_q[0], fsdp,
                                                                                                     *w_q[2:])
  assert spec(adapters["w_o"]["lora_a"]) == (*w_o[:3], fsdp) and spec(adapters["w_o"]["lora_b"]) == (w_o[0], None,
                                                                                                     w_o[3])


def test_sharded_accumulated_step_equals_one_device_unaccumulated(trained):
  config, _, _, sharded_start, sharded_state, sharded_losses, _ = trained
  mesh, _, state, train_step = _setup(dataclasses.replace(config, mesh=MeshConfig(data=1, fsdp=1, tensor=1),
                                                          train=dataclasses.replace(config.train, grad_accum=1)),
                                      jax.devices()[:1])
  # The same start as the sharded run (an init on another mesh may round differently in the last bit).
  state = jax.device_put(sharded_start, jax.tree.map(lambda x: x.sharding, state))
  losses = []
  for _ in range(3):
    state, metrics = train_step(state, steps_lib.to_global_batch(_batch(), mesh))
    losses.append((float(metrics["loss"]), float(metrics["grad_norm"])))
  # Each step's loss, and its gradient norm, which after two Adam updates also carries their rounding (see below).
  (loss, grad_norm), (sharded_loss, sharded_grad_norm) = np.transpose(losses), np.transpose(sharded_losses)
  np.testing.assert_allclose(loss, sharded_loss, rtol=1e-5)
  np.testing.assert_allclose(grad_norm, sharded_grad_norm, rtol=5e-5)
  # Adam divides by the root of the squared gradients, so a weight with a near-zero gradient moves by up to the
  # learning rate on float rounding alone: the tolerance is a small fraction of the 3 x 1e-2 the updates can reach.
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-3),
               jax.device_get(state["params"]), jax.device_get(sharded_state["params"]))


def test_merge_equals_base_plus_scaled_adapter_product(trained):
  config, _, graphdef, _, state, _, _ = trained
  params = jax.device_get(lora.combine(state["params"], state["frozen"]))
  merged = jax.device_get(lora.merge(params))
  w, a, b = (state["frozen"]["blocks"]["attn"]["w_o"]["lora_base"], state["params"]["blocks"]["attn"]["w_o"]["lora_a"],
             state["params"]["blocks"]["attn"]["w_o"]["lora_b"])
  expected = np.asarray(lora.dense(w)) + (config.lora.alpha / config.lora.rank) * np.einsum("lhkr,lrd->lhkd", a, b)
  np.testing.assert_allclose(merged["blocks"]["attn"]["w_o"], expected, rtol=1e-5, atol=1e-6)
  # The merged model's outputs against peft's: tests/test_peft_folders.py.


@pytest.mark.parametrize("devices", [1, 4])
def test_qlora_state_is_at_most_35_percent_of_full_finetuning(devices):
  """Per-device bytes of params + frozen base + optimizer state, a Llama config, from shapes alone."""
  mesh_config = MeshConfig(data=1, fsdp=devices, tensor=1)
  mesh = sharding.make_mesh(mesh_config, jax.devices()[:devices])
  make = lambda rngs: GPT(LLAMA, kernels=Kernels(), rngs=rngs)
  optimizer = optim.make_optimizer(TrainConfig())
  abstract = abstract_model(make)[1]
  param_shardings = sharding.param_shardings(abstract, mesh)
  params = abstract_with_shardings(abstract.to_pure_dict(), param_shardings)
  opt_state = optax.tree_map_params(  # AdamW's moments laid out like the parameters, as the train-state builder does
      optimizer, lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      jax.eval_shape(optimizer.init, params), param_shardings,
      transform_non_params=lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding.replicated(mesh)))
  full = lora.state_bytes({"params": params, "opt_state": opt_state})
  for base in ("int8", "nf4"):
    split = lora.LoRASplit(lora.make_plan(abstract, LoRAConfig(rank=8, base=base)))
    _, state, _ = init_train_state(make, 0, mesh, optimizer, Features(split), abstract_only=True)
    qlora = lora.state_bytes(state)
    assert qlora["state_bytes"] <= 0.35 * full["state_bytes"], (base, qlora, full)
    assert qlora["optimizer_state_bytes"] < 0.1 * full["optimizer_state_bytes"]


def test_quantized_bases_dequantize_close_to_the_float_weight():
  w = jax.random.normal(jax.random.key(0), (2, 128, 4, 8))  # [L, D, H, K]
  packed, restored = jax.jit(lambda w: (lambda q: (q, q.dequantize()))(nf4.nf4_quantize(w, num_in=1, num_lead=1)))(w)
  assert packed.codes.dtype == jnp.uint8 and packed.codes.shape == (2, 64, 4, 8) and packed.shape == w.shape
  error = np.abs(np.asarray(restored - w)).max()
  assert 0 < error < 0.25 * float(jnp.abs(w).max())  # NF4's widest gap between levels is ~0.3 of the block's absmax
  levels = np.asarray(restored)[0, :64, 0, 0] / np.abs(np.asarray(w)[0, :64, 0, 0]).max()
  assert set(np.round(levels, 5)) <= set(np.round(nf4.NF4_LEVELS, 5))


def _classifier_config(tmp_path, steps, **lora_kw):
  vocab_size = write_labelled_words(tmp_path, 32, 8)
  return Config(
      model=ModelConfig(flavour="bert", vocab_size=vocab_size, num_layers=1, d_model=128, num_heads=2, d_ff=128,
                        max_seq_len=16, compute_dtype="float32"),
      mesh=MeshConfig(data=4, fsdp=1, tensor=1), lora=LoRAConfig(rank=4, **lora_kw),
      data=DataConfig(source="files", train_files=(str(tmp_path / "train.csv"),),
                      eval_files=(str(tmp_path / "eval.csv"),), tokenizer=str(tmp_path / "tokenizer.json"),
                      seq_len=16, batching="max"),
      train=TrainConfig(steps=steps, batch_size=8, warmup_steps=1, learning_rate=3e-3, best_metric="accuracy"),
      checkpoint=CheckpointConfig(every_steps=100, keep=2), log=LogConfig(every_steps=1, progress_bar=False))


def test_qlora_state_resumes_from_a_checkpoint_bit_for_bit(trained, tmp_path):
  """The int8 base, adapters and optimizer state round-trip through the loop's checkpoints onto their shardings: two
  steps after a restore equal two steps without one (the loop around them is full training's: tests/test_train.py)."""
  config, mesh, _, _, state, _, train_step = trained
  state = jax.tree.map(jnp.copy, state)  # the fixture's state stays valid for the other tests (steps donate)
  batch = steps_lib.to_global_batch(_batch(seed=1), mesh)
  checkpointer = Checkpointer(str(tmp_path / "checkpoints"), every_steps=1, keep=1)
  abstract = abstract_with_shardings(state, jax.tree.map(lambda x: x.sharding, state))
  checkpointer.save(3, state, {"position": 3}, config.model)
  checkpointer.close()
  for _ in range(2):
    state, metrics = train_step(state, batch)
  _, restored, _ = Checkpointer(str(tmp_path / "checkpoints"), 1, 1).restore_latest(abstract, config.model)
  assert isinstance(restored["frozen"]["blocks"]["attn"]["w_q"]["lora_base"], int8.Int8Weight)
  for _ in range(2):
    restored, again = train_step(restored, batch)
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(restored), jax.device_get(state))
  assert float(again["loss"]) == float(metrics["loss"])


def test_qlora_finetuning_reports_its_state_and_exports_its_adapters(tmp_path):
  config = _classifier_config(tmp_path, steps=2, base="nf4")
  result = classifier_finetuning.finetune(config, str(tmp_path / "run"))
  saved = json.loads((tmp_path / "run" / "eval.json").read_text())
  assert saved["lora_base"] == "nf4" and saved["trainable_params"] == result["trainable_params"] > 0
  assert saved["frozen_base_bytes"] > saved["adapter_bytes"] > 0 and saved["optimizer_state_bytes"] > 0
  adapter_config = json.loads((tmp_path / "run" / "adapter" / "adapter_config.json").read_text())
  assert adapter_config["peft_type"] == "LORA" and adapter_config["modules_to_save"] == ["classifier"]
  assert (tmp_path / "run" / "best_model" / "model.safetensors").exists()  # merged weights, an ordinary HF folder


@pytest.mark.parametrize("change, message", [
    (dict(targets="w_nope"), "lora.targets: 'w_nope' matches no weight"),
    (dict(targets="w_gate"), "lora.targets: 'w_gate' matches no weight"),  # GPT-2 has no gated MLP
    (dict(rank=100), "lora.rank=100 exceeds the smaller side of weight blocks/attn/w_k (64 x 64)"),
    (dict(rank=4, base="nf4"), "lora.base=nf4 needs each target weight's input size divisible by 128"),
])
def test_bad_targets_and_ranks_are_one_line_errors(change, message):
  abstract = abstract_model(lambda rngs: GPT(GPT2, kernels=Kernels(), rngs=rngs))[1]
  with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
    lora.make_plan(abstract, LoRAConfig(**{"rank": 4, **change}))
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("key, value, message", [
    ("rank", -1, "lora.rank=-1 must be >= 0"),
    ("base", "fp4", "lora.base='fp4' is not one of float, int8, nf4"),
    ("alpha", 0.0, "lora.alpha=0.0 must be > 0"),
])
def test_bad_lora_config_values_are_one_line_errors(key, value, message):
  config = default_config()
  config.lora.rank = 8
  setattr(config.lora, key, value)
  with pytest.raises(ValueError, match=message):
    from_config_dict(config)
  config.lora.rank, config.lora.base, config.lora.alpha = 0, "int8", 16.0
  with pytest.raises(ValueError, match="lora.base=int8 \\(QLoRA\\) needs lora.rank > 0"):
    from_config_dict(config)
