"""rsLoRA adapter folders (peft's use_rslora: the update scaled by lora_alpha / sqrt(r), not lora_alpha / r) through
jaxlm/interop/peft_folders.py: peft's own adapter on a tiny random Llama loads with peft's logits and merged weights,
and written back with use_rslora it is the same folder, which peft reloads to the same logits; a GPT-2 export whose
fused c_attn adapter has rank 3r keeps its scale too."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from jaxlm.adapters import lora
from jaxlm.config import LoRAConfig, ModelConfig
from jaxlm.interop import hf_weights, peft_folders
from jaxlm.kernels import Kernels
from jaxlm.models.gpt import GPT

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

VOCAB = 97
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _relative(got, want) -> float:
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.abs(got - want).max() / np.abs(want).max())


def _logits(model) -> np.ndarray:
  with torch.no_grad():
    return model.eval()(torch.tensor(IDS)).logits.numpy()


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
  """A random 2-layer Llama saved by transformers, and peft's rsLoRA adapter (r=4, alpha=8: scale 4, where plain
  LoRA's would be 2) on all its projections, with non-zero B, saved by peft."""
  folder = tmp_path_factory.mktemp("rslora")
  torch.manual_seed(0)
  config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=32)
  transformers.LlamaForCausalLM(config).save_pretrained(str(folder / "base"))
  base = transformers.LlamaForCausalLM.from_pretrained(str(folder / "base"))
  torch.manual_seed(1)
  adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, use_rslora=True, target_modules=LLAMA_TARGETS,
                                                      init_lora_weights=False))
  assert adapted.base_model.model.model.layers[0].self_attn.q_proj.scaling["default"] == pytest.approx(4.0)
  adapted.save_pretrained(str(folder / "adapter"))
  expected = _logits(adapted)
  merged = {k: v.numpy() for k, v in adapted.merge_and_unload().state_dict().items()}
  return folder, expected, merged


def test_an_rslora_folder_loads_with_peft_logits_and_merged_weights(llama, tmp_path):
  folder, expected, merged = llama
  assert json.loads((folder / "adapter" / peft_folders.CONFIG).read_text())["use_rslora"] is True
  model = peft_folders.from_pretrained(str(folder / "base"), str(folder / "adapter"))
  _, scale = peft_folders.read_adapters(str(folder / "adapter"), model)
  assert scale == 8 / 2  # lora_alpha / sqrt(r), not lora_alpha / r = 2
  assert _relative(model(jnp.asarray(IDS)), expected) <= 1e-4
  hf_weights.save_pretrained(peft_folders.merged_model(model), str(tmp_path / "merged"))
  ours = load_file(str(tmp_path / "merged" / "model.safetensors"))
  assert {k for k in merged if "rotary" not in k} <= set(ours)
  for name, value in ours.items():
    np.testing.assert_allclose(value, merged[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_an_rslora_folder_writes_back_equal_and_peft_reloads_it_equal(llama, tmp_path):
  folder, expected, _ = llama
  model = peft_folders.from_pretrained(str(folder / "base"), str(folder / "adapter"))
  use_rslora = peft_folders.read_config(str(folder / "adapter"))["use_rslora"]
  peft_folders.save_adapters(model, str(tmp_path / "again"), use_rslora=use_rslora)
  config = json.loads((tmp_path / "again" / peft_folders.CONFIG).read_text())
  assert config["use_rslora"] is True and config["r"] == 4 and config["lora_alpha"] == 8
  before, after = (load_file(str(d / peft_folders.WEIGHTS)) for d in (folder / "adapter", tmp_path / "again"))
  assert sorted(before) == sorted(after)
  for key in before:
    np.testing.assert_array_equal(after[key], before[key], err_msg=key)
  reloaded = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(str(folder / "base")),
                                            str(tmp_path / "again"))
  np.testing.assert_array_equal(_logits(reloaded), expected)
  # Written as plain LoRA (the default) the same scale is lora_alpha = 4 * r = 16: peft's outputs again.
  peft_folders.save_adapters(model, str(tmp_path / "plain"))
  plain = json.loads((tmp_path / "plain" / peft_folders.CONFIG).read_text())
  assert plain["use_rslora"] is False and plain["lora_alpha"] == 16
  reloaded = peft.PeftModel.from_pretrained(transformers.LlamaForCausalLM.from_pretrained(str(folder / "base")),
                                            str(tmp_path / "plain"))
  assert _relative(_logits(reloaded), expected) <= 1e-6


def test_gpt2_fused_adapter_keeps_its_scale_as_rslora(tmp_path):
  """GPT-2's c_attn adapter has rank 3r: as rsLoRA its alpha_pattern is scale * sqrt(3r), which reads back as the
  scale of the other modules (within float rounding), and peft computes jaxlm's logits from it."""
  config = ModelConfig(flavour="gpt2", vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4, max_seq_len=32,
                       compute_dtype="float32")
  make = lambda rngs: GPT(config, kernels=Kernels(), rngs=rngs)
  graphdef, params = nnx.split(make(nnx.Rngs(0)))
  plan = lora.make_plan(params, LoRAConfig(rank=4, alpha=8.0, targets="all"))
  trainable = lora._flat(lora.init_adapters(plan, params.to_pure_dict(), jax.random.key(1)))
  rng = np.random.default_rng(2)  # trained-looking: B non-zero
  flat = {k: np.asarray(v) + 0.05 * rng.standard_normal(v.shape).astype(np.float32) for k, v in trainable.items()}
  base = nnx.merge(graphdef, params)
  model = peft_folders.with_adapters(base, lora._nested(flat), plan.scale)
  hf_weights.save_pretrained(base, str(tmp_path / "base"))
  peft_folders.save_adapters(model, str(tmp_path / "adapter"), use_rslora=True)
  saved = json.loads((tmp_path / "adapter" / peft_folders.CONFIG).read_text())
  assert saved["use_rslora"] is True and saved["lora_alpha"] == 4  # scale 2 * sqrt(4)
  assert saved["rank_pattern"] == {"c_attn": 12} and saved["alpha_pattern"]["c_attn"] == pytest.approx(2 * 12 ** 0.5)
  _, scale = peft_folders.read_adapters(str(tmp_path / "adapter"), base)
  assert scale == pytest.approx(plan.scale, rel=1e-12)
  theirs = _logits(peft.PeftModel.from_pretrained(transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "base")),
                                                  str(tmp_path / "adapter")))
  assert _relative(model(jnp.asarray(IDS)), theirs) <= 1e-4
