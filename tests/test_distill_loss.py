"""The distillation loss: the reference equals TRL's own generalized_jsd_loss (beta 0, 1 and between, temperature 1
and 2, masked tokens), and the fused chunked kernel equals the reference with the cross-entropy mixed in, in value and
gradient (chunks that do and do not divide the tokens, both forms of the cross-entropy gradient, soft caps, bf16, a
4-device mesh, an int8 teacher table), without [N, V] logits in its compiled memory. Tiny shapes: seconds on a CPU."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxlm.config import MeshConfig
from jaxlm.kernels import Kernels, cross_entropy
from jaxlm.kernels.distillation import distillation_sums, reference_sums
from jaxlm.parallel import sharding
from jaxlm.training.distill_loss import generalized_jsd, loss_beta, token_divergence

N, D, V = 40, 16, 50


def _inputs(n=N, d=D, v=V, seed=0, dtype=jnp.float32):
  """(student x, student table, teacher x, teacher table, targets, weights): a wider teacher, some tokens masked
  out."""
  rng = np.random.default_rng(seed)
  e = d + 8
  arrays = [jnp.asarray(rng.standard_normal(shape), dtype) for shape in ((n, d), (v, d), (n, e), (v, e))]
  return (*arrays, jnp.asarray(rng.integers(0, v, n), jnp.int32), jnp.asarray(rng.random(n) > 0.2, jnp.float32))


def test_loss_names_map_to_trl_betas():
  assert (loss_beta("forward_kl", 0.5), loss_beta("reverse_kl", 0.5), loss_beta("jsd", 0.3)) == (0.0, 1.0, 0.3)
  for loss, beta, message in (("kl", 0.5, "unknown distillation loss 'kl'"), ("jsd", 1.0, "strictly between")):
    with pytest.raises(ValueError, match=message) as error:
      loss_beta(loss, beta)
    assert "\n" not in str(error.value)


@pytest.mark.filterwarnings("ignore::UserWarning")  # trl.experimental warns that it is experimental
def test_generalized_jsd_equals_trl_within_1e_5():
  torch = pytest.importorskip("torch")
  from trl.experimental.gkd.gkd_trainer import GKDTrainer  # noqa: PLC0415

  rng = np.random.default_rng(1)
  student, teacher = (3 * rng.standard_normal((3, 7, 60)).astype(np.float32) for _ in range(2))
  mask = rng.random((3, 7)) > 0.3
  labels = torch.tensor(np.where(mask, 1, -100))
  for beta in (0.0, 0.1, 0.5, 0.9, 1.0):
    for temperature in (1.0, 2.0):
      expected = GKDTrainer.generalized_jsd_loss(torch.tensor(student), torch.tensor(teacher), labels, beta=beta,
                                                 temperature=temperature).item()
      got = generalized_jsd(jnp.asarray(student), jnp.asarray(teacher), jnp.asarray(mask), beta=beta,
                            temperature=temperature)
      np.testing.assert_allclose(float(got), expected, rtol=1e-5, atol=1e-5, err_msg=f"{beta=} {temperature=}")
  # Flat [N, V] logits give the same; an empty mask gives 0, as TRL's clamp_min(1).
  flat = generalized_jsd(jnp.asarray(student).reshape(21, 60), jnp.asarray(teacher).reshape(21, 60),
                         jnp.asarray(mask).reshape(21), beta=0.5, temperature=2.0)
  np.testing.assert_allclose(flat, generalized_jsd(jnp.asarray(student), jnp.asarray(teacher), jnp.asarray(mask),
                                                   beta=0.5, temperature=2.0), rtol=1e-6)
  assert float(generalized_jsd(jnp.asarray(student), jnp.asarray(teacher), jnp.zeros((3, 7)), beta=0.5,
                               temperature=1.0)) == 0.0


def _unchunked(sx, st, tx, tt, targets, weights, beta, temperature, alpha):
  """The objective from the public reference and optax: [N, V] logits of both models."""
  logits = jnp.einsum("nd,vd->nv", sx, st, preferred_element_type=jnp.float32)
  teacher = jnp.einsum("nd,vd->nv", tx, tt, preferred_element_type=jnp.float32)
  divergence = token_divergence(logits, jax.lax.stop_gradient(teacher), beta=beta, temperature=temperature)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.sum(((1 - alpha) * divergence + alpha * ce) * weights)


def _value_and_grads(fn, inputs, argnums=(0, 1)):
  return jax.jit(jax.value_and_grad(fn, argnums=argnums))(*inputs)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("temperature, alpha", [(1.0, 0.0), (2.0, 0.3)])
def test_fused_distillation_equals_unchunked_value_and_gradients(beta, temperature, alpha):
  """Chunks of 8 (divide N), 13 (padded) and 64 (one chunk); the teacher's x and table get zero gradients; the
  metrics are the divergence and cross-entropy sums."""
  inputs = _inputs()
  options = {"beta": beta, "temperature": temperature, "alpha": alpha}
  expected = _value_and_grads(lambda *a: _unchunked(*a, **options), inputs)
  for chunk in (8, 13, 64):
    fused = lambda *a, chunk=chunk: distillation_sums(*a, chunk=chunk, **options)["objective"]
    value, grads = _value_and_grads(fused, inputs, argnums=(0, 1, 2, 3))
    chex.assert_trees_all_close((value, grads[:2]), expected, rtol=1e-5, atol=1e-5)
    assert not any(np.any(g) for g in grads[2:])
  metrics = jax.jit(lambda *a: distillation_sums(*a, chunk=13, **options))(*inputs)
  sx, st, _, _, targets, weights = inputs
  for name, alpha_only in (("divergence", 0.0), ("cross_entropy", 1.0)):
    np.testing.assert_allclose(metrics[name], _unchunked(*inputs, beta, temperature, alpha_only), rtol=1e-5)
  logits = sx @ st.T
  np.testing.assert_allclose(metrics["correct"], jnp.sum((jnp.argmax(logits, -1) == targets) * weights))


@pytest.mark.parametrize("scatter", [True, False], ids=["scatter_form", "one_hot_form"])
def test_fused_distillation_with_soft_caps_equals_reference(scatter, monkeypatch):
  """Soft-capped logits of both models (Gemma 2), through either form of the cross-entropy's gradient
  (cross_entropy._dlogits: each platform traces its own)."""
  monkeypatch.setattr(cross_entropy, "_use_scatter_gradient", lambda: scatter)
  options = {"beta": 0.5, "temperature": 2.0, "alpha": 0.3, "student_softcap": 5.0, "teacher_softcap": 4.0}
  inputs = _inputs(seed=2)
  expected = _value_and_grads(lambda *a: reference_sums(*a, **options)["objective"], inputs)
  got = _value_and_grads(lambda *a: distillation_sums(*a, chunk=13, **options)["objective"], inputs)
  chex.assert_trees_all_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_fused_distillation_in_low_precision_is_close_to_f32(dtype):
  """bf16 / float16 hidden states and tables, f32 logits: the f32 reference on the same rounded inputs, to a
  tolerance of the gradients' rounding; gradients come back in the inputs' dtype."""
  options = {"beta": 0.5, "temperature": 2.0, "alpha": 0.3}
  inputs = _inputs(dtype=dtype)
  rounded = tuple(a.astype(jnp.float32) if a.dtype == dtype else a for a in inputs)
  expected_value, expected_grads = _value_and_grads(lambda *a: reference_sums(*a, **options)["objective"], rounded)
  value, grads = _value_and_grads(lambda *a: distillation_sums(*a, chunk=13, **options)["objective"], inputs)
  assert all(g.dtype == dtype for g in grads)
  np.testing.assert_allclose(value, expected_value, rtol=1e-5)
  for got, expected in zip(grads, expected_grads):
    np.testing.assert_allclose(got.astype(jnp.float32), expected, rtol=2e-2, atol=2e-2 * float(jnp.abs(expected).max()))


def test_fused_distillation_on_a_4_device_mesh_equals_one_device():
  """Tokens split over 4 data-parallel devices (10 each: chunks of 4, padded): the same value and gradients as one
  device, and no all-gather (each device runs the chunks of its own tokens)."""
  from jaxlm.planner import hlo_traffic  # noqa: PLC0415

  mesh = sharding.make_mesh(MeshConfig(data=4), jax.devices()[:4])
  inputs = _inputs()
  split, replicated = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*axes))
                       for axes in ((sharding.batch_axes(mesh),), ()))
  placed = tuple(jax.device_put(a, replicated if i in (1, 3) else split) for i, a in enumerate(inputs))  # tables whole
  loss = lambda *a: distillation_sums(*a, beta=0.5, temperature=2.0, alpha=0.3, chunk=4)["objective"]
  step = jax.jit(sharding.traced_on(mesh, jax.value_and_grad(loss, argnums=(0, 1))))
  compiled = step.lower(*placed).compile()
  assert hlo_traffic.collective_bytes(compiled.as_text(), 4)["all-gather"] == 0
  chex.assert_trees_all_close(compiled(*placed), _value_and_grads(loss, inputs), rtol=1e-5, atol=1e-5)


def test_registry_takes_an_int8_teacher_table():
  """`Kernels.distillation_sums` contracts a stand-in teacher table (an int8 teacher) with the registry's einsum,
  and equals the reference on the same weights."""
  from jaxlm.compress.int8 import Int8Weight, quantize_array  # noqa: PLC0415

  sx, st, tx, tt, targets, weights = _inputs(seed=3)
  int8_table = Int8Weight(q=quantize_array(tt, (1,)))
  kernels = Kernels(cross_entropy_chunk=16)
  options = {"beta": 1.0, "temperature": 1.0, "alpha": 0.3}
  objective = lambda fn: lambda a, b: fn(a, b, tx, int8_table, targets, weights, **options)["objective"]
  run = lambda fn: jax.jit(jax.value_and_grad(objective(fn), argnums=(0, 1)))(sx, st)
  expected = run(lambda *a, **o: reference_sums(*a, einsum=kernels.einsum, **o))
  chex.assert_trees_all_close(run(kernels.distillation_sums), expected, rtol=1e-5, atol=1e-5)


def test_compiled_memory_stays_under_the_logits():
  """N x V = 2048 x 4096 (32 MiB of f32 logits per model): the fused program's temporaries stay well under one
  [N, V] f32 array, the unchunked program's exceed it. Compiled, not run."""
  n, v = 2048, 4096
  shapes = [jax.ShapeDtypeStruct(s, jnp.float32) for s in ((n, 32), (v, 32), (n, 32), (v, 32))]
  shapes += [jax.ShapeDtypeStruct((n,), jnp.int32), jax.ShapeDtypeStruct((n,), jnp.float32)]
  options = {"beta": 0.5, "temperature": 2.0, "alpha": 0.3}

  def temp_bytes(fn):
    step = jax.jit(jax.value_and_grad(lambda *a: fn(*a, **options)["objective"], argnums=(0, 1)))
    return step.lower(*shapes).compile().memory_analysis().temp_size_in_bytes

  logits_bytes = n * v * 4
  fused = temp_bytes(lambda *a, **o: distillation_sums(*a, chunk=64, **o))
  assert fused < logits_bytes / 2 < logits_bytes < temp_bytes(reference_sums), (fused, logits_bytes)
