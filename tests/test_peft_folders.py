"""PEFT adapter folders (jaxlm/interop/peft_folders.py): what jaxlm exports, `peft` + `transformers` load onto the HF
base model with the same outputs; importing it back is bit-identical; the merged model is an ordinary HF checkpoint with
the same outputs; folders of another base model or of an unsupported kind are one-line errors."""

import json
import shutil

import jax
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jaxlm.adapters import lora
from jaxlm.config import LoRAConfig, ModelConfig
from jaxlm.interop import hf_weights, peft_folders
from jaxlm.kernels import Kernels
from jaxlm.models.bert import BertForSequenceClassification
from jaxlm.models.gpt import GPT

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SMALL = dict(vocab_size=96, num_layers=2, d_model=64, num_heads=4, max_seq_len=32, compute_dtype="float32")
FAMILIES = {
    "gpt2": (ModelConfig(flavour="gpt2", **SMALL), "all", transformers.GPT2LMHeadModel),
    "llama": (ModelConfig(flavour="llama", num_kv_heads=2, d_ff=96, tie_embeddings=False, **SMALL), "attention,w_down",
              transformers.LlamaForCausalLM),
    "bert": (ModelConfig(flavour="bert", **SMALL), "w_q,w_v,mlp", transformers.BertForSequenceClassification),
}
IDS = np.random.default_rng(0).integers(0, 96, (2, 12))


def _make(model_config):
  if model_config.flavour == "bert":
    return lambda rngs: BertForSequenceClassification(model_config, 3, kernels=Kernels(), rngs=rngs)
  return lambda rngs: GPT(model_config, kernels=Kernels(), rngs=rngs)


@pytest.fixture(scope="module", params=list(FAMILIES))
def exported(request, tmp_path_factory):
  """A jaxlm model with trained-looking (non-zero) adapters, its base saved as an HF folder, the adapters exported."""
  model_config, targets, hf_class = FAMILIES[request.param]
  folder = tmp_path_factory.mktemp(request.param)
  return (request.param, folder, *_export(model_config, targets, folder), hf_class)


def _export(model_config, targets, folder):
  make = _make(model_config)
  graphdef, abstract = nnx.split(nnx.eval_shape(lambda: make(nnx.Rngs(0))))
  plan = lora.make_plan(abstract, LoRAConfig(rank=4, alpha=8.0, targets=targets))

  @jax.jit
  def build():
    params = nnx.split(make(nnx.Rngs(0)))[1].to_pure_dict()
    trainable = lora.init_adapters(plan, params, jax.random.key(1))
    noise = lambda k, x: 0.05 * jax.random.normal(jax.random.fold_in(jax.random.key(2), k), x.shape)
    trainable = jax.tree.map(lambda x, k: x + noise(k, x), trainable,
                             jax.tree.unflatten(jax.tree.structure(trainable), range(len(jax.tree.leaves(trainable)))))
    return params, trainable, nnx.merge(graphdef, lora.combine(trainable, lora.freeze(plan, params)))(IDS)

  params, trainable, ours = build()  # one program: init, adapters and the LoRA model's logits
  base = nnx.merge(graphdef, params)
  lora_model = peft_folders.with_adapters(base, trainable, plan.scale)
  hf_weights.save_pretrained(base, str(folder / "base"))
  peft_folders.save_adapters(lora_model, str(folder / "adapter"))
  return base, lora_model, trainable, plan, np.asarray(ours)


def _peft_logits(folder, hf_class, adapter="adapter"):
  model = peft.PeftModel.from_pretrained(hf_class.from_pretrained(str(folder / "base")), str(folder / adapter))
  with torch.no_grad():
    return model.eval()(torch.tensor(IDS)).logits.numpy()


def test_peft_loads_the_export_onto_the_hf_base_with_the_same_outputs(exported):
  family, folder, _, _, _, _, ours, hf_class = exported
  theirs = _peft_logits(folder, hf_class)
  assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max(), family
  config = json.loads((folder / "adapter" / "adapter_config.json").read_text())
  assert config["peft_type"] == "LORA" and config["r"] == 4
  if family == "gpt2":  # q, k, v share c_attn: one adapter of rank 3r with 3 alpha, the same update
    assert config["rank_pattern"] == {"c_attn": 12} and config["alpha_pattern"] == {"c_attn": 24}


def test_import_back_is_bit_identical(exported):
  _, folder, base, _, trainable, plan, _, _ = exported
  imported, scale = peft_folders.read_adapters(str(folder / "adapter"), base)
  assert scale == plan.scale
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(imported), jax.device_get(trainable))
  loaded = peft_folders.from_pretrained(str(folder / "base"), str(folder / "adapter"))
  ours = lora._flat(nnx.state(exported[3], nnx.Param).to_pure_dict())
  for path, value in lora._flat(nnx.state(loaded, nnx.Param).to_pure_dict()).items():
    for got, want in zip(jax.tree.leaves(value), jax.tree.leaves(ours[path])):
      np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=path)


def test_the_merged_model_is_an_ordinary_hf_checkpoint_with_the_same_outputs(exported):
  family, folder, _, lora_model, _, _, ours, hf_class = exported
  hf_weights.save_pretrained(peft_folders.merged_model(lora_model), str(folder / "merged"))
  merged = hf_class.from_pretrained(str(folder / "merged"))
  with torch.no_grad():
    theirs = merged.eval()(torch.tensor(IDS)).logits.numpy()
  assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max(), family


def test_a_mean_pooling_head_exports_what_peft_reproduces_and_imports_back(tmp_path):
  """peft's BertForSequenceClassification pools [CLS]; its adapted encoder's mean-pooled states through the
  exported head give jaxlm's logits, and jaxlm reads the head's pooling back from the folder."""
  config = ModelConfig(flavour="bert", classifier_pooling="mean", **SMALL)
  base, _, _, _, ours = _export(config, "w_q,w_v,mlp", tmp_path)
  assert base.bert.pooler is None and (tmp_path / "adapter" / peft_folders.HEAD_FILE).is_file()
  model = peft.PeftModel.from_pretrained(transformers.BertForSequenceClassification.from_pretrained(
      str(tmp_path / "base")), str(tmp_path / "adapter")).eval()
  with torch.no_grad():
    hidden = model.base_model.model.bert(torch.tensor(IDS)).last_hidden_state.mean(1)
    theirs = model.base_model.model.classifier(hidden).numpy()
  assert np.abs(ours - theirs).max() <= 1e-4 * np.abs(theirs).max()
  loaded = peft_folders.from_pretrained(str(tmp_path / "base"), str(tmp_path / "adapter"))
  assert loaded.config.classifier_pooling == "mean"
  np.testing.assert_allclose(np.asarray(loaded(IDS)), ours, rtol=1e-5, atol=1e-6)


def _broken_copy(exported, tmp_path, edit_config=None, edit_tensors=None):
  folder = tmp_path / "adapter"
  shutil.copytree(exported[1] / "adapter", folder)
  if edit_config:
    config = json.loads((folder / peft_folders.CONFIG).read_text())
    edit_config(config)
    (folder / peft_folders.CONFIG).write_text(json.dumps(config))
  if edit_tensors:
    tensors = load_file(str(folder / peft_folders.WEIGHTS))
    edit_tensors(tensors)
    save_file(tensors, str(folder / peft_folders.WEIGHTS))
  return folder


@pytest.mark.parametrize("case, message", [
    ("ia3", "peft_type='IA3' is not supported; jaxlm reads LORA adapters"),
    ("dora", "use_dora=True is not supported; jaxlm reads plain LoRA"),
    ("other_shape", "maps 80 -> 64 features but this model's weight is 64 -> 64: adapters of another base model"),
    ("other_depth", "which this BertForSequenceClassification \\(bert, 2 layers\\) lacks: adapters of another base"),
    ("pickle", "no adapter_model.safetensors \\(adapter_model.bin is a pickle; jaxlm never unpickles weights\\)"),
    ("no_config", "adapter_config.json not found"),
])
def test_unsupported_or_foreign_adapter_folders_are_one_line_errors(exported, tmp_path, case, message):
  if exported[0] != "bert":
    pytest.skip("one family is enough for the folder checks")
  module = "bert.encoder.layer.0.attention.self.query"
  edits = {
      "ia3": dict(edit_config=lambda c: c.update(peft_type="IA3")),
      "dora": dict(edit_config=lambda c: c.update(use_dora=True)),
      "other_shape": dict(edit_tensors=lambda t: t.update({
          f"base_model.model.{module}.lora_A.weight": np.zeros((4, 80), np.float32)})),
      "other_depth": dict(edit_tensors=lambda t: t.update({
          f"base_model.model.{module.replace('layer.0', 'layer.7')}.lora_A.weight": np.zeros((4, 64), np.float32)})),
  }.get(case, {})
  folder = _broken_copy(exported, tmp_path, **edits)
  if case == "pickle":
    (folder / peft_folders.WEIGHTS).rename(folder / "adapter_model.bin")
  if case == "no_config":
    (folder / peft_folders.CONFIG).unlink()
  before = sorted(p.name for p in folder.iterdir())
  with pytest.raises(ValueError, match=message) as error:
    peft_folders.read_adapters(str(folder), exported[2])
  assert "\n" not in str(error.value)
  assert sorted(p.name for p in folder.iterdir()) == before  # nothing deleted
