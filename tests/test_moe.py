"""Mixture-of-experts layers: dropless routing equals a dense reference (every expert on every token, weighted by the
router), the grouped-matmul kernels equal jax.lax.ragged_dot, the router's losses reach the objective, and expert
parallelism (with data and FSDP axes) trains exactly as one device does."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_parallel import _run
from test_train import MODEL

from jaxlm.config import MeshConfig, from_config_dict
from jaxlm.kernels import Kernels, cpu
from jaxlm.models.gpt import GPT
from jaxlm.models.moe import MoE
from jaxlm.models.precision import Policy
from jaxlm.training import telemetry

MOE = dataclasses.replace(MODEL, num_experts=4, experts_per_token=2, expert_d_ff=96)
KERNELS = Kernels()  # the references: ragged_dot, XLA matmuls


def _dense_reference(layer: MoE, x_BTD: jax.Array) -> jax.Array:
  """Every expert on every token, summed with the router's weights of the chosen experts (0 for the others)."""
  b, t, d = x_BTD.shape
  x_ND = x_BTD.reshape(b * t, d)
  _, experts_NK, gates_NK = layer.route(x_ND, layer.w_router[...])
  weight_NE = jnp.sum(jax.nn.one_hot(experts_NK, layer.num_experts) * gates_NK[..., None], axis=1)
  if layer.gated:
    h = jax.nn.silu(jnp.einsum("nd,edf->enf", x_ND, layer.w_gate[...])) * jnp.einsum("nd,edf->enf", x_ND,
                                                                                      layer.w_up[...])
    y_END = jnp.einsum("enf,efd->end", h, layer.w_down[...])
  else:
    h = jax.nn.gelu(jnp.einsum("nd,edf->enf", x_ND, layer.w_in[...]), approximate=True)
    y_END = jnp.einsum("enf,efd->end", h, layer.w_out[...])
  return jnp.einsum("end,ne->nd", y_END, weight_NE).reshape(b, t, d)


@pytest.mark.parametrize("gated, normalize, grouped", [(True, True, "ragged_dot"), (False, False, "ragged_dot"),
                                                       (True, False, "blas")])
def test_dropless_layer_equals_every_expert_on_every_token(gated, normalize, grouped):
  kernels = dataclasses.replace(KERNELS, grouped_matmul=grouped)
  layer = MoE(32, 4, 2, 48, Policy.from_model_config(MODEL), kernels, 0.3, 0.3, gated=gated,
              normalize_topk=normalize, rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 16, 32))
  y, stats = jax.jit(lambda x: layer(x))(x)
  np.testing.assert_allclose(y, _dense_reference(layer, x), rtol=1e-5, atol=1e-6)
  assert 1.0 <= float(stats["expert_load_max_over_mean"]) <= 4.0
  assert float(stats["router_balance_loss"]) >= 1.0  # k * (1 / k) at the least: E * sum f_e P_e with sum f_e = k


def test_a_shared_expert_adds_its_dense_mlp_for_every_token():
  shared = MoE(32, 4, 2, 48, Policy.from_model_config(MODEL), KERNELS, 0.3, 0.3, gated=True, shared_d_ff=40,
               rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(1), (2, 16, 32))
  y, _ = jax.jit(lambda x: shared(x))(x)
  np.testing.assert_allclose(y, _dense_reference(shared, x) + shared.shared(x), rtol=1e-5, atol=1e-6)


def test_blas_grouped_matmul_and_its_gradients_equal_ragged_dot():
  """Uneven groups, an empty group and rows past the groups (which both leave zero)."""
  x = jax.random.normal(jax.random.key(0), (40, 24))
  w = jax.random.normal(jax.random.key(1), (4, 24, 16))
  sizes = jnp.array([11, 0, 20, 5], jnp.int32)
  dy = jax.random.normal(jax.random.key(2), (40, 16))

  def run(fn):
    y, vjp = jax.vjp(lambda x, w: fn(x, w, sizes), x, w)
    return (y, *vjp(dy))

  for got, want in zip(jax.jit(lambda: run(cpu.grouped_matmul))(), jax.jit(lambda: run(jax.lax.ragged_dot))()):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_router_losses_join_the_objective_and_its_gradient():
  """loss_sums' aux_loss is the weighted router losses times the token weight, and the router learns from them."""
  config = dataclasses.replace(MOE, router_balance_weight=0.5, router_z_weight=0.25)
  model = GPT(config, KERNELS, rngs=nnx.Rngs(0))
  ids = jax.random.randint(jax.random.key(1), (2, 16), 0, config.vocab_size)
  weights = jnp.ones((2, 16)).at[1, 10:].set(0.0)
  graphdef, params = nnx.split(model)

  @jax.jit
  def sums_and_router_grad(params):
    aux = lambda p: nnx.merge(graphdef, p).loss_sums(ids, ids, weights)[1]["aux_loss"]  # noqa: E731
    return nnx.merge(graphdef, params).loss_sums(ids, ids, weights)[1], jax.grad(aux)(params)

  sums, grads = sums_and_router_grad(params)
  total = float(weights.sum())
  balance, z = float(sums["router_balance_loss"]) / total, float(sums["router_z_loss"]) / total
  np.testing.assert_allclose(float(sums["aux_loss"]) / total, 0.5 * balance + 0.25 * z, rtol=1e-6)
  assert set(sums) >= {f"expert_load_max_over_mean/layer_{i}" for i in range(config.num_layers)}
  assert float(jnp.abs(grads["blocks"]["mlp"]["w_router"][...]).max()) > 0


def test_mixture_of_experts_counts_active_parameters_in_flops():
  dense = dataclasses.replace(MODEL, flavour="llama", d_ff=96)
  moe = dataclasses.replace(dense, num_experts=8, experts_per_token=2, expert_d_ff=48)
  router = 6 * MODEL.num_layers * MODEL.d_model * 8
  assert telemetry.flops_per_token(moe, 16) == telemetry.flops_per_token(dense, 16) + router


@pytest.fixture(scope="module")
def one_device_moe():
  return _run(MeshConfig(data=1, fsdp=1, tensor=1), devices=jax.devices()[:1], model=MOE)


@pytest.mark.parametrize("mesh", [MeshConfig(data=1, expert=4), MeshConfig(data=1, fsdp=2, expert=2)],
                         ids=["expert4", "fsdp2_expert2"])  # fsdp splits the batch beside expert, as data would
def test_expert_parallel_training_matches_one_device(one_device_moe, mesh):
  ref_losses, ref_metrics, _ = one_device_moe
  losses, metrics, state = _run(mesh, model=MOE)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-4)
  np.testing.assert_allclose(metrics["router_balance_loss"], ref_metrics["router_balance_loss"], rtol=1e-5)
  w_gate = state["params"]["blocks"]["mlp"]["w_in"]  # [L, E, D, F]: the experts split over the expert axis
  assert w_gate.sharding.shard_shape(w_gate.shape)[1] == MOE.num_experts // mesh.expert


@pytest.mark.parametrize("overrides, message", [
    ({"model": {"num_experts": 2, "experts_per_token": 3}}, "model.experts_per_token=3 exceeds model.num_experts=2"),
    ({"model": {"num_experts": 6}, "mesh": {"expert": 4}}, "model.num_experts=6 is not divisible by mesh.expert=4"),
    ({"mesh": {"expert": 2}}, "this one has none"),
    ({"model": {"num_experts": 4, "flavour": "bert"}}, "needs a decoder"),
    ({"model": {"num_experts": 4}, "mesh": {"expert": 2, "tensor": 2}}, "set mesh.tensor=1 and mesh.context=1"),
])
def test_bad_expert_settings_are_one_line_errors(overrides, message):
  with pytest.raises(ValueError, match=message):
    from_config_dict(overrides)


def test_lora_on_expert_weights_is_a_one_line_error_and_attention_adapters_train():
  from jaxlm.adapters import lora
  from jaxlm.config import LoRAConfig
  from jaxlm.training.state import abstract_model
  _, abstract = abstract_model(lambda rngs: GPT(MOE, KERNELS, rngs=rngs))
  with pytest.raises(ValueError, match="adapters are not built for; use lora.targets=attention"):
    lora.make_plan(abstract, LoRAConfig(rank=4, targets="all"))
  plan = lora.make_plan(abstract, LoRAConfig(rank=4, targets="attention"))
  assert set(plan.targets) == {f"blocks/attn/{w}" for w in ("w_q", "w_k", "w_v", "w_o")}


def test_kv_cache_decoding_equals_the_full_forward():
  graphdef, params = nnx.split(GPT(dataclasses.replace(MOE, flavour="llama"), KERNELS, rngs=nnx.Rngs(0)))
  ids = jax.random.randint(jax.random.key(1), (2, 12), 0, MOE.vocab_size)

  @jax.jit
  def incremental_and_full(params):
    model = nnx.merge(graphdef, params)
    logits, cache = model.decode(ids[:, :8], model.init_cache(2, 16))  # the prompt, then one token at a time
    steps = [logits]
    for i in range(8, 12):
      logits, cache = model.decode(ids[:, i:i + 1], cache)
      steps.append(logits)
    return jnp.concatenate(steps, axis=1), model(ids)

  incremental, full = incremental_and_full(params)
  np.testing.assert_allclose(incremental, full, rtol=1e-5, atol=1e-5)


def test_a_batch_the_batch_devices_do_not_divide_runs_whole():
  """A generated sample's single row on a 4-device expert mesh: the experts gathered, the same logits."""
  from jaxlm import kernels as kernels_lib
  from jaxlm.config import KernelsConfig
  from jaxlm.parallel import sharding
  mesh = sharding.make_mesh(MeshConfig(data=1, expert=4))
  kernels = kernels_lib.resolve(KernelsConfig(), compute_dtype="float32", mesh=mesh)
  graphdef, state = nnx.split(GPT(MOE, kernels, rngs=nnx.Rngs(0)))
  ids = jax.random.randint(jax.random.key(1), (1, 16), 0, MOE.vocab_size)
  placed = jax.device_put(state, sharding.replicated(mesh))
  logits = jax.jit(sharding.traced_on(mesh, lambda s, ids: nnx.merge(graphdef, s)(ids)))(placed, ids)
  np.testing.assert_allclose(logits, GPT(MOE, KERNELS, rngs=nnx.Rngs(0))(ids), rtol=1e-5, atol=1e-5)
