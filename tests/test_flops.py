"""telemetry.flops_per_token against the matmuls the models really run, for every flavour.

The reference count walks the jaxpr of the loss gradient (forward and backward, scanned layers multiplied by their
trip count) and adds 2 * (output size) * (contracted size) for every dot_general: nothing about the model's shapes
is assumed, so a wrong kv-head, MLP or head term in flops_per_token shows up as a mismatch. The models run the
reference kernels (`Kernels()`: XLA's dots everywhere), whose matmuls the jaxpr shows; the other implementations
compute the same function.
"""

import math

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from jaxlm.config import ModelConfig
from jaxlm.kernels import Kernels
from jaxlm.models import bert, gpt
from jaxlm.training import telemetry

B, T = 2, 16


def _sub_jaxprs(value):
  if hasattr(value, "eqns"):
    yield value
  elif hasattr(value, "jaxpr") and hasattr(value.jaxpr, "eqns"):
    yield value.jaxpr
  elif isinstance(value, (tuple, list)):
    for item in value:
      yield from _sub_jaxprs(item)


def matmul_flops(jaxpr) -> float:
  total = 0.0
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "dot_general":
      (lhs_contract, _), _ = eqn.params["dimension_numbers"]
      lhs_shape = eqn.invars[0].aval.shape
      total += 2 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs_shape[i] for i in lhs_contract)
    times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
    for value in eqn.params.values():
      for sub in _sub_jaxprs(value):
        total += times * matmul_flops(sub)
  return total


def gradient_matmul_flops(model, loss) -> float:
  graphdef, params = nnx.split(model)
  ids = jnp.zeros((B, T), jnp.int32)

  def loss_fn(params):
    return loss(nnx.merge(graphdef, params)(ids))

  return matmul_flops(jax.make_jaxpr(jax.grad(loss_fn))(params).jaxpr)


def lm_loss(logits_BTV):
  return optax.softmax_cross_entropy_with_integer_labels(logits_BTV, jnp.zeros(logits_BTV.shape[:2], jnp.int32)).sum()


def classifier_loss(logits_BC):
  return optax.softmax_cross_entropy_with_integer_labels(logits_BC, jnp.zeros(logits_BC.shape[:1], jnp.int32)).sum()


BASE = dict(vocab_size=96, num_layers=2, d_model=32, num_heads=4, max_seq_len=T, compute_dtype="float32")


@pytest.mark.parametrize("name, overrides", [
    ("gpt2", {}),
    ("gpt2_wide_mlp", {"d_ff": 48}),
    ("llama_gqa_untied", {"flavour": "llama", "num_kv_heads": 2, "tie_embeddings": False, "d_ff": 40}),
    ("llama_mqa_tied", {"flavour": "llama", "num_kv_heads": 1}),
])
def test_decoder_flops_match_the_gradient_jaxpr(name, overrides):
  config = ModelConfig(**{**BASE, **overrides})
  counted = gradient_matmul_flops(gpt.GPT(config, kernels=Kernels(), rngs=nnx.Rngs(0)), lm_loss)
  assert telemetry.flops_per_token(config, T) * B * T == pytest.approx(counted, rel=1e-9), name


def test_bert_masked_lm_and_classifier_flops_match_the_gradient_jaxpr():
  config = ModelConfig(**{**BASE, "flavour": "bert"})
  counted = gradient_matmul_flops(bert.BertForMaskedLM(config, kernels=Kernels(), rngs=nnx.Rngs(0)), lm_loss)
  assert telemetry.flops_per_token(config, T) * B * T == pytest.approx(counted, rel=1e-9)
  counted = gradient_matmul_flops(bert.BertForSequenceClassification(config, 3, kernels=Kernels(), rngs=nnx.Rngs(0)),
                                  classifier_loss)
  assert telemetry.flops_per_token(config, T, num_labels=3) * B * T == pytest.approx(counted, rel=1e-9)


def test_grouped_query_attention_saves_only_the_key_value_projections():
  mha = ModelConfig(**{**BASE, "flavour": "llama"})
  mqa = ModelConfig(**{**BASE, "flavour": "llama", "num_kv_heads": 1})
  # k and v projections shrink from D x (4 heads * 8) to D x (1 head * 8) in each of the 2 layers; 6 FLOPs each.
  saved_params = 2 * 2 * 32 * (32 - 8)
  assert telemetry.flops_per_token(mha, T) - telemetry.flops_per_token(mqa, T) == 6 * saved_params
