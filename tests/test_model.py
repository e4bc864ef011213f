"""GPT decoder: shapes, causality, document masking, remat and precision equivalence."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlm.config import ModelConfig
from jaxlm.models.gpt import GPT

TINY = ModelConfig(vocab_size=128, num_layers=2, d_model=32, num_heads=4, max_seq_len=32,
                   compute_dtype="float32")


def _model(config=TINY, seed=0):
  return GPT(config, rngs=nnx.Rngs(seed))


def _tokens(shape, seed=1, vocab=TINY.vocab_size):
  return jax.random.randint(jax.random.key(seed), shape, 0, vocab, dtype=jnp.int32)


def test_logits_shape_and_dtype():
  logits = _model()(_tokens((3, 16)))
  chex.assert_shape(logits, (3, 16, TINY.vocab_size))
  assert logits.dtype == jnp.float32
  chex.assert_tree_all_finite(logits)


def test_parameters_are_stacked_over_layers():
  _, state = nnx.split(_model())
  params = state.to_pure_dict()
  chex.assert_shape(params["blocks"]["attn"]["w_q"], (TINY.num_layers, 32, 4, 8))
  chex.assert_shape(params["blocks"]["mlp"]["w_in"], (TINY.num_layers, 32, 128))


def test_causal_logits_do_not_depend_on_later_tokens():
  model = _model()
  tokens = _tokens((2, 16))
  changed = tokens.at[:, 9:].set((tokens[:, 9:] + 7) % TINY.vocab_size)
  before, after = model(tokens), model(changed)
  chex.assert_trees_all_close(before[:, :9], after[:, :9], atol=1e-6)
  assert not np.allclose(before[:, 9:], after[:, 9:])


def test_packed_documents_equal_separate_documents():
  """Segment ids and reset positions make a packed row compute each document as if it were alone."""
  model = _model()
  doc_a, doc_b = _tokens((1, 10), seed=2), _tokens((1, 6), seed=3)
  packed = jnp.concatenate([doc_a, doc_b], axis=1)
  segments = jnp.concatenate([jnp.ones((1, 10), jnp.int32), 2 * jnp.ones((1, 6), jnp.int32)], axis=1)
  positions = jnp.concatenate([jnp.arange(10), jnp.arange(6)])[None]
  logits = model(packed, positions, segments)
  chex.assert_trees_all_close(logits[:, :10], model(doc_a), atol=1e-5)
  chex.assert_trees_all_close(logits[:, 10:], model(doc_b), atol=1e-5)


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_computes_the_same_function_and_gradient(remat):
  import dataclasses
  reference, rematted = _model(), _model(dataclasses.replace(TINY, remat=remat))
  tokens = _tokens((2, 16))

  def loss_and_grads(model):
    graphdef, params = nnx.split(model)
    params = params.to_pure_dict()
    loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)
    return jax.value_and_grad(loss)(params)

  chex.assert_trees_all_close(loss_and_grads(reference), loss_and_grads(rematted), rtol=1e-5, atol=1e-6)


def test_bf16_compute_stays_close_to_f32():
  import dataclasses
  tokens = _tokens((2, 16))
  f32 = _model()(tokens)
  bf16_model = _model(dataclasses.replace(TINY, compute_dtype="bfloat16"))
  bf16 = bf16_model(tokens)
  assert bf16.dtype == jnp.float32  # logits stay f32 whatever the compute dtype
  assert float(jnp.max(jnp.abs(bf16 - f32))) < 0.05 * float(jnp.max(jnp.abs(f32)))
