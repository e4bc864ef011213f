"""kernels.matmul=fp8 on the CPU (ml_dtypes' float8 types run there; the cuBLASLt GEMMs need an H100/H200,
benchmarks/gpu_checks.sh: ab_fp8): the fp8 einsum is within e4m3's rounding of the exact product and its gradients
within e5m2's, yet not equal to bf16 (it quantizes); its HLO holds the float8 converts XLA:GPU turns into fp8 GEMMs;
a tiny Llama trains with it as with bf16 matmuls; what stays off fp8 (stand-ins, f32-result contractions); and on a
CPU, or a GPU without fp8 tensor cores, the choice is the registry's one-line error. Seconds on a CPU."""

import dataclasses
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxlm import kernels as kernels_lib
from jaxlm.config import KernelsConfig, ModelConfig
from jaxlm.kernels import Kernels, fp8, xla
from jaxlm.models.gpt import GPT
from jaxlm.training import steps as steps_lib

SUBSCRIPTS = "btd,df->btf"
E4M3 = 2.0 ** -4  # e4m3 rounds to 3 mantissa bits: a relative error of at most 2^-4 per value
E5M2 = 2.0 ** -3  # e5m2: 2 mantissa bits


def _operands(seed=0):
  kx, kw, kg = jax.random.split(jax.random.key(seed), 3)
  x = jax.random.normal(kx, (4, 16, 64), jnp.float32).astype(jnp.bfloat16)
  w = (0.05 * jax.random.normal(kw, (64, 48), jnp.float32)).astype(jnp.bfloat16)
  g = jax.random.normal(kg, (4, 16, 48), jnp.float32)
  return x, w, g


def _relative_error(got, want) -> float:
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def test_the_forward_is_within_e4m3_rounding_of_the_exact_product_and_not_bf16s():
  x, w, _ = _operands()
  exact = jnp.einsum(SUBSCRIPTS, x.astype(jnp.float32), w.astype(jnp.float32))
  got = jax.jit(fp8.einsum, static_argnums=0)(SUBSCRIPTS, x, w)
  assert got.dtype == jnp.bfloat16 and got.shape == exact.shape
  # Both operands rounded to 3 mantissa bits: more than bf16's error, less than e4m3's largest per value.
  assert 4 * _relative_error(jnp.einsum(SUBSCRIPTS, x, w), exact) < _relative_error(got, exact) < E4M3
  assert not np.array_equal(np.asarray(got), np.asarray(jnp.einsum(SUBSCRIPTS, x, w)))


def test_gradients_are_within_e5m2_rounding_of_the_exact_ones():
  x, w, g = _operands()

  def gradients(einsum, x, w):
    return jax.jit(jax.grad(lambda x, w: jnp.sum(einsum(SUBSCRIPTS, x, w).astype(jnp.float32) * g), (0, 1)))(x, w)

  exact = gradients(jnp.einsum, x.astype(jnp.float32), w.astype(jnp.float32))
  got = gradients(fp8.einsum, x, w)
  for got_grad, exact_grad, operand in zip(got, exact, (x, w)):
    assert got_grad.dtype == operand.dtype
    assert 0 < _relative_error(got_grad, exact_grad) < E5M2


def test_quantization_uses_power_of_two_scales_and_keeps_zeros_and_the_largest_value():
  x, _, _ = _operands()
  q, s = fp8.quantize(x, fp8.FORWARD)
  assert q.dtype == jnp.float8_e4m3fn and s.dtype == x.dtype
  assert float(s) == 2.0 ** round(np.log2(float(s)))  # a power of two
  assert 224 < float(jnp.max(jnp.abs(q.astype(jnp.float32)))) <= 448  # at most one bit of range unused
  q0, s0 = fp8.quantize(jnp.zeros((8,), jnp.bfloat16), fp8.FORWARD)
  assert float(s0) > 0 and not jnp.any(q0.astype(jnp.float32))
  assert not jnp.any(jnp.isnan(fp8.einsum(SUBSCRIPTS, jnp.zeros_like(x), _operands()[1])))


def test_the_hlo_holds_the_float8_converts_the_gpu_rewrites_into_fp8_gemms():
  x, w, g = _operands()
  forward = jax.jit(fp8.einsum, static_argnums=0).lower(SUBSCRIPTS, x, w).as_text()
  assert forward.count("-> tensor<4x16x64xf8E4M3FN>") == 1 and forward.count("-> tensor<64x48xf8E4M3FN>") == 1
  assert "f8E5M2" not in forward
  backward = jax.jit(jax.grad(lambda x, w: jnp.sum(fp8.einsum(SUBSCRIPTS, x, w).astype(jnp.float32) * g),
                              (0, 1))).lower(x, w).as_text()
  assert "-> tensor<4x16x48xf8E5M2>" in backward  # the output gradient


TINY_LLAMA = ModelConfig(vocab_size=96, num_layers=2, d_model=32, num_heads=4, max_seq_len=32, flavour="llama",
                         num_kv_heads=2, d_ff=64, tie_embeddings=False, compute_dtype="bfloat16")
# Near what `resolve` picks on a GPU (chunked cross-entropy, fused q/k/v), with XLA attention and the layer scan.
GPU_KERNELS = Kernels(cross_entropy="chunked", cross_entropy_chunk=16, fuse_qkv="fused")


def _batch(vocab, b=4, t=16):
  tokens = np.random.default_rng(1).integers(0, vocab, (b, t + 1)).astype(np.int32)
  return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((b, t), np.int32),
          "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)), "loss_mask": np.ones((b, t), np.float32)}


def _train(kernels: Kernels, steps: int = 12) -> tuple[list[float], str]:
  """Losses per token of `steps` Adam steps on one batch (memorising it), and the step's StableHLO."""
  graphdef, state = nnx.split(GPT(TINY_LLAMA, kernels, rngs=nnx.Rngs(0)))
  params = state.to_pure_dict()
  loss_fn = steps_lib.make_loss_fn(graphdef)
  optimizer = optax.adam(3e-3)
  batch = _batch(TINY_LLAMA.vocab_size)

  @jax.jit
  def step(params, opt_state):
    (loss, (tokens, _)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, batch)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss / tokens

  opt_state = optimizer.init(params)
  losses = []
  for _ in range(steps):
    params, opt_state, loss = step(params, opt_state)
    losses.append(float(loss))
  return losses, step.lower(params, opt_state).as_text()


def test_a_tiny_llama_trains_with_fp8_matmuls_as_with_bf16():
  bf16, bf16_hlo = _train(GPU_KERNELS)
  fp8_losses, fp8_hlo = _train(dataclasses.replace(GPU_KERNELS, matmul="fp8"))
  assert "f8E4M3FN" not in bf16_hlo and "f8E4M3FN" in fp8_hlo and "f8E5M2" in fp8_hlo
  assert bf16[-1] < 0.8 * bf16[0]  # it learns
  assert fp8_losses[0] != bf16[0]  # the fp8 run really quantizes
  np.testing.assert_allclose(fp8_losses, bf16, rtol=0.01)


class _StandIn:
  """A weight that is not a plain array: records the matmul it is handed."""
  shape, ndim, dtype = (64, 48), 2, jnp.bfloat16

  def __init__(self, w):
    self.w, self.matmul = w, None

  def contract(self, subscripts, x, matmul, **kwargs):
    self.matmul = matmul
    return matmul(subscripts, x, self.w, **kwargs)

  def lookup(self, ids):
    return jnp.take(self.w, ids, axis=0)


def test_stand_ins_and_f32_results_keep_the_reference_matmul():
  x, w, _ = _operands()
  kernels = Kernels(matmul="fp8")
  stand_in = _StandIn(w)
  np.testing.assert_array_equal(kernels.einsum(SUBSCRIPTS, x, stand_in), jnp.einsum(SUBSCRIPTS, x, w))
  assert stand_in.matmul is xla.einsum
  logits = kernels.einsum(SUBSCRIPTS, x, w, preferred_element_type=jnp.float32)  # the output head's logits
  np.testing.assert_array_equal(logits, jnp.einsum(SUBSCRIPTS, x, w, preferred_element_type=jnp.float32))
  np.testing.assert_array_equal(kernels.einsum(SUBSCRIPTS, x, w), fp8.einsum(SUBSCRIPTS, x, w))


def _one_line_error(**kwargs) -> str:
  kwargs.setdefault("compute_dtype", "bfloat16")
  with pytest.raises(ValueError) as error:
    kernels_lib.resolve(KernelsConfig(matmul="fp8"), devices=1, **kwargs)
  assert "\n" not in str(error.value)
  return str(error.value)


def test_on_a_cpu_or_a_gpu_without_fp8_tensor_cores_the_choice_is_a_one_line_error(monkeypatch):
  assert jax.default_backend() == "cpu"
  assert _one_line_error() == "kernels.matmul=fp8 runs on gpu, not cpu; here use one of: auto, xla"
  assert "computes in bfloat16, not model.compute_dtype=float32" in _one_line_error(platform="gpu",
                                                                                    compute_dtype="float32")
  # Planning for a GPU from a CPU: fp8 resolves (this machine's hardware is not the target's).
  assert kernels_lib.resolve(KernelsConfig(matmul="fp8"), compute_dtype="bfloat16", platform="gpu",
                             devices=1).matmul == "fp8"
  # On an A100 (8.0) itself: no fp8 tensor cores.
  a100 = types.SimpleNamespace(client=types.SimpleNamespace(platform_version="cuda 12080"),
                               compute_capability="8.0", platform="gpu")
  monkeypatch.setattr(jax, "devices", lambda *_: [a100])
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  reason = "needs fp8 tensor cores, compute capability >= 8.9 (Ada, Hopper); this GPU has compute capability 8.0"
  assert fp8.unavailable() == reason
  assert _one_line_error(platform="gpu") == f"kernels.matmul=fp8 {reason}; here use one of: auto, xla"
  monkeypatch.setattr(a100, "compute_capability", "9.0")  # an H100
  assert fp8.unavailable() is None
