"""HF encoder families as options of jaxlm's one encoder (RoBERTa, XLM-RoBERTa, DistilBERT, ModernBERT): parity with
transformers (PyTorch, CPU, fp32) under padding, the export that transformers loads back, bit-identical round trips,
PEFT adapters in and out, each family's tokenizer in classification data, and one-line errors for what jaxlm does not
build. Parity is max|jaxlm - HF| / max|HF| (<= 1e-4); `pytest tests/test_hf_encoders.py -s` prints the PARITY lines.
"""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
from conftest import perturbed, relative_difference
import pytest
from flax import nnx
from safetensors.numpy import load_file

torch = pytest.importorskip("torch", reason="HF parity tests need the hf extra: pip install -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="HF parity tests need the hf extra: pip install -e '.[hf]'")
peft = pytest.importorskip("peft", reason="PEFT tests need the hf extra: pip install -e '.[hf]'")

from jaxlm import config as config_lib  # noqa: E402
from jaxlm.config import ModelConfig  # noqa: E402
from jaxlm.data.tuning import classification as cls_data  # noqa: E402
from jaxlm.interop import hf_config, hf_weights, peft_folders  # noqa: E402
from jaxlm.models.bert import Bert, BertForMaskedLM, BertForSequenceClassification  # noqa: E402
from jaxlm.recipes import classifier_finetuning  # noqa: E402

TOL = 1e-4
VOCAB, T = 97, 20
SMALL = dict(num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, vocab_size=VOCAB)
HF_CONFIGS = {
    "roberta": lambda: transformers.RobertaConfig(hidden_size=32, max_position_embeddings=T + 2, **SMALL),
    "xlm-roberta": lambda: transformers.XLMRobertaConfig(hidden_size=32, max_position_embeddings=T + 2,
                                                         type_vocab_size=1, **SMALL),
    "distilbert": lambda: transformers.DistilBertConfig(dim=32, n_layers=2, n_heads=4, hidden_dim=48,
                                                        vocab_size=VOCAB, max_position_embeddings=T),
    # Layer 0 global, layer 1 local (keys within 4 positions of a sequence of 20, its own rotary base).
    "modernbert": lambda: transformers.ModernBertConfig(
        hidden_size=32, max_position_embeddings=64, local_attention=8, global_attn_every_n_layers=2, pad_token_id=0,
        bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2, **SMALL),
}
CLASS_PREFIX = {"roberta": "Roberta", "xlm-roberta": "XLMRoberta", "distilbert": "DistilBert",
                "modernbert": "ModernBert"}
BASE_ATTRIBUTE = {"roberta": "roberta", "xlm-roberta": "roberta", "distilbert": "distilbert", "modernbert": "model"}
PEFT_TARGETS = {"roberta": ["query", "key", "value", "output.dense", "intermediate.dense"],
                "distilbert": ["q_lin", "k_lin", "v_lin", "out_lin", "lin1", "lin2"],
                "modernbert": ["Wqkv", "Wo", "Wi"]}


def _assert_same_params(a, b):
  left, right = (nnx.state(m, nnx.Param).to_pure_dict() for m in (a, b))
  assert jax.tree.structure(left) == jax.tree.structure(right)
  jax.tree.map(np.testing.assert_array_equal, left, right)


@pytest.fixture(scope="module", params=list(HF_CONFIGS))
def checkpoint(request, tmp_path_factory):
  """A family's random masked-LM and 3-class classifier saved by transformers, their outputs on a padded batch (row
  1 ends in 3 pad ids), and the jaxlm models loaded from them."""
  family = request.param
  prefix, config = CLASS_PREFIX[family], HF_CONFIGS[family]()
  ids = np.random.default_rng(0).integers(3, VOCAB, (2, T))
  mask = np.ones((2, T), np.int64)
  mask[1, -3:], ids[1, -3:] = 0, config.pad_token_id
  out = {"family": family, "ids": ids, "mask": mask}
  for kind, head in (("mlm", "ForMaskedLM"), ("cls", "ForSequenceClassification")):
    config.num_labels = 3
    model = perturbed(getattr(transformers, prefix + head)(config))
    folder = tmp_path_factory.mktemp(f"{family}_{kind}")
    model.save_pretrained(folder)
    with torch.no_grad():
      out[f"{kind}_logits"] = model(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
      if kind == "mlm":
        base = getattr(model, BASE_ATTRIBUTE[family])
        out["hidden"] = base(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).last_hidden_state.numpy()
    out[f"{kind}_folder"], out[f"{kind}_hf"], out[kind] = folder, model, hf_weights.from_pretrained(str(folder))
  return out


def test_parity_with_transformers_under_padding(checkpoint):
  family, ids, mask = checkpoint["family"], jnp.asarray(checkpoint["ids"]), jnp.asarray(checkpoint["mask"])
  mlm, cls = checkpoint["mlm"], checkpoint["cls"]
  assert isinstance(mlm, BertForMaskedLM) and isinstance(cls, BertForSequenceClassification)
  for what, ours, theirs in (("hidden", mlm.encode(ids, mask), checkpoint["hidden"]),
                             ("mlm_logits", mlm(ids, mask), checkpoint["mlm_logits"]),
                             ("cls_logits", cls(ids, mask), checkpoint["cls_logits"])):
    rel = relative_difference(ours, theirs)
    print(f"PARITY {family} {what} {rel:.2e}")
    assert rel <= TOL, what


def test_a_bare_encoder_checkpoint_loads_as_the_heads_encoder(checkpoint, tmp_path):
  getattr(checkpoint["mlm_hf"], BASE_ATTRIBUTE[checkpoint["family"]]).save_pretrained(tmp_path)
  encoder = hf_weights.from_pretrained(str(tmp_path))
  assert isinstance(encoder, Bert) and encoder.pooler is None
  _assert_same_params(encoder, checkpoint["mlm"].bert)


@pytest.mark.parametrize("kind", ["mlm", "cls"])
def test_export_is_the_checkpoint_transformers_loads_and_reads_back_bit_identical(checkpoint, kind, tmp_path):
  family, model = checkpoint["family"], checkpoint[kind]
  hf_weights.save_pretrained(model, str(tmp_path))
  hf = json.loads((tmp_path / "config.json").read_text())
  assert hf["model_type"] == family
  original = load_file(str(checkpoint[f"{kind}_folder"] / "model.safetensors"))
  saved = load_file(str(tmp_path / "model.safetensors"))
  assert sorted(saved) == sorted(original)
  for name, value in original.items():
    assert saved[name].dtype == value.dtype and np.array_equal(saved[name], value), name
  auto = transformers.AutoModelForMaskedLM if kind == "mlm" else transformers.AutoModelForSequenceClassification
  with torch.no_grad():
    theirs = auto.from_pretrained(tmp_path).eval()(input_ids=torch.tensor(checkpoint["ids"]),
                                                   attention_mask=torch.tensor(checkpoint["mask"])).logits.numpy()
  assert relative_difference(theirs, checkpoint[f"{kind}_logits"]) <= 1e-6
  reread = hf_weights.from_pretrained(str(tmp_path))
  assert reread.config == model.config
  _assert_same_params(reread, model)


def test_a_peft_adapter_reads_in_with_peft_outputs_and_writes_back_equal(checkpoint, tmp_path):
  family = checkpoint["family"]
  hf = transformers.AutoModelForSequenceClassification.from_pretrained(checkpoint["cls_folder"])
  targets = PEFT_TARGETS[family.removeprefix("xlm-")]
  model = peft.get_peft_model(hf, peft.LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, target_modules=targets))
  torch.manual_seed(1)
  with torch.no_grad():  # trained-looking adapters (peft starts B at zero) and a trained head copy
    for name, p in model.named_parameters():
      if "lora_B" in name or "modules_to_save" in name:
        p.add_(0.1 * torch.randn_like(p))
  model.save_pretrained(tmp_path / "peft")
  ids, mask = checkpoint["ids"], checkpoint["mask"]
  with torch.no_grad():
    theirs = model.eval()(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
  ours = peft_folders.from_pretrained(str(checkpoint["cls_folder"]), str(tmp_path / "peft"))
  rel = relative_difference(ours(jnp.asarray(ids), jnp.asarray(mask)), theirs)
  print(f"PARITY {family} peft_lora_logits {rel:.2e}")
  assert rel <= TOL
  peft_folders.save_adapters(ours, str(tmp_path / "jaxlm"))
  original, written = (load_file(str(tmp_path / d / peft_folders.WEIGHTS)) for d in ("peft", "jaxlm"))
  assert sorted(written) == sorted(original)
  for name, value in original.items():
    np.testing.assert_array_equal(written[name], value, name)
  config = json.loads((tmp_path / "jaxlm" / peft_folders.CONFIG).read_text())
  assert (config["r"], config["lora_alpha"], config["modules_to_save"]) == (4, 8, ["classifier"])


# A tiny tokenizer of each family's kind, saved as transformers' save_pretrained writes a tokenizer folder.
def _tokenizer_folder(family: str, folder) -> tuple[str, int]:
  """(the folder, its padding id): byte-level BPE with <s> </s> and <pad> 1 (RoBERTa), BPE with [CLS] [SEP] and [PAD]
  4 (ModernBERT), WordPiece with [PAD] 0 (DistilBERT)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: PLC0415
  corpus = ["the cat sat on the mat", "a dog ate the bone", "cats and dogs sat"] * 4
  if family == "distilbert":
    tokenizer = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tokenizer.train_from_iterator(corpus, trainers.WordPieceTrainer(vocab_size=60, special_tokens=specials))
    tokenizer.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    kwargs = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
  else:
    roberta = family != "modernbert"
    specials = (["<s>", "<pad>", "</s>", "<unk>", "<mask>"] if roberta else
                ["[UNK]", "[CLS]", "[SEP]", "[MASK]", "[PAD]"])
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=80, special_tokens=specials))
    if roberta:
      tokenizer.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
      kwargs = dict(bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>", mask_token="<mask>")
    else:
      tokenizer.post_processor = processors.TemplateProcessing(
          single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])
      kwargs = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
  fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, **kwargs)
  fast.save_pretrained(folder)
  return str(folder), fast.pad_token_id


def test_classification_batches_pad_with_the_tokenizers_pad_id_and_feed_token_types_only_where_they_exist(
    checkpoint, tmp_path):
  family, model = checkpoint["family"], checkpoint["cls"]
  folder, pad_id = _tokenizer_folder(family, tmp_path)
  assert pad_id == {"distilbert": 0, "modernbert": 4}.get(family, 1)
  tokenizer = cls_data.load_checkpoint_tokenizer(folder)
  assert cls_data.pad_token_id(tokenizer) == pad_id
  examples, _ = cls_data.tokenize(tokenizer, ["the cat sat on the mat and the dog ate", "a cat"],
                                  ["a dog", "the mat"], seq_len=T)
  batch = examples.batch(np.arange(2), T)
  assert batch["attention_mask"].min() == 0 and (batch["input_ids"][batch["attention_mask"] == 0] == pad_id).all()
  assert batch["input_ids"].max() < VOCAB
  batch.update(labels=np.array([0, 2], np.int32), weights=np.ones(2, np.float32))
  graphdef, params = nnx.split(model)
  loss, (weight, _) = classifier_finetuning.make_classification_loss_fn(graphdef)(params, batch)
  assert np.isfinite(float(loss)) and float(weight) == 2.0
  if not model.config.type_vocab_size:  # the loss above did not feed them
    with pytest.raises(ValueError, match="has no token types"):
      model(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])


def _hf_dict(family: str, **changes) -> dict:
  return {**HF_CONFIGS[family]().to_dict(), "architectures": [CLASS_PREFIX[family] + "ForMaskedLM"], **changes}


@pytest.mark.parametrize("family, changes, message", [
    ("roberta", dict(position_embedding_type="relative_key"),
     "position_embedding_type='relative_key' is not supported \\(jaxlm supports absolute\\)"),
    ("xlm-roberta", dict(is_decoder=True), "is_decoder=True is not supported \\(jaxlm supports false: an encoder\\)"),
    ("distilbert", dict(sinusoidal_pos_embds=True), "sinusoidal_pos_embds=True is not supported"),
    ("modernbert", dict(attention_bias=True), "attention_bias=True is not supported \\(jaxlm supports false\\)"),
    ("modernbert", dict(hidden_activation="silu"), "hidden_activation='silu' is not supported"),
    ("modernbert", dict(layer_types=["sliding_attention", "full_attention"]),
     "layer_types=.* is not supported \\(jaxlm supports full_attention on layers 0, N, 2N"),
    ("modernbert", dict(rope_parameters={"full_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}}),
     "rope_parameters=.* is not supported \\(jaxlm supports rope_type default\\)"),
    ("modernbert", dict(architectures=["ModernBertForTokenClassification"]),
     "architectures=\\['ModernBertForTokenClassification'\\] is not supported for modernbert"),
])
def test_variants_jaxlm_does_not_build_are_one_line_errors(family, changes, message):
  with pytest.raises(ValueError, match=message) as error:
    hf_config.model_from_hf_config(_hf_dict(family, **changes), "ckpt/config.json", set(), "float32", "float32")
  assert "\n" not in str(error.value) and "ckpt/config.json" in str(error.value)


def test_options_no_family_has_are_refused_on_export_and_checked_in_the_config():
  config = ModelConfig(flavour="bert", vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4, pre_norm=True)
  abstract = nnx.eval_shape(lambda: Bert(config, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="are no HF encoder family's"):
    hf_config.hf_config(abstract)
  base = config_lib.from_config_dict(config_lib.default_config())
  for model, message in ((dataclasses.replace(config, encoder_window=8), "needs model.encoder_global_every >= 2"),
                         (dataclasses.replace(config, classifier_head="tanh"), "classifier_head='tanh' is not one of"),
                         (ModelConfig(flavour="llama", pre_norm=True), "pre_norm is an option of model.flavour=bert")):
    with pytest.raises(ValueError, match=message):
      config_lib.validate(dataclasses.replace(base, model=dataclasses.replace(model, max_seq_len=1024)))
