"""The kernel registry: `auto` resolves to the tested implementation for the platform, dtype and mesh (with and
without a C++ compiler), a wrong explicit choice is a one-line error, and every implementation computes the same
function as the reference (`Kernels()`: einsum attention, XLA matmuls, [B, T, V] logits + optax, separate q/k/v,
a rolled layer scan, no remat): BLAS matmuls, the chunked cross-entropy, fused q/k/v, the unrolled scan and the
layer loop, remat, and the block-causal, fused CPU, recompute and jax.nn attention paths on packed documents.
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

from jaxlm import kernels as kernels_lib
from jaxlm.config import KernelsConfig, ModelConfig
from jaxlm.kernels import Kernels, cpu, cross_entropy
from jaxlm.kernels.attention import causal_block_attention, dot_product_attention, recompute_attention
from jaxlm.kernels.cross_entropy import fused_cross_entropy
from jaxlm.models.gpt import GPT
from jaxlm.models.masks import causal_mask, padding_mask
from jaxlm.recipes import features as features_lib
from jaxlm.training import steps as steps_lib

TINY = ModelConfig(vocab_size=96, num_layers=2, d_model=32, num_heads=4, max_seq_len=32, compute_dtype="float32")
LLAMA = dataclasses.replace(TINY, flavour="llama", num_kv_heads=2, d_ff=48, tie_embeddings=False)
REF = Kernels()  # the reference of every op
NEEDS_COMPILER = pytest.mark.skipif(cpu.compiler() is None, reason="the CPU kernels need a C++ compiler (g++)")


# ----------------------------------------------------------------------------------------------- resolution


def _resolve(**kwargs) -> Kernels:
  kwargs.setdefault("compute_dtype", "float32")
  kwargs.setdefault("devices", 1)
  return kernels_lib.resolve(KernelsConfig(**kwargs.pop("config", {})), **kwargs)


@NEEDS_COMPILER
def test_auto_on_one_cpu_device_picks_the_cpu_kernels():
  k = _resolve(platform="cpu")
  assert (k.attention, k.matmul, k.cross_entropy, k.fuse_qkv, k.layers, k.remat) == (
      "cpu_fused", "blas", "chunked", "fused", "scan", "dots")


def test_auto_without_a_compiler_or_on_a_mesh_or_in_bf16_keeps_to_xla(monkeypatch):
  for k in (_resolve(platform="cpu", devices=4), _resolve(platform="cpu", compute_dtype="bfloat16")):
    assert (k.attention, k.matmul) == ("causal_blocks", "xla"), k
  monkeypatch.setattr(cpu, "compiler", lambda: None)
  k = _resolve(platform="cpu")
  assert (k.attention, k.matmul, k.cross_entropy) == ("causal_blocks", "xla", "chunked")
  assert _resolve(platform="cpu", devices=4).remat == "none"  # a recomputed forward would regather FSDP shards


def test_auto_for_an_encoder_and_for_tensor_parallelism():
  assert _resolve(platform="cpu", causal=False).attention == "xla"  # the causal-block kernels skip keys
  assert _resolve(platform="cpu", devices=2, tensor=2).fuse_qkv == "separate"


def test_auto_on_a_gpu_picks_cudnn_in_bf16_and_the_layer_loop():
  k = _resolve(platform="gpu", compute_dtype="bfloat16", head_dim=64)
  assert (k.attention, k.matmul, k.layers, k.remat, k.cross_entropy_chunk) == ("cudnn", "xla", "loop", "none", 4096)
  assert _resolve(platform="gpu").attention == "xla"  # cuDNN's flash kernel takes no float32
  assert _resolve(platform="gpu", compute_dtype="bfloat16", head_dim=100).attention == "xla"  # nor heads of 100


def test_recomputation_runs_in_a_scan_never_in_a_python_loop():
  """XLA schedules an unrolled loop's recomputed blocks beside the forward pass, so nothing is freed
  (docs/performance.md): remat implies the scan, and a loop recomputes nothing."""
  assert _resolve(platform="gpu", compute_dtype="bfloat16", config={"remat": "full"}).layers == "scan"
  assert _resolve(platform="cpu", config={"layers": "loop"}).remat == "none"
  with pytest.raises(ValueError, match="kernels.layers=loop cannot recompute .* use kernels.layers=scan"):
    kernels_lib.resolve(KernelsConfig(layers="loop", remat="full"))


def test_auto_on_a_tpu_keeps_to_the_references():
  k = _resolve(platform="tpu", compute_dtype="bfloat16")
  assert (k.attention, k.matmul, k.cross_entropy, k.fuse_qkv, k.remat) == ("xla", "xla", "logits", "separate", "none")


def test_names_come_from_the_registry():
  with pytest.raises(ValueError, match="kernels.attention='flash' is not one of auto, xla, causal_blocks"):
    kernels_lib.resolve(KernelsConfig(attention="flash"))
  with pytest.raises(ValueError, match="kernels.remat='some' is not one of auto, none, full, dots"):
    kernels_lib.resolve(KernelsConfig(remat="some"))


def test_auto_on_the_default_backend_inside_a_model():
  model = GPT(TINY, rngs=nnx.Rngs(0))
  assert model.kernels == kernels_lib.resolve(compute_dtype=TINY.compute_dtype, causal=True)
  assert "auto" not in model.kernels.describe()


@pytest.mark.parametrize("config, kwargs, message", [
    ({"attention": "cpu_fused"}, {"platform": "gpu"},
     "kernels.attention=cpu_fused runs on cpu, not gpu; here use one of: auto, xla, causal_blocks, recompute, jax"),
    ({"matmul": "blas"}, {"platform": "cpu", "compute_dtype": "bfloat16"},
     "kernels.matmul=blas computes in float32, not model.compute_dtype=bfloat16; here use one of: auto, xla"),
    ({"attention": "cudnn"}, {"platform": "cpu"}, "kernels.attention=cudnn runs on gpu, not cpu"),
    ({"matmul": "blas"}, {"platform": "cpu", "devices": 4},
     "cannot be partitioned: XLA would run it whole on each of the 4 devices; here use one of: auto, xla"),
    ({"attention": "causal_blocks"}, {"platform": "cpu", "causal": False}, "needs a causal model"),
])
def test_an_impossible_explicit_choice_is_a_one_line_error(config, kwargs, message):
  with pytest.raises(ValueError) as error:
    _resolve(config=config, **kwargs)
  assert message in str(error.value) and "\n" not in str(error.value), str(error.value)


# ----------------------------------------------------------------------------------------------- equivalence


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
def _loss_value_and_grads(config, kernels=REF):
  graphdef, state = nnx.split(GPT(config, kernels, rngs=nnx.Rngs(0)))
  loss_fn = steps_lib.make_loss_fn(graphdef)
  grad_fn = jax.jit(jax.value_and_grad(loss_fn, has_aux=True))
  return grad_fn(state.to_pure_dict(), _batch(config.vocab_size))


@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2_tied", "llama_untied"])
def test_train_loss_with_fused_cross_entropy_equals_logits_path(base):
  """The loss sum, token count, accuracy and every parameter gradient of make_loss_fn are the same."""
  expected = _loss_value_and_grads(base)
  got = _loss_value_and_grads(base, Kernels(cross_entropy="chunked", cross_entropy_chunk=12))  # 32 tokens: 3 chunks
  chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2_biases", "llama_gqa"])
def test_fused_qkv_projection_equals_three_projections(base):
  chex.assert_trees_all_close(_loss_value_and_grads(base, Kernels(fuse_qkv="fused")),
                              _loss_value_and_grads(base), rtol=1e-5, atol=1e-6)


@NEEDS_COMPILER
@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2_tied", "llama_untied"])
def test_blas_matmuls_equal_xla_matmuls(base):
  """kernels.matmul=blas (every weight matmul one OpenBLAS sgemm custom call) against XLA's dots (another
  summation order: gradients near zero differ by ~1e-6)."""
  chex.assert_trees_all_close(_loss_value_and_grads(base, Kernels(matmul="blas")),
                              _loss_value_and_grads(base), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("matmul, attention", [("xla", "causal_blocks"),
                                               pytest.param("blas", "causal_blocks", marks=NEEDS_COMPILER),
                                               pytest.param("blas", "cpu_fused", marks=NEEDS_COMPILER)])
def test_cpu_bench_options_together_equal_the_reference(matmul, attention):
  """The combination `auto` picks on one CPU device (what benchmarks/configs/bench_cpu.py runs): fused q/k/v,
  block-causal attention (einsums or the fused C++ kernel), remat=dots (recompute elementwise ops, keep matmul
  outputs) inside the layer scan and the chunked cross-entropy, with XLA's or BLAS matmuls: loss, token accuracy
  and every gradient."""
  kernels = Kernels(fuse_qkv="fused", attention=attention, attention_block=8, remat="dots",
                    cross_entropy="chunked", cross_entropy_chunk=8, matmul=matmul)
  chex.assert_trees_all_close(_loss_value_and_grads(TINY, kernels), _loss_value_and_grads(TINY), rtol=1e-5,
                              atol=1e-5 if matmul == "blas" else 1e-6)


@functools.lru_cache(maxsize=None)
def _logits(config, kernels=REF):
  graphdef, state = nnx.split(GPT(config, kernels, rngs=nnx.Rngs(0)))
  batch = _batch(config.vocab_size)
  apply = jax.jit(lambda s: nnx.merge(graphdef, s)(batch["inputs"], batch["positions"], batch["segment_ids"]))
  return apply(state)


@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2_mha", "llama_gqa"])
def test_jax_nn_attention_equals_einsum_attention_on_packed_documents(base):
  chex.assert_trees_all_close(_logits(base, Kernels(attention="jax")), _logits(base),
                              rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block", [4, 7, 16])  # divides T=16; leaves a short last block; one block
@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2_mha", "llama_gqa"])
@pytest.mark.parametrize("attention", ["causal_blocks", pytest.param("cpu_fused", marks=NEEDS_COMPILER)])
def test_causal_block_attention_equals_einsum_attention(base, block, attention):
  """Loss and every gradient, on rows of two packed documents (the document mask inside the causal one), for the
  einsum blocks and the fused C++ kernel (tests/test_cpu_attention.py tests the kernel alone)."""
  kernels = Kernels(attention=attention, attention_block=block)
  chex.assert_trees_all_close(_loss_value_and_grads(base, kernels), _loss_value_and_grads(base), rtol=1e-5,
                              atol=1e-6)


def test_causal_block_attention_gradients_in_bf16_and_f32():
  """Its hand-written backward pass on grouped heads and two packed documents: f32 equal to the einsum reference,
  bf16 inputs within bf16 rounding of it."""
  rng = np.random.default_rng(5)
  q, k, v, w = (jnp.asarray(rng.standard_normal((2, 12, 4, 8)), jnp.float32) for _ in range(4))
  k, v = k[:, :, :2], v[:, :, :2]  # 2 key/value heads for 4 query heads
  mask = causal_mask(jnp.asarray([[1] * 5 + [2] * 7, [1] * 12]))

  def grads(attend, dtype):
    loss = lambda q, k, v: jnp.sum(attend(q.astype(dtype), k.astype(dtype), v.astype(dtype)).astype(jnp.float32) * w)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

  reference = grads(lambda q, k, v: dot_product_attention(q, k, v, mask), jnp.float32)
  chex.assert_trees_all_close(grads(lambda q, k, v: causal_block_attention(q, k, v, mask, 5), jnp.float32),
                              reference, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(grads(lambda q, k, v: causal_block_attention(q, k, v, mask, 5), jnp.bfloat16),
                              reference, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2_mha", "llama_gqa"])
def test_recompute_attention_equals_einsum_attention(base):
  """Its hand-written backward pass (probabilities rebuilt from the saved log-sum-exp) gives every gradient."""
  chex.assert_trees_all_close(_loss_value_and_grads(base, Kernels(attention="recompute")),
                              _loss_value_and_grads(base), rtol=1e-5, atol=1e-6)


def test_recompute_attention_gradients_with_padding_and_bf16():
  """Bidirectional attention over padded keys (BERT's mask, a fully padded row included) in f32, and bf16 inputs
  within bf16 rounding of the f32 reference."""
  rng = np.random.default_rng(3)
  q, k, v, w = (jnp.asarray(rng.standard_normal((2, 6, 4, 8)), jnp.float32) for _ in range(4))
  k, v = k[:, :, :2], v[:, :, :2]  # 2 key/value heads for 4 query heads
  mask = padding_mask(jnp.asarray([[1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]]), 6)

  def grads(attend, dtype):
    loss = lambda q, k, v: jnp.sum(attend(q.astype(dtype), k.astype(dtype), v.astype(dtype)).astype(jnp.float32) * w)
    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2)))(q, k, v)

  reference = grads(lambda q, k, v: dot_product_attention(q, k, v, mask), jnp.float32)
  chex.assert_trees_all_close(grads(lambda q, k, v: recompute_attention(q, k, v, mask), jnp.float32), reference,
                              rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(grads(lambda q, k, v: recompute_attention(q, k, v, mask), jnp.bfloat16), reference,
                              rtol=5e-2, atol=5e-2)


def test_recompute_attention_saves_no_probabilities():
  """The residuals of a 2-layer GPT at T=32: the reference keeps [B, H, T, T] probabilities per layer, recompute
  only a [B, H, T] log-sum-exp, as cuDNN's flash kernel does (jaxlm.planner.estimates counts what each saves)."""
  from jaxlm.planner import estimates  # noqa: PLC0415
  reference = estimates.saved_activation_bytes(TINY, REF, 32, 1, 2)
  recompute = estimates.saved_activation_bytes(TINY, Kernels(attention="recompute"), 32, 1, 2)
  probabilities = TINY.num_layers * 2 * TINY.num_heads * 32 * 32 * 4  # f32 [B, H, T, T] per layer
  assert reference - recompute >= 0.9 * probabilities, (reference, recompute, probabilities)


@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2_mha", "llama_gqa"])
def test_without_document_mask_rows_attend_across_documents_on_every_path(base):
  """document_mask=False is plain causal attention over the row: the same logits as the document-masked model fed
  the row as one document, different from it on packed documents; jax.nn's path then gets no mask tensor
  (is_causal alone), and agrees with the einsum path."""
  plain = dataclasses.replace(base, document_mask=False)
  batch = _batch(base.vocab_size)

  def logits(config, segments, kernels=REF):
    graphdef, state = nnx.split(GPT(config, kernels, rngs=nnx.Rngs(0)))
    return jax.jit(lambda s: nnx.merge(graphdef, s)(batch["inputs"], batch["positions"], segments))(state)

  one_document = np.ones_like(batch["segment_ids"])
  expected = logits(base, one_document)
  chex.assert_trees_all_close(logits(plain, batch["segment_ids"]), expected, rtol=1e-5, atol=1e-5)
  chex.assert_trees_all_close(logits(plain, batch["segment_ids"], Kernels(attention="jax")), expected,
                              rtol=1e-5, atol=1e-5)
  assert not np.allclose(logits(base, batch["segment_ids"]), expected, atol=1e-3)


def test_causal_block_attention_is_refused_for_a_bidirectional_encoder():
  from jaxlm.models.bert import Bert  # noqa: PLC0415
  config = dataclasses.replace(TINY, flavour="bert")
  with pytest.raises(ValueError, match="kernels.attention=causal_blocks .* not causal: use kernels.attention=auto"):
    Bert(config, Kernels(attention="causal_blocks"), rngs=nnx.Rngs(0))(jnp.ones((1, 4), jnp.int32))


def test_causal_block_attention_needs_self_attention():
  q, kv = jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 6, 2, 8))
  with pytest.raises(ValueError, match="as many keys as queries"):
    causal_block_attention(q, kv, kv, jnp.ones((1, 4, 6), bool), 2)


@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2", "llama"])
def test_unrolled_layer_scan_equals_rolled(base):
  chex.assert_trees_all_close(_loss_value_and_grads(base, Kernels(scan_unroll=2)), _loss_value_and_grads(base),
                              rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("base", [TINY, LLAMA], ids=["gpt2", "llama"])
def test_layer_loop_equals_layer_scan(base):
  """kernels.layers=loop: loss and every gradient of the stacked parameters as under the scan."""
  chex.assert_trees_all_close(_loss_value_and_grads(base, Kernels(layers="loop")), _loss_value_and_grads(base),
                              rtol=1e-5, atol=1e-6)


def test_layer_loop_equals_layer_scan_for_the_bert_encoder():
  from jaxlm.models.bert import Bert  # noqa: PLC0415
  config = dataclasses.replace(TINY, flavour="bert", d_ff=48, layer_norm_eps=1e-12)
  ids = jnp.asarray(np.random.default_rng(0).integers(0, 96, (2, 8)), jnp.int32)
  mask = jnp.asarray([[1] * 8, [1] * 5 + [0] * 3], jnp.int32)
  hidden = [Bert(config, Kernels(layers=layers), rngs=nnx.Rngs(0))(ids, mask) for layers in ("scan", "loop")]
  chex.assert_trees_all_close(hidden[1], hidden[0], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN attention needs an NVIDIA GPU")
def test_cudnn_attention_close_to_xla_attention_in_bf16():
  config = dataclasses.replace(LLAMA, compute_dtype="bfloat16", d_model=64, num_heads=4)  # head_dim 16
  for config in (config, dataclasses.replace(config, document_mask=False)):  # with a mask tensor, and with none
    reference, cudnn = _logits(config), _logits(config, Kernels(attention="cudnn"))
    assert float(jnp.max(jnp.abs(cudnn - reference))) < 0.05 * float(jnp.max(jnp.abs(reference)))


def _mesh_step(model, kernels, data_devices):
  from jaxlm.config import Config, DataConfig, MeshConfig, TrainConfig  # noqa: PLC0415
  from jaxlm.parallel import sharding
  from jaxlm.planner import hlo_traffic  # noqa: PLC0415
  from jaxlm.training import optim
  config = Config(model=model, kernels=kernels.as_config(), mesh=MeshConfig(data=data_devices),
                  data=DataConfig(seq_len=16), train=TrainConfig(steps=10, batch_size=4, warmup_steps=1))
  mesh = sharding.make_mesh(config.mesh, jax.devices()[:data_devices])
  optimizer = optim.make_optimizer(config.train)
  graphdef, state, shardings, features = features_lib.train_state_from_config(
      config, mesh, optimizer, features_lib.decoder_factory(config, mesh))
  train_step, _ = steps_lib.jit_steps(graphdef, optimizer, config, mesh, shardings, features)
  batch = steps_lib.to_global_batch(_batch(model.vocab_size, b=4), mesh)
  compiled = train_step.lower(state, batch).compile()
  _, metrics = compiled(state, batch)
  return jax.device_get(metrics), hlo_traffic.collective_bytes(compiled.as_text(), data_devices)


@functools.cache
def _reference_mesh_step():  # the logits path on 4 devices: the same for both gradient forms, run once
  return _mesh_step(TINY, REF, 4)


@pytest.mark.parametrize("scatter", [True, False], ids=["scatter_form", "one_hot_form"])
def test_fused_cross_entropy_on_a_data_parallel_mesh_keeps_tokens_on_their_devices(scatter, monkeypatch):
  """On 4 data-parallel devices each device runs the chunks of its own tokens: no hidden states are all-gathered
  (chunking the flat token axis did: every device then computed every chunk), the table gradient is reduced once
  (same collective bytes as the logits path), and loss and gradient norm equal one device's. Both gradient forms:
  an un-vmapped scatter all-gathered here."""
  monkeypatch.setattr(cross_entropy, "_use_scatter_gradient", lambda: scatter)
  fused = Kernels(cross_entropy="chunked", cross_entropy_chunk=12)  # 16 tokens per device: 2 chunks, padded
  reference, reference_traffic = _reference_mesh_step()
  got, traffic = _mesh_step(TINY, fused, 4)
  one_device, _ = _mesh_step(TINY, fused, 1)
  assert traffic["all-gather"] == 0 and traffic["total"] <= reference_traffic["total"] * 1.01, traffic
  for metrics in (reference, one_device):
    np.testing.assert_allclose(got["loss"], metrics["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["grad_norm"], metrics["grad_norm"], rtol=1e-4)
