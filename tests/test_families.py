"""The decoder options other families bring (Gemma 2/3's windows, soft-capping, sandwich norms and GeGLU; OLMo 2's
post-norms; yarn rotary) through the rest of the framework: kernels that cannot honour a window or soft-capping are
never picked and are refused by name; int8 quantization, pruning and NF4 QLoRA take such a model. Parity with
transformers per family is tests/test_hf.py's."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxlm import kernels as kernels_lib
from jaxlm.adapters import lora
from jaxlm.compress import prune, quantization
from jaxlm.config import KernelsConfig, LoRAConfig, ModelConfig
from jaxlm.models.gpt import GPT

LLAMA = ModelConfig(flavour="llama", vocab_size=64, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2, d_ff=48,
                    max_seq_len=16, compute_dtype="float32")
GEMMA2 = dataclasses.replace(LLAMA, sliding_window=5, global_attention_every=2, attention_softcap=5.0,
                             logit_softcap=3.0, block_norms="sandwich", norm_plus_one=True, scale_embeddings=True,
                             glu_activation="gelu_tanh", query_pre_attn_scalar=12.0)
IDS = np.random.default_rng(0).integers(0, 64, (2, 16)).astype(np.int32)


def test_auto_never_picks_a_kernel_without_the_window_or_soft_capping_and_a_named_one_is_refused():
  for platform in ("cpu", "gpu", "tpu"):
    windowed = kernels_lib.resolve(platform=platform, devices=1, compute_dtype="bfloat16", window=True)
    assert windowed.attention != "ring"
    capped = kernels_lib.resolve(platform=platform, devices=1, compute_dtype="bfloat16",
                                 softcaps=("attention", "cross_entropy"))
    assert (capped.attention, capped.cross_entropy) == ("xla", "logits"), platform
  with pytest.raises(ValueError, match="kernels.attention=causal_blocks does not soft-cap"):
    kernels_lib.resolve(KernelsConfig(attention="causal_blocks"), softcaps=("attention",))
  with pytest.raises(ValueError, match="kernels.cross_entropy=chunked does not soft-cap"):
    kernels_lib.resolve(KernelsConfig(cross_entropy="chunked"), softcaps=("cross_entropy",))


def test_the_window_is_in_the_mask_of_every_kernel_that_takes_one():
  """Each attention kernel auto may pick for a windowed model computes the reference's windowed attention."""
  model = GPT(dataclasses.replace(LLAMA, sliding_window=5), rngs=nnx.Rngs(0))
  reference = model(IDS)
  for name in ("causal_blocks", "cpu_fused"):  # auto's CPU picks; the library kernels are given the same mask
    kernels = kernels_lib.resolve(KernelsConfig(attention=name), window=True, devices=1)
    other = GPT(dataclasses.replace(LLAMA, sliding_window=5), kernels=kernels, rngs=nnx.Rngs(0))
    np.testing.assert_allclose(other(IDS), reference, rtol=2e-5, atol=2e-5, err_msg=name)
  unwindowed = GPT(LLAMA, rngs=nnx.Rngs(0))(IDS)
  assert float(jnp.abs(unwindowed - reference)[:, 5:].max()) > 1e-3  # the window changed what late tokens see
  np.testing.assert_allclose(unwindowed[:, :5], reference[:, :5], rtol=2e-5, atol=2e-5)


def test_int8_pruning_and_nf4_qlora_take_a_gemma_model():
  """Gemma 2's options and yarn rotary at once (OLMo 2's post-norms and Phi-3's layout go through the same code)."""
  config = dataclasses.replace(GEMMA2, d_model=128, d_ff=128, rope_scaling="yarn", rope_factor=4.0,
                               rope_original_max_positions=8)  # NF4 takes inputs of multiples of 128
  model = GPT(config, rngs=nnx.Rngs(0))
  reference = np.asarray(model(IDS))
  qmodel = quantization.quantize(model, "w8a8_dynamic")
  error = np.linalg.norm(np.asarray(qmodel(IDS)) - reference) / np.linalg.norm(reference)
  assert 0 < error < 0.05, error

  masks = prune.magnitude_masks(model, 0.5)
  pruned = prune.apply_masks(model, masks)
  assert abs(prune.sparsity(pruned, masks) - 0.5) < 0.01
  assert np.isfinite(np.asarray(pruned(IDS))).all()

  graphdef, params = nnx.split(model)
  plan = lora.make_plan(params, LoRAConfig(rank=4, base="nf4", targets="all"))
  lora_params = lora.combine(lora.init_adapters(plan, params.to_pure_dict(), jax.random.key(1)),
                             lora.freeze(plan, params.to_pure_dict()))
  qlora_out = np.asarray(nnx.merge(graphdef, lora_params)(IDS))  # B = 0: the NF4-rounded base model
  merged_out = np.asarray(nnx.merge(graphdef, lora.merge(lora_params))(IDS))
  np.testing.assert_allclose(qlora_out, merged_out, rtol=1e-4, atol=1e-4)
  assert 0 < np.linalg.norm(qlora_out - reference) / np.linalg.norm(reference) < 0.5  # 4-bit random weights


def test_instruction_tuning_resolves_kernels_for_the_checkpoints_model(tmp_path):
  """The experiment file's model is a placeholder: the run's kernels and mesh checks see init_from's model (a Gemma
  checkpoint: soft-capping, so the reference attention and full-logits loss), read from its config.json alone."""
  from jaxlm import config as config_lib  # noqa: PLC0415
  from jaxlm.interop import hf_weights  # noqa: PLC0415
  from jaxlm.recipes import instruction_tuning  # noqa: PLC0415
  from jaxlm.training import loop  # noqa: PLC0415
  hf_weights.save_pretrained(GPT(GEMMA2, rngs=nnx.Rngs(0)), str(tmp_path / "gemma"))
  raw = config_lib.default_config()
  raw.init_from, raw.model.flavour, raw.model.compute_dtype = str(tmp_path / "gemma"), "llama", "float32"
  raw.data.seq_len = 0  # chosen from the data
  config = instruction_tuning.with_source_model(config_lib.from_config_dict(raw))
  assert (config.model.attention_softcap, config.model.sliding_window) == (5.0, 5)
  _, _, kernels = loop.prepare_run(config, str(tmp_path / "run"), causal=True)
  assert (kernels.attention, kernels.cross_entropy) == ("xla", "logits")
  raw.mesh.context, raw.mesh.data = 2, 2
  with pytest.raises(ValueError, match="ring attention has no sliding window"):
    instruction_tuning.with_source_model(config_lib.from_config_dict(raw))


@pytest.mark.parametrize("changes, message", [
    (dict(norm_plus_one=True), "model.norm_plus_one without the rest of Gemma's options"),
    (dict(attention_softcap=5.0), "model.attention_softcap=5.0 outside Gemma's options"),
    (dict(sliding_window=5, global_attention_every=2), "model.global_attention_every=2 outside Gemma's options"),
    (dict(hf_model_type="phi3", qk_norm="head"), "hf_model_type=phi3 has no HF counterpart"),
])
def test_an_export_never_drops_an_option_silently(changes, message):
  from jaxlm.interop import hf_decoders  # noqa: PLC0415
  with pytest.raises(ValueError, match=message):
    hf_decoders.hf_family(dataclasses.replace(LLAMA, **changes))
  assert hf_decoders.hf_family(GEMMA2) == "gemma2"
