"""Every speed option computes the same function as its reference path: BLAS matmuls (model.matmul=blas) against
XLA's, the fused chunked cross-entropy (model.cross_entropy_chunk) against [B, T, V] logits + optax, the fused
q/k/v matmul (model.fuse_qkv), the unrolled layer scan (model.scan_unroll) and the layer loop
(model.scan_layers=False), and the block-causal, fused CPU, recompute and jax.nn.dot_product_attention paths
(model.attention=causal_blocks|cpu_fused|recompute|jax|cudnn) against the einsum attention on packed documents,
and attention across the documents of a row (model.document_mask=False).
Tiny shapes: seconds on a CPU."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxlm import blas, cross_entropy, train
from jaxlm.config import ModelConfig
from jaxlm.cross_entropy import fused_cross_entropy
from jaxlm.models.gpt import GPT

TINY = ModelConfig(vocab_size=96, num_layers=2, d_model=32, num_heads=4, max_seq_len=32, compute_dtype="float32")
LLAMA = dataclasses.replace(TINY, flavour="llama", num_kv_heads=2, d_ff=48, tie_embeddings=False)


def _reference_ce(x, table, targets, weights):
  logits = jnp.einsum("nd,vd->nv", x, table, preferred_element_type=jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  correct = (jnp.argmax(logits, axis=-1) == targets).astype(jnp.float32)
  return jnp.sum(losses * weights), jnp.sum(correct * weights)


@pytest.mark.parametrize("chunk", [8, 64])  # divides N=40; larger than N (one padded chunk)
@pytest.mark.parametrize("scatter", [True, False], ids=["scatter_form", "one_hot_form"])
def test_fused_cross_entropy_equals_logits_path_value_and_gradients(chunk, scatter, monkeypatch):
  """Both forms of the gradient (cross_entropy._dlogits: each platform traces its own) against optax's."""
  monkeypatch.setattr(cross_entropy, "_use_scatter_gradient", lambda: scatter)
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((40, 16)), jnp.float32)
  table = jnp.asarray(rng.standard_normal((50, 16)), jnp.float32)
  targets = jnp.asarray(rng.integers(0, 50, 40), jnp.int32)
  weights = jnp.asarray(rng.random(40) > 0.2, jnp.float32)  # some tokens masked out

  def value_and_grads(fn):
    loss = lambda x, t: fn(x, t, targets, weights)[0]
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, table)

  expected = value_and_grads(_reference_ce)
  got = value_and_grads(lambda *a: fused_cross_entropy(*a, chunk))
  chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(jax.jit(fused_cross_entropy, static_argnums=4)(x, table, targets, weights, chunk),
                              _reference_ce(x, table, targets, weights), rtol=1e-5, atol=1e-5)


def _batch(vocab, b=2, t=16, seed=1):
  """Two packed documents per row, the boundary target masked, as jaxlm.data makes them."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(0, vocab, (b, t + 1)).astype(np.int32)
  segments = np.ones((b, t), np.int32)
  segments[:, 10:] = 2
  positions = np.concatenate([np.arange(10), np.arange(t - 10)])[None].repeat(b, 0).astype(np.int32)
  mask = np.ones((b, t), np.float32)
  mask[:, 9] = 0.0
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments, "positions": positions,
          "loss_mask": mask}


@functools.lru_cache(maxsize=None)
def _loss_value_and_grads(config):
  graphdef, state = nnx.split(GPT(config, rngs=nnx.Rngs(0)))
  loss_fn = train.make_loss_fn(graphdef)
  grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
  return grad_fn(state.to_pure_dict(), _batch(config.vocab_size))


@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2_tied", "llama_untied"])
def test_train_loss_with_fused_cross_entropy_equals_logits_path(base):
  """The loss sum, token count, accuracy and every parameter gradient of make_loss_fn are the same."""
  expected = _loss_value_and_grads(base)
  got = _loss_value_and_grads(dataclasses.replace(base, cross_entropy_chunk=12))  # 32 tokens: 3 chunks, padded
  chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2_biases", "llama_gqa"])
def test_fused_qkv_projection_equals_three_projections(base):
  chex.assert_trees_all_close(_loss_value_and_grads(dataclasses.replace(base, fuse_qkv=True)),
                              _loss_value_and_grads(base), rtol=1e-5, atol=1e-6)


NEEDS_COMPILER = pytest.mark.skipif(blas.compiler() is None, reason="model.matmul=blas needs a C++ compiler (g++)")


@NEEDS_COMPILER
@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2_tied", "llama_untied"])
def test_blas_matmuls_equal_xla_matmuls(base):
  """model.matmul=blas (jaxlm/blas.py: every weight matmul one OpenBLAS sgemm custom call) against XLA's dots
  (another summation order: gradients near zero differ by ~1e-6)."""
  chex.assert_trees_all_close(_loss_value_and_grads(dataclasses.replace(base, matmul="blas")),
                              _loss_value_and_grads(base), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("matmul, attention", [("xla", "causal_blocks"),
                                               pytest.param("blas", "causal_blocks", marks=NEEDS_COMPILER),
                                               pytest.param("blas", "cpu_fused", marks=NEEDS_COMPILER)])
def test_cpu_bench_options_together_equal_the_reference(matmul, attention):
  """The CPU bench's combination (experiments/configs/bench_cpu.py): fused q/k/v, block-causal attention (einsums
  or the fused C++ kernel), remat=dots (recompute elementwise ops, keep matmul outputs) inside the layer scan and
  the chunked cross-entropy, with XLA's or BLAS matmuls: loss, token accuracy and every gradient."""
  config = dataclasses.replace(TINY, fuse_qkv=True, attention=attention, attention_block=8, remat="dots",
                               cross_entropy_chunk=8, matmul=matmul)
  chex.assert_trees_all_close(_loss_value_and_grads(config), _loss_value_and_grads(TINY), rtol=1e-5,
                              atol=1e-5 if matmul == "blas" else 1e-6)


@functools.lru_cache(maxsize=None)
def _logits(config):
  graphdef, state = nnx.split(GPT(config, rngs=nnx.Rngs(0)))
  batch = _batch(config.vocab_size)
  apply = jax.jit(lambda s: nnx.merge(graphdef, s)(batch["inputs"], batch["positions"], batch["segment_ids"]))
  return apply(state)


@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2_mha", "llama_gqa"])
def test_jax_nn_attention_equals_einsum_attention_on_packed_documents(base):
  chex.assert_trees_all_close(_logits(dataclasses.replace(base, attention="jax")), _logits(base),
                              rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [4, 7, 16])  # divides T=16; leaves a short last block; one block
@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2_mha", "llama_gqa"])
@pytest.mark.parametrize("attention", ["causal_blocks", pytest.param("cpu_fused", marks=NEEDS_COMPILER)])
def test_causal_block_attention_equals_einsum_attention(base, block, attention):
  """Loss and every gradient, on rows of two packed documents (the document mask inside the causal one), for the
  einsum blocks and the fused C++ kernel (tests/test_cpu_attention.py tests the kernel alone)."""
  config = dataclasses.replace(base, attention=attention, attention_block=block)
  chex.assert_trees_all_close(_loss_value_and_grads(config), _loss_value_and_grads(base), rtol=1e-5, atol=1e-6)


def test_causal_block_attention_gradients_in_bf16_and_f32():
  """Its hand-written backward pass on grouped heads and two packed documents: f32 equal to the einsum reference,
  bf16 inputs within bf16 rounding of it."""
  from jaxlm.models.attention import causal_block_attention, causal_mask, dot_product_attention  # noqa: PLC0415
  from jaxlm.precision import Policy  # noqa: PLC0415
  rng = np.random.default_rng(5)
  q, k, v, w = (jnp.asarray(rng.standard_normal((2, 12, 4, 8)), jnp.float32) for _ in range(4))
  k, v = k[:, :, :2], v[:, :, :2]  # 2 key/value heads for 4 query heads
  mask = causal_mask(jnp.asarray([[1] * 5 + [2] * 7, [1] * 12]))

  def grads(attend, dtype):
    loss = lambda q, k, v: jnp.sum(attend(q.astype(dtype), k.astype(dtype), v.astype(dtype)).astype(jnp.float32) * w)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

  f32, bf16 = Policy(compute_dtype=jnp.float32), Policy(compute_dtype=jnp.bfloat16)
  reference = grads(lambda q, k, v: dot_product_attention(q, k, v, mask, f32), jnp.float32)
  chex.assert_trees_all_close(grads(lambda q, k, v: causal_block_attention(q, k, v, mask, f32, 5), jnp.float32),
                              reference, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(grads(lambda q, k, v: causal_block_attention(q, k, v, mask, bf16, 5), jnp.bfloat16),
                              reference, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2_mha", "llama_gqa"])
def test_recompute_attention_equals_einsum_attention(base):
  """Its hand-written backward pass (probabilities rebuilt from the saved log-sum-exp) gives every gradient."""
  config = dataclasses.replace(base, attention="recompute")
  chex.assert_trees_all_close(_loss_value_and_grads(config), _loss_value_and_grads(base), rtol=1e-5, atol=1e-6)


def test_recompute_attention_gradients_with_padding_and_bf16():
  """Bidirectional attention over padded keys (BERT's mask, a fully padded row included) in f32, and bf16 inputs
  within bf16 rounding of the f32 reference."""
  from jaxlm.models.attention import dot_product_attention, padding_mask, recompute_attention  # noqa: PLC0415
  from jaxlm.precision import Policy  # noqa: PLC0415
  rng = np.random.default_rng(3)
  q, k, v, w = (jnp.asarray(rng.standard_normal((2, 6, 4, 8)), jnp.float32) for _ in range(4))
  k, v = k[:, :, :2], v[:, :, :2]  # 2 key/value heads for 4 query heads
  mask = padding_mask(jnp.asarray([[1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]]), 6)

  def grads(attend, dtype):
    loss = lambda q, k, v: jnp.sum(attend(q.astype(dtype), k.astype(dtype), v.astype(dtype)).astype(jnp.float32) * w)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

  f32 = Policy(compute_dtype=jnp.float32)
  reference = grads(lambda q, k, v: dot_product_attention(q, k, v, mask, f32), jnp.float32)
  chex.assert_trees_all_close(grads(lambda q, k, v: recompute_attention(q, k, v, mask), jnp.float32), reference,
                              rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(grads(lambda q, k, v: recompute_attention(q, k, v, mask), jnp.bfloat16), reference,
                              rtol=5e-2, atol=5e-2)


def test_recompute_attention_saves_no_probabilities():
  """The residuals of a 2-layer GPT at T=32: the reference keeps [B, H, T, T] probabilities per layer, recompute
  only a [B, H, T] log-sum-exp, as cuDNN's flash kernel does (jaxlm.predict counts what each saves)."""
  from jaxlm import predict  # noqa: PLC0415
  reference = predict.saved_activation_bytes(TINY, 32, 1, 2)
  recompute = predict.saved_activation_bytes(dataclasses.replace(TINY, attention="recompute"), 32, 1, 2)
  probabilities = TINY.num_layers * 2 * TINY.num_heads * 32 * 32 * 4  # f32 [B, H, T, T] per layer
  assert reference - recompute >= 0.9 * probabilities, (reference, recompute, probabilities)


@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2_mha", "llama_gqa"])
def test_without_document_mask_rows_attend_across_documents_on_every_path(base):
  """document_mask=False is plain causal attention over the row: the same logits as the document-masked model fed
  the row as one document, different from it on packed documents; jax.nn's path then gets no mask tensor
  (is_causal alone), and agrees with the einsum path."""
  plain = dataclasses.replace(base, document_mask=False)
  batch = _batch(base.vocab_size)

  def logits(config, segments):
    graphdef, state = nnx.split(GPT(config, rngs=nnx.Rngs(0)))
    return jax.jit(lambda s: nnx.merge(graphdef, s)(batch["inputs"], batch["positions"], segments))(state)

  one_document = np.ones_like(batch["segment_ids"])
  expected = logits(base, one_document)
  chex.assert_trees_all_close(logits(plain, batch["segment_ids"]), expected, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(logits(dataclasses.replace(plain, attention="jax"), batch["segment_ids"]), expected,
                              rtol=1e-5, atol=1e-5)
  assert not np.allclose(logits(base, batch["segment_ids"]), expected, atol=1e-3)


def test_causal_block_attention_is_refused_for_a_bidirectional_encoder():
  from jaxlm.models.layers import Attention  # noqa: PLC0415
  from jaxlm.precision import Policy  # noqa: PLC0415
  with pytest.raises(ValueError, match="attention=causal_blocks .* not causal: use attention=xla"):
    Attention(32, 4, 4, Policy(), 0.02, 0.02, implementation="causal_blocks", rngs=nnx.Rngs(0))


def test_causal_block_attention_needs_self_attention():
  from jaxlm.models.attention import causal_block_attention  # noqa: PLC0415
  from jaxlm.precision import Policy  # noqa: PLC0415
  q, kv = jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 6, 2, 8))
  with pytest.raises(ValueError, match="as many keys as queries"):
    causal_block_attention(q, kv, kv, jnp.ones((1, 4, 6), bool), Policy(), 2)


@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2", "llama"])
def test_unrolled_layer_scan_equals_rolled(base):
  config = dataclasses.replace(base, scan_unroll=2)
  chex.assert_trees_all_close(_loss_value_and_grads(config), _loss_value_and_grads(base), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2", "llama"])
def test_layer_loop_equals_layer_scan(base):
  """scan_layers=False: loss and every gradient of the stacked parameters as under the scan."""
  config = dataclasses.replace(base, scan_layers=False)
  chex.assert_trees_all_close(_loss_value_and_grads(config), _loss_value_and_grads(base), rtol=1e-5, atol=1e-6)


def test_layer_loop_equals_layer_scan_for_the_bert_encoder():
  from jaxlm.models.bert import Bert  # noqa: PLC0415
  config = dataclasses.replace(TINY, flavour="bert", d_ff=48, layer_norm_eps=1e-12)
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 8)), jnp.int32)
  mask = jnp.asarray([[1] * 8, [1] * 5 + [0] * 3], jnp.int32)
  hidden = [Bert(dataclasses.replace(config, scan_layers=scan), rngs=nnx.Rngs(0))(ids, mask) for scan in (True, False)]
  chex.assert_trees_all_close(hidden[1], hidden[0], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
def test_cudnn_attention_close_to_xla_attention_in_bf16():
  config = dataclasses.replace(LLAMA, compute_dtype="bfloat16", d_model=64, num_heads=4)  # head_dim 16
  for config in (config, dataclasses.replace(config, document_mask=False)):  # with a mask tensor, and with none
    reference, cudnn = _logits(config), _logits(dataclasses.replace(config, attention="cudnn"))
    assert float(jnp.max(jnp.abs(cudnn - reference))) < 0.05 * float(jnp.max(jnp.abs(reference)))


def _mesh_step(model, data_devices):
  from jaxlm import hlo, optim, sharding  # noqa: PLC0415
  from jaxlm.config import Config, DataConfig, MeshConfig, TrainConfig  # noqa: PLC0415
  config = Config(model=model, mesh=MeshConfig(data=data_devices), data=DataConfig(seq_len=16),
                  train=TrainConfig(steps=10, batch_size=4, warmup_steps=1))
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:data_devices])
  optimizer = optim.make_optimizer(config.train)
  graphdef, state, shardings = train.init_train_state(config, mesh, optimizer)
  train_step, _ = train.jit_steps(graphdef, optimizer, config, mesh, shardings)
  batch = train.to_global_batch(_batch(model.vocab_size, b=4), mesh)
  compiled = train_step.lower(state, batch).compile()
  _, metrics = compiled(state, batch)
  return jax.device_get(metrics), hlo.collective_bytes(compiled.as_text(), data_devices)


@pytest.mark.parametrize("scatter", [True, False], ids=["scatter_form", "one_hot_form"])
def test_fused_cross_entropy_on_a_data_parallel_mesh_keeps_tokens_on_their_devices(scatter, monkeypatch):
  """On 4 data-parallel devices each device runs the chunks of its own tokens: no hidden states are all-gathered
  (chunking the flat token axis did: every device then computed every chunk), the table gradient is reduced once
  (same collective bytes as the logits path), and loss and gradient norm equal one device's. Both gradient forms:
  an un-vmapped scatter all-gathered here."""
  monkeypatch.setattr(cross_entropy, "_use_scatter_gradient", lambda: scatter)
  fused = dataclasses.replace(TINY, cross_entropy_chunk=12)  # 16 tokens per device: 2 chunks, padded
  reference, reference_traffic = _mesh_step(TINY, 4)
  got, traffic = _mesh_step(fused, 4)
  one_device, _ = _mesh_step(fused, 1)
  assert traffic["all-gather"] == 0 and traffic["total"] <= reference_traffic["total"] * 1.01, traffic
  for metrics in (reference, one_device):
    np.testing.assert_allclose(got["loss"], metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], metrics["grad_norm"], rtol=1e-4)
