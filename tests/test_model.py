"""GPT decoder (gpt2 and llama flavours) and BERT: shapes, causality, document masking, padding, remat and
precision equivalence. Models are built once per config and called through one jitted function, because XLA
compiles a whole jitted model faster than every op of an eager call."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlm.config import ModelConfig
from jaxlm.kernels import Kernels
from jaxlm.models.bert import Bert, BertForMaskedLM, BertForSequenceClassification
from jaxlm.models import rotary
from jaxlm.models.gpt import GPT

TINY = ModelConfig(vocab_size=128, num_layers=2, d_model=32, num_heads=4, max_seq_len=32,
                   compute_dtype="float32")
LLAMA = dataclasses.replace(TINY, flavour="llama", num_kv_heads=2, d_ff=48, tie_embeddings=False)
BERT = dataclasses.replace(TINY, flavour="bert", d_ff=48, layer_norm_eps=1e-12)


@functools.lru_cache(maxsize=None)
def _split(config=TINY, seed=0, cls=GPT, kernels=None):
  return nnx.split(cls(config, kernels, rngs=nnx.Rngs(seed)))


@functools.partial(jax.jit, static_argnums=0)
def _apply(graphdef, state, *args):
  return nnx.merge(graphdef, state)(*args)


def _logits(*args, config=TINY, cls=GPT):
  return _apply(*_split(config, cls=cls), *args)


def _tokens(shape, seed=1, vocab=TINY.vocab_size):
  return jax.random.randint(jax.random.key(seed), shape, 0, vocab, dtype=jnp.int32)


def test_logits_shape_and_dtype():
  logits = _logits(_tokens((3, 16)))
  chex.assert_shape(logits, (3, 16, TINY.vocab_size))
  assert logits.dtype == jnp.float32
  chex.assert_tree_all_finite(logits)


def test_parameters_are_stacked_over_layers():
  params = _split()[1].to_pure_dict()
  chex.assert_shape(params["blocks"]["attn"]["w_q"], (TINY.num_layers, 32, 4, 8))
  chex.assert_shape(params["blocks"]["mlp"]["w_in"], (TINY.num_layers, 32, 128))


def test_causal_logits_do_not_depend_on_later_tokens():
  tokens = _tokens((2, 16))
  changed = tokens.at[:, 9:].set((tokens[:, 9:] + 7) % TINY.vocab_size)
  before, after = _logits(tokens), _logits(changed)
  chex.assert_trees_all_close(before[:, :9], after[:, :9], atol=1e-6)
  assert not np.allclose(before[:, 9:], after[:, 9:])


@pytest.mark.parametrize("config", [TINY, LLAMA, dataclasses.replace(LLAMA, num_kv_heads=1)],
                         ids=["gpt2", "llama_gqa", "llama_mqa"])
def test_packed_documents_equal_separate_documents(config):
  """Segment ids and reset positions (learned or rotary) make a packed row compute each document as if alone."""
  doc_a, doc_b = _tokens((1, 10), seed=2), _tokens((1, 6), seed=3)
  packed = jnp.concatenate([doc_a, doc_b], axis=1)
  segments = jnp.concatenate([jnp.ones((1, 10), jnp.int32), 2 * jnp.ones((1, 6), jnp.int32)], axis=1)
  positions = jnp.concatenate([jnp.arange(10), jnp.arange(6)])[None]
  logits = _logits(packed, positions, segments, config=config)
  # The documents alone, left-aligned in rows of the packed length (causal: the zeros after them do not matter).
  alone = _logits(jnp.concatenate([packed, jnp.concatenate([doc_b, 0 * doc_a], axis=1)]), config=config)
  chex.assert_trees_all_close(logits[:, :10], alone[:1, :10], atol=1e-5)
  chex.assert_trees_all_close(logits[:, 10:], alone[1:, :6], atol=1e-5)


@functools.lru_cache(maxsize=None)
def _loss_and_grads(config, kernels=Kernels()):
  graphdef, state = _split(config, kernels=kernels)
  tokens = _tokens((2, 16))
  loss = lambda p: jnp.mean(nnx.merge(graphdef, p)(tokens) ** 2)
  return jax.jit(jax.value_and_grad(loss))(state.to_pure_dict())


@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_computes_the_same_function_and_gradient(remat):
  chex.assert_trees_all_close(_loss_and_grads(TINY), _loss_and_grads(TINY, Kernels(remat=remat)),
                              rtol=1e-5, atol=1e-6)


def test_bf16_compute_stays_close_to_f32():
  tokens = _tokens((2, 16))
  f32 = _logits(tokens)
  bf16 = _logits(tokens, config=dataclasses.replace(TINY, compute_dtype="bfloat16"))
  assert bf16.dtype == jnp.float32  # logits stay f32 whatever the compute dtype
  assert float(jnp.max(jnp.abs(bf16 - f32))) < 0.05 * float(jnp.max(jnp.abs(f32)))


def test_llama_flavour_has_gqa_rmsnorm_swiglu_no_biases_and_an_untied_head():
  params = _split(LLAMA)[1].to_pure_dict()
  chex.assert_shape(params["blocks"]["attn"]["w_q"], (2, 32, 4, 8))
  chex.assert_shape(params["blocks"]["attn"]["w_k"], (2, 32, 2, 8))  # 2 key/value heads serve 4 query heads
  assert set(params["blocks"]["attn"]) == {"w_q", "w_k", "w_v", "w_o"}
  assert set(params["blocks"]["mlp"]) == {"w_gate", "w_up", "w_down"}
  assert set(params["blocks"]["attn_norm"]) == {"scale"}
  assert "position_embed" not in params and "lm_head" in params


def _rope_rotate_half(x, positions, theta):
  """HF Llama's rotary embedding as written there: halves sliced, rotate_half concatenated."""
  half = x.shape[-1] // 2
  inv_freq = 1.0 / theta ** (jnp.arange(0, 2 * half, 2, dtype=jnp.float32) / (2 * half))
  angles = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]
  cos, sin = (jnp.concatenate([f(angles)] * 2, axis=-1)[:, :, None, :] for f in (jnp.cos, jnp.sin))
  x = x.astype(jnp.float32)
  rotate_half = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  return x * cos + rotate_half * sin


def test_rope_equals_hf_rotate_half_values_and_gradients():
  x = jax.random.normal(jax.random.key(0), (2, 7, 3, 16), jnp.float32) * 3
  positions = jnp.array([[0, 1, 2, 3, 4, 5, 6], [5, 9, 100, 2047, 0, 1, 3]], jnp.int32)
  ours = jax.jit(lambda x, p: rotary.apply_rope(x, rotary.rotary_tables(p, 16, 10000.0)))
  reference = jax.jit(functools.partial(_rope_rotate_half, theta=10000.0))
  # The same products and sums: equal to rounding (bit for bit on today's CPU; a compiler may contract differently).
  chex.assert_trees_all_close(ours(x, positions), reference(x, positions), atol=1e-6, rtol=0)
  cotangent = jax.random.normal(jax.random.key(1), x.shape, jnp.float32)
  grad = lambda f: jax.grad(lambda x: jnp.sum(f(x, positions) * cotangent))(x)
  chex.assert_trees_all_close(grad(ours), grad(reference), atol=1e-6)
  bf16 = ours(x.astype(jnp.bfloat16), positions)
  assert bf16.dtype == jnp.bfloat16
  chex.assert_trees_all_close(bf16.astype(jnp.float32), reference(x, positions), atol=0.1, rtol=0.02)


def test_llama_is_causal():
  tokens = _tokens((2, 16))
  changed = tokens.at[:, 9:].set((tokens[:, 9:] + 7) % TINY.vocab_size)
  before, after = _logits(tokens, config=LLAMA), _logits(changed, config=LLAMA)
  chex.assert_trees_all_close(before[:, :9], after[:, :9], atol=1e-6)


def test_bert_padding_does_not_change_real_tokens_and_heads_have_their_shapes():
  ids = _tokens((2, 12))
  types = jnp.zeros_like(ids).at[:, 6:].set(1)
  mask = jnp.ones_like(ids).at[1, 8:].set(0)
  hidden = _logits(ids, mask, types, config=BERT, cls=Bert)
  chex.assert_shape(hidden, (2, 12, 32))
  # Row 1 without its padding, in a row of the same length whose tail is masked differently (all but 8 tokens).
  other = jnp.concatenate([ids[1:, :8], _tokens((1, 4), seed=5)], axis=1)
  again = _logits(jnp.concatenate([other, ids[:1]]), jnp.concatenate([mask[1:], mask[:1]]),
                  jnp.concatenate([types[1:], types[:1]]), config=BERT, cls=Bert)
  chex.assert_trees_all_close(hidden[1, :8], again[0, :8], atol=1e-5)
  mlm = nnx.merge(*_split(BERT, cls=BertForMaskedLM))
  chex.assert_shape(jax.eval_shape(mlm, ids, mask, types), (2, 12, TINY.vocab_size))
  classifier = BertForSequenceClassification(BERT, 3, rngs=nnx.Rngs(0))
  chex.assert_shape(jax.eval_shape(classifier, ids, mask, types), (2, 3))
