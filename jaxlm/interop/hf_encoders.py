"""config.json <-> ModelConfig, and the weights' tables, for the BERT-style encoder families (BERT, RoBERTa,
XLM-RoBERTa, DistilBERT, ModernBERT): each family is a set of options of the one encoder (jaxlm/models/bert.py), read
from its config.json (a variant jaxlm does not build is a one-line error naming the key) and written back with the
model_type those options imply (XLM-RoBERTa, RoBERTa's architecture, is told apart by model.hf_model_type). The
tables are hf_rules.Rule lists; hf_weights.py loads and saves with them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from flax import nnx

from jaxlm.config import ModelConfig
from jaxlm.interop import hf_keys, hf_rules
from jaxlm.models.bert import Bert, BertForMaskedLM, BertForSequenceClassification

# model_type -> the prefix of its HF class names (<prefix>Model, <prefix>ForMaskedLM, ...).
ENCODER_FAMILIES = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta", "distilbert": "DistilBert",
                    "modernbert": "ModernBert"}
# The family of a model's options: (counted positions, token types, rotary, pre-norm, gated MLP, linear biases, head).
_FAMILY_OF_OPTIONS = {(False, True, False, False, False, True, "pooler"): "bert",
                      (True, True, False, False, False, True, "dense_tanh"): "roberta",
                      (False, False, False, False, False, True, "dense_relu"): "distilbert",
                      (False, False, True, True, True, False, "transform"): "modernbert"}
_BASE_PREFIX = {"bert": "bert.", "roberta": "roberta.", "distilbert": "distilbert.", "modernbert": "model."}
_CLASS_SUFFIX = {Bert: "Model", BertForMaskedLM: "ForMaskedLM",
                 BertForSequenceClassification: "ForSequenceClassification"}
_DISTILBERT_EPS = 1e-12  # HF DistilBERT's LayerNorms have a fixed epsilon


def family(c: ModelConfig) -> str:
  """The HF model_type of a bert-flavour model's options, or a one-line error when no HF family has them."""
  options = (c.position_start > 0, c.type_vocab_size > 0, c.rotary_positions, c.pre_norm, c.gated_mlp, c.linear_bias,
             c.classifier_head)
  name = _FAMILY_OF_OPTIONS.get(options)
  if c.hf_model_type and (c.hf_model_type, name) != ("xlm-roberta", "roberta"):
    raise ValueError(f"model.hf_model_type={c.hf_model_type!r} does not fit these options (an encoder's may be "
                     "xlm-roberta, with RoBERTa's)")
  if name is None or (name != "modernbert" and (c.encoder_window or not c.norm_bias)):
    raise ValueError(f"these model options (position_start={c.position_start}, type_vocab_size={c.type_vocab_size}, "
                     f"rotary_positions={c.rotary_positions}, pre_norm={c.pre_norm}, gated_mlp={c.gated_mlp}, "
                     f"linear_bias={c.linear_bias}, norm_bias={c.norm_bias}, encoder_window={c.encoder_window}, "
                     f"classifier_head={c.classifier_head}) are no HF encoder family's (bert, roberta, distilbert, "
                     "modernbert: docs/configuration.md)")
  return c.hf_model_type or name


def _architecture(name: str) -> str:
  """The family whose tables a model_type uses."""
  return "roberta" if name == "xlm-roberta" else name


# ----------------------------------------------------------------------------------------------- config.json in


def encoder_model(hf: dict, where: str, weight_names: set[str], common: dict) -> Callable[[nnx.Rngs], nnx.Module]:
  """A constructor of the jaxlm model of an encoder family's config.json (model_type in ENCODER_FAMILIES)."""
  model_type, arch = hf["model_type"], (hf.get("architectures") or [None])[0]
  get, need = hf_keys.readers(hf, where)

  if model_type == "distilbert":
    need(get("activation", "gelu") == "gelu", "activation", "gelu")
    need(not hf.get("sinusoidal_pos_embds"), "sinusoidal_pos_embds", "false: learned positions")
    config = ModelConfig(flavour="bert", num_layers=get("n_layers"), d_model=get("dim"), num_heads=get("n_heads"),
                         d_ff=get("hidden_dim"), max_seq_len=get("max_position_embeddings"),
                         layer_norm_eps=_DISTILBERT_EPS, type_vocab_size=0, classifier_head="dense_relu", **common)
  elif model_type == "modernbert":
    config = _modernbert_config(hf, get, need, common)
  else:  # bert, roberta, xlm-roberta
    need(get("hidden_act", "gelu") == "gelu", "hidden_act", "gelu")
    need(get("position_embedding_type", "absolute") == "absolute", "position_embedding_type", "absolute")
    need(not hf.get("is_decoder") and not hf.get("add_cross_attention"), "is_decoder", "false: an encoder")
    start = 0
    if model_type != "bert":  # HF counts the positions from padding_idx + 1 (padding_idx = pad_token_id)
      pad = get("pad_token_id", 1)
      need(isinstance(pad, int) and pad >= 0, "pad_token_id", "a token id: the positions are counted from it")
      start = pad + 1
      need(get("max_position_embeddings") > start, "max_position_embeddings", f"more than pad_token_id + 1 = {start}")
    need(get("type_vocab_size", 2) >= 1, "type_vocab_size", "1 or more")
    config = ModelConfig(flavour="bert", num_layers=get("num_hidden_layers"), d_model=get("hidden_size"),
                         num_heads=get("num_attention_heads"), d_ff=get("intermediate_size"),
                         max_seq_len=get("max_position_embeddings") - start,
                         layer_norm_eps=get("layer_norm_eps", 1e-12), type_vocab_size=get("type_vocab_size", 2),
                         position_start=start, classifier_head="pooler" if model_type == "bert" else "dense_tanh",
                         hf_model_type="xlm-roberta" if model_type == "xlm-roberta" else "", **common)
  prefix = ENCODER_FAMILIES[model_type]
  if arch in (None, f"{prefix}Model"):
    pooler = any(n.endswith("pooler.dense.weight") for n in weight_names)
    return lambda rngs: Bert(config, with_pooler=pooler, rngs=rngs)
  if arch in (f"{prefix}ForMaskedLM", "BertForPreTraining"):
    return lambda rngs: BertForMaskedLM(config, rngs=rngs)
  if arch == f"{prefix}ForSequenceClassification":
    labels = len(hf["id2label"]) if hf.get("id2label") else get("num_labels", 2)
    # classifier_pooling: ModernBERT's key; jaxlm writes it for a mean-pooling head of the other families too
    need(hf.get("classifier_pooling", "cls") in ("cls", "mean"), "classifier_pooling", "cls, mean")
    config = dataclasses.replace(config, classifier_pooling=hf.get("classifier_pooling", "cls"))
    return lambda rngs: BertForSequenceClassification(config, labels, rngs=rngs)
  raise ValueError(f"{where}: architectures={hf.get('architectures')} is not supported for {model_type} (jaxlm "
                   f"supports {prefix}Model, {prefix}ForMaskedLM, {prefix}ForSequenceClassification)")


def _modernbert_config(hf: dict, get: Callable, need: Callable, common: dict) -> ModelConfig:
  """ModernBERT's options: rotary, pre-norm, GeGLU, no linear biases; full attention on layers 0, N, 2N, ..."""
  for key, value, supported in (("hidden_activation", "gelu", "gelu"), ("classifier_activation", "gelu", "gelu"),
                                ("attention_bias", False, "false"), ("mlp_bias", False, "false"),
                                ("classifier_bias", False, "false"), ("decoder_bias", True, "true"),
                                ("tie_word_embeddings", True, "true")):
    need(get(key, value) == value, key, supported)
  layers = get("num_hidden_layers")
  need(get("global_attn_every_n_layers", 3) >= 1, "global_attn_every_n_layers", "1 or more")
  kinds = hf.get("layer_types") or ["sliding_attention" if i % get("global_attn_every_n_layers", 3) else
                                    "full_attention" for i in range(layers)]
  full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
  every = full[1] if len(full) > 1 else layers
  need(len(kinds) == layers and full[:1] == [0] and full == list(range(0, layers, every))
       and set(kinds) <= {"full_attention", "sliding_attention"}, "layer_types",
       "full_attention on layers 0, N, 2N, ... and sliding_attention between")
  local = len(full) < layers
  rope = hf.get("rope_parameters") or {}
  for kind in ("full_attention", "sliding_attention"):
    need((rope.get(kind) or {}).get("rope_type", "default") == "default", "rope_parameters", "rope_type default")
  theta = (rope.get("full_attention") or {}).get("rope_theta") or get("global_rope_theta", 160000.0)
  local_theta = (rope.get("sliding_attention") or {}).get("rope_theta") or get("local_rope_theta", 10000.0)
  need(get("hidden_size") % get("num_attention_heads") == 0, "num_attention_heads", "a divisor of hidden_size")
  return ModelConfig(flavour="bert", num_layers=layers, d_model=get("hidden_size"),
                     num_heads=get("num_attention_heads"), d_ff=get("intermediate_size"),
                     max_seq_len=get("max_position_embeddings"), layer_norm_eps=get("norm_eps", 1e-5),
                     type_vocab_size=0, rotary_positions=True, pre_norm=True, gated_mlp=True, linear_bias=False,
                     norm_bias=bool(get("norm_bias", False)), rope_theta=float(theta),
                     rope_local_theta=float(local_theta) if local else 0.0,
                     encoder_window=get("local_attention", 128) if local else 0,
                     encoder_global_every=every if local else 1, classifier_head="transform", **common)


# ----------------------------------------------------------------------------------------------- config.json out


def encoder_hf_keys(model: nnx.Module, common: dict) -> dict:
  """config.json of a jaxlm encoder, with the model_type its options imply."""
  c = model.config
  name = family(c)
  if (c.num_kv_heads or c.num_heads) != c.num_heads or c.attention_head_dim:
    raise ValueError(f"model.num_kv_heads={c.num_kv_heads}, model.attention_head_dim={c.attention_head_dim}: HF "
                     f"{name} has neither grouped-query attention nor heads of another size")
  sizes = {"num_hidden_layers": c.num_layers, "hidden_size": c.d_model, "num_attention_heads": c.num_heads,
           "intermediate_size": c.mlp_width}
  no_dropout = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}  # jaxlm trains without dropout
  if _architecture(name) in ("bert", "roberta"):
    out = {**sizes, "hidden_act": "gelu", "max_position_embeddings": c.max_seq_len + c.position_start,
           "type_vocab_size": c.type_vocab_size, "layer_norm_eps": c.layer_norm_eps,
           "position_embedding_type": "absolute", "pad_token_id": max(c.position_start - 1, 0), **no_dropout}
  elif name == "distilbert":
    if c.layer_norm_eps != _DISTILBERT_EPS:
      raise ValueError(f"model.layer_norm_eps={c.layer_norm_eps}: HF DistilBERT's LayerNorms have eps "
                       f"{_DISTILBERT_EPS}")
    out = {"n_layers": c.num_layers, "dim": c.d_model, "n_heads": c.num_heads, "hidden_dim": c.mlp_width,
           "activation": "gelu", "max_position_embeddings": c.max_seq_len, "sinusoidal_pos_embds": False,
           "pad_token_id": 0, "dropout": 0.0, "attention_dropout": 0.0, "seq_classif_dropout": 0.0, "qa_dropout": 0.0}
  else:
    kinds = ["sliding_attention" if c.encoder_window and i % c.encoder_global_every else "full_attention"
             for i in range(c.num_layers)]
    local_theta = c.rope_local_theta or c.rope_theta
    out = {**sizes, "hidden_activation": "gelu", "max_position_embeddings": c.max_seq_len, "norm_eps": c.layer_norm_eps,
           "norm_bias": c.norm_bias, "attention_bias": False, "mlp_bias": False, "classifier_bias": False,
           "decoder_bias": True, "classifier_activation": "gelu", "classifier_pooling": c.classifier_pooling,
           # a window of every position where no layer is local
           "local_attention": c.encoder_window or 2 * c.max_seq_len, "layer_types": kinds,
           "global_attn_every_n_layers": c.encoder_global_every,  # transformers < 5 reads it and the two thetas
           "global_rope_theta": c.rope_theta, "local_rope_theta": local_theta,
           "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": c.rope_theta},
                               "sliding_attention": {"rope_type": "default", "rope_theta": local_theta}},
           "pad_token_id": None, "cls_token_id": None, "sep_token_id": None, "attention_dropout": 0.0,
           "embedding_dropout": 0.0, "mlp_dropout": 0.0, "classifier_dropout": 0.0}
  out = {"architectures": [ENCODER_FAMILIES[name] + _CLASS_SUFFIX[type(model)]], "model_type": name, **out, **common}
  if isinstance(model, BertForSequenceClassification):
    out["id2label"] = {str(i): f"LABEL_{i}" for i in range(model.num_labels)}
    out["label2id"] = {f"LABEL_{i}": i for i in range(model.num_labels)}
    if c.classifier_pooling == "mean":  # transformers' other families ignore it and pool the first token
      out["classifier_pooling"] = "mean"
  return out


# ----------------------------------------------------------------------------------------------- the weights' tables


def rules(model: nnx.Module) -> tuple[list[tuple[str, str, hf_rules.Rule]], str]:
  """hf_weights._rules of an encoder: (HF prefix, jaxlm prefix, rule) for every parameter, and the HF base prefix."""
  c = model.config
  name = _architecture(family(c))
  encoder = model if isinstance(model, Bert) else model.bert
  if name in ("bert", "roberta"):
    base = _bert_rules(c, encoder.pooler is not None)
  else:
    base = _distilbert_rules(c) if name == "distilbert" else _modernbert_rules(c)
  # A bare encoder is saved without the prefix its heads' checkpoints put on it.
  prefix, jax_prefix = ("", "") if encoder is model else (_BASE_PREFIX[name], "bert/")
  return [(prefix, jax_prefix, r) for r in base] + [("", "", r) for r in _head_rules(model, name)], prefix


def _linear(hf_name: str, out: int, inp: int, w: str, b: str | None = None) -> list[hf_rules.Rule]:
  """An nn.Linear (weight [out, in], bias [out]) <-> the jaxlm parameters `w` and `b` (None: no bias)."""
  return [hf_rules.rule("linear", f"{hf_name}.weight", (out, inp), w)] + (
      [hf_rules.rule("copy", f"{hf_name}.bias", (out,), b)] if b else [])


def _norm(hf_name: str, d: int, path: str, bias: bool = True, identity_first: bool = False) -> list[hf_rules.Rule]:
  """A LayerNorm <-> `path`/scale (and /bias); `identity_first`: layer 0 has none in HF (an Identity)."""
  scale = hf_rules.rule("copy", f"{hf_name}.weight", (d,), f"{path}/scale", fill=1.0 if identity_first else None)
  return [scale] + ([hf_rules.rule("copy", f"{hf_name}.bias", (d,), f"{path}/bias",
                                   fill=0.0 if identity_first else None)]
                    if bias else [])


def _bert_rules(c: ModelConfig, with_pooler: bool) -> list[hf_rules.Rule]:
  """BERT's and RoBERTa's encoder (RoBERTa's position table holds position_start more rows)."""
  d, f, layer = c.d_model, c.mlp_width, "encoder.layer.{i}."
  table = [hf_rules.rule("copy", "embeddings.word_embeddings.weight", (c.vocab_size, d), "token_embed/embedding"),
           hf_rules.rule("copy", "embeddings.position_embeddings.weight", (c.max_seq_len + c.position_start, d),
                 "position_embed/embedding"),
           hf_rules.rule("copy", "embeddings.token_type_embeddings.weight", (c.type_vocab_size, d),
                         "type_embed/embedding"),
           *_norm("embeddings.LayerNorm", d, "embed_norm")]
  for name, x in (("query", "q"), ("key", "k"), ("value", "v")):
    table += _linear(layer + f"attention.self.{name}", d, d, f"blocks/attn/w_{x}", f"blocks/attn/b_{x}")
  return table + [*_linear(layer + "attention.output.dense", d, d, "blocks/attn/w_o", "blocks/attn/b_o"),
                  *_norm(layer + "attention.output.LayerNorm", d, "blocks/attn_norm"),
                  *_linear(layer + "intermediate.dense", f, d, "blocks/mlp/w_in", "blocks/mlp/b_in"),
                  *_linear(layer + "output.dense", d, f, "blocks/mlp/w_out", "blocks/mlp/b_out"),
                  *_norm(layer + "output.LayerNorm", d, "blocks/mlp_norm"),
                  *(_linear("pooler.dense", d, d, "pooler/w", "pooler/b") if with_pooler else [])]


def _distilbert_rules(c: ModelConfig) -> list[hf_rules.Rule]:
  d, f, layer = c.d_model, c.mlp_width, "transformer.layer.{i}."
  table = [hf_rules.rule("copy", "embeddings.word_embeddings.weight", (c.vocab_size, d), "token_embed/embedding"),
           hf_rules.rule("copy", "embeddings.position_embeddings.weight", (c.max_seq_len, d),
                         "position_embed/embedding"),
           *_norm("embeddings.LayerNorm", d, "embed_norm")]
  for name, x in (("q_lin", "q"), ("k_lin", "k"), ("v_lin", "v"), ("out_lin", "o")):
    table += _linear(layer + f"attention.{name}", d, d, f"blocks/attn/w_{x}", f"blocks/attn/b_{x}")
  return table + [*_norm(layer + "sa_layer_norm", d, "blocks/attn_norm"),
                  *_linear(layer + "ffn.lin1", f, d, "blocks/mlp/w_in", "blocks/mlp/b_in"),
                  *_linear(layer + "ffn.lin2", d, f, "blocks/mlp/w_out", "blocks/mlp/b_out"),
                  *_norm(layer + "output_layer_norm", d, "blocks/mlp_norm")]


def _modernbert_rules(c: ModelConfig) -> list[hf_rules.Rule]:
  """q, k, v in one nn.Linear (Wqkv) and the GeGLU's input (activated) and gate halves in another (Wi)."""
  d, f, bias, layer = c.d_model, c.mlp_width, c.norm_bias, "layers.{i}."
  return [hf_rules.rule("copy", "embeddings.tok_embeddings.weight", (c.vocab_size, d), "token_embed/embedding"),
          *_norm("embeddings.norm", d, "embed_norm", bias),
          *_norm(layer + "attn_norm", d, "blocks/attn_norm", bias, identity_first=True),
          hf_rules.rule("fused_linear", layer + "attn.Wqkv.weight", (3 * d, d), "blocks/attn/w_q", "blocks/attn/w_k",
                "blocks/attn/w_v"),
          *_linear(layer + "attn.Wo", d, d, "blocks/attn/w_o"),
          *_norm(layer + "mlp_norm", d, "blocks/mlp_norm", bias),
          hf_rules.rule("fused_linear", layer + "mlp.Wi.weight", (2 * f, d), "blocks/mlp/w_gate", "blocks/mlp/w_up"),
          *_linear(layer + "mlp.Wo", d, f, "blocks/mlp/w_down"),
          *_norm("final_norm", d, "final_norm", bias)]


# HF names of each family's masked-LM head: dense, LayerNorm, the (tied) decoder's bias.
_MLM_HEADS = {"bert": ("cls.predictions.transform.dense", "cls.predictions.transform.LayerNorm",
                       "cls.predictions.bias"),
              "roberta": ("lm_head.dense", "lm_head.layer_norm", "lm_head.bias"),
              "distilbert": ("vocab_transform", "vocab_layer_norm", "vocab_projector.bias"),
              "modernbert": ("head.dense", "head.norm", "decoder.bias")}


def _head_rules(model: nnx.Module, name: str) -> list[hf_rules.Rule]:
  """Rules outside the base model's prefix: the masked-LM or classification head."""
  c, d = model.config, model.config.d_model
  if isinstance(model, BertForMaskedLM):
    dense, norm, vocab_bias = _MLM_HEADS[name]
    return [*_linear(dense, d, d, "transform/w", "transform/b" if c.linear_bias else None),
            *_norm(norm, d, "transform_norm", c.norm_bias),
            hf_rules.rule("copy", vocab_bias, (c.vocab_size,), "vocab_bias")]
  if not isinstance(model, BertForSequenceClassification):
    return []
  n = model.num_labels
  if name == "roberta":  # one module: classifier.dense + tanh, classifier.out_proj
    return [*_linear("classifier.dense", d, d, "pre_classifier/w", "pre_classifier/b"),
            *_linear("classifier.out_proj", n, d, "classifier/w", "classifier/b")]
  head = {"distilbert": _linear("pre_classifier", d, d, "pre_classifier/w", "pre_classifier/b"),
          "modernbert": [*_linear("head.dense", d, d, "transform/w"),
                         *_norm("head.norm", d, "transform_norm", c.norm_bias)]}.get(name, [])
  return head + _linear("classifier", n, d, "classifier/w", "classifier/b")
