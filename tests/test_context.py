"""Context parallelism: every row's sequence split over `mesh.context` with ring attention trains exactly as one device
does (two packed documents and padding per row, so document masks and positions cross the chunks), alone and with
data and FSDP axes; logits come back in the row's own order; bad settings are one-line errors."""


import jax
import numpy as np
import pytest
from flax import nnx
from test_parallel import _run, single_device  # noqa: F401  (a fixture)
from test_train import MODEL

from jaxlm import kernels as kernels_lib
from jaxlm.config import KernelsConfig, MeshConfig, from_config_dict
from jaxlm.kernels.ring_attention import balanced_order
from jaxlm.models.gpt import GPT
from jaxlm.parallel import sharding


@pytest.mark.parametrize("mesh", [MeshConfig(data=1, context=4), MeshConfig(data=2, context=2),
                                  MeshConfig(data=1, fsdp=2, context=2)], ids=["context4", "data2_context2",
                                                                                "fsdp2_context2"])
def test_ring_attention_training_matches_one_device(single_device, mesh):  # noqa: F811
  ref_losses, ref_metrics, _ = single_device
  losses, metrics, _ = _run(mesh)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"], ref_metrics["grad_norm"], rtol=1e-4)


def test_logits_come_back_in_the_rows_own_order():
  config = MeshConfig(data=1, context=4)
  mesh = sharding.make_mesh(config)
  kernels = kernels_lib.resolve(KernelsConfig(), compute_dtype="float32", mesh=mesh)
  assert kernels.attention == "ring"
  model = GPT(MODEL, kernels, rngs=nnx.Rngs(0))
  reference = GPT(MODEL, kernels_lib.Kernels(), rngs=nnx.Rngs(0))
  ids = jax.random.randint(jax.random.key(1), (2, 16), 0, MODEL.vocab_size)
  graphdef, state = nnx.split(model)
  state, placed_ids = jax.device_put((state, ids), (sharding.replicated(mesh), sharding.batch_sharding(mesh)))
  logits = jax.jit(sharding.traced_on(mesh, lambda state, ids: nnx.merge(graphdef, state)(ids)))(state, placed_ids)
  np.testing.assert_allclose(logits, reference(ids), rtol=1e-5, atol=1e-5)


def test_each_device_holds_an_early_and_a_late_chunk():
  order = balanced_order(16, 4).reshape(4, 4)  # device c's 4 tokens: chunk c, then chunk 7 - c (chunks of 2)
  np.testing.assert_array_equal(order[0], [0, 1, 14, 15])
  np.testing.assert_array_equal(order[3], [6, 7, 8, 9])
  # Causal work per device (keys before each of its queries) differs by less than a chunk's.
  work = [(q + 1).sum() for q in order]
  assert max(work) - min(work) <= 2 * 2 * 16


def test_gradients_sync_by_gspmd_with_a_context_axis():
  from jaxlm.training import steps
  assert steps.resolve_gradient_sync("auto", {"data": 2, "context": 2}, grad_accum=2) == "gspmd"


@pytest.mark.parametrize("overrides, message", [
    ({"mesh": {"context": 2, "gradient_sync": "shard_map"}}, "with mesh.expert or mesh.context > 1 use gradient_sync"),
    ({"model": {"flavour": "bert", "qk_norm": "head"}}, "are options of model.flavour=llama"),
    ({"mesh": {"context": 4}, "data": {"seq_len": 12}}, r"data.seq_len=12 is not divisible by 2 \* mesh.context=8"),
    ({"mesh": {"context": 2, "tensor": 2}}, "combines with mesh.data and mesh.fsdp only"),
    ({"mesh": {"context": 2}, "model": {"flavour": "bert"}}, "splits a decoder's sequences"),
])
def test_bad_context_settings_are_one_line_errors(overrides, message):
  with pytest.raises(ValueError, match=message):
    from_config_dict(overrides)


def test_a_kernel_that_needs_whole_sequences_is_refused_on_a_context_mesh():
  mesh = sharding.make_mesh(MeshConfig(data=1, context=4))
  with pytest.raises(ValueError, match="kernels.attention=causal_blocks needs whole sequences, and mesh.context=4"):
    kernels_lib.resolve(KernelsConfig(attention="causal_blocks"), mesh=mesh)
  with pytest.raises(ValueError, match="kernels.attention=ring passes sequence chunks round mesh.context"):
    kernels_lib.resolve(KernelsConfig(attention="ring"), mesh=sharding.make_mesh(MeshConfig(data=4)))
