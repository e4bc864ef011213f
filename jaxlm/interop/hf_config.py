"""HF config.json <-> jaxlm model configs, for GPT-2, BERT and the Llama-shaped decoder families (hf_decoders.py):
which jaxlm model a config.json describes (or a one-line error naming the key jaxlm does not support), and the
config.json transformers needs for a jaxlm model.
The weights' names and shapes are jaxlm/interop/hf_weights.py's tables.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flax import nnx

from jaxlm.config import ModelConfig
from jaxlm.interop import hf_decoders
from jaxlm.interop.hf_decoders import DECODER_FAMILIES
from jaxlm.models.bert import Bert, BertForMaskedLM, BertForSequenceClassification
from jaxlm.models.gpt import GPT


def model_from_hf_config(hf: dict, where: str, weight_names: set[str], c_dtype: str, p_dtype: str
                          ) -> Callable[[nnx.Rngs], nnx.Module]:
  """A constructor of the jaxlm model that config.json describes, or a one-line error naming the key."""

  def get(key: str, default: Any = KeyError) -> Any:
    if key not in hf and default is KeyError:
      raise ValueError(f"{where}: missing key {key!r}")
    return hf.get(key, default)

  def need(ok: bool, key: str, supported: str) -> None:
    if not ok:
      raise ValueError(f"{where}: {key}={hf.get(key)!r} is not supported (jaxlm supports {supported})")

  model_type, arch = hf.get("model_type"), (hf.get("architectures") or [None])[0]
  if hf.get("auto_map"):
    raise ValueError(f"{where}: auto_map names custom modelling code; jaxlm never runs remote code "
                     "(trust_remote_code) and reads only gpt2, bert and " + ", ".join(DECODER_FAMILIES))
  common = dict(compute_dtype=c_dtype, param_dtype=p_dtype, vocab_size=get("vocab_size"),
                init_std=get("initializer_range", 0.02))
  if model_type == "gpt2":
    need(get("activation_function", "gelu_new") in ("gelu_new", "gelu_pytorch_tanh"), "activation_function",
         "gelu_new")
    need(not hf.get("scale_attn_by_inverse_layer_idx"), "scale_attn_by_inverse_layer_idx", "false")
    need(hf.get("scale_attn_weights", True), "scale_attn_weights", "true")
    config = ModelConfig(flavour="gpt2", num_layers=get("n_layer"), d_model=get("n_embd"), num_heads=get("n_head"),
                         d_ff=get("n_inner", None) or 0, max_seq_len=get("n_positions"),
                         layer_norm_eps=get("layer_norm_epsilon", 1e-5),
                         tie_embeddings=get("tie_word_embeddings", True), **common)
    return lambda rngs: GPT(config, rngs=rngs)
  if model_type in DECODER_FAMILIES:
    config = hf_decoders.decoder_config(hf, where, common)
    return lambda rngs: GPT(config, rngs=rngs)
  if model_type == "bert":
    need(get("hidden_act", "gelu") == "gelu", "hidden_act", "gelu")
    need(get("position_embedding_type", "absolute") == "absolute", "position_embedding_type", "absolute")
    config = ModelConfig(flavour="bert", num_layers=get("num_hidden_layers"), d_model=get("hidden_size"),
                         num_heads=get("num_attention_heads"), d_ff=get("intermediate_size"),
                         max_seq_len=get("max_position_embeddings"), layer_norm_eps=get("layer_norm_eps", 1e-12),
                         type_vocab_size=get("type_vocab_size", 2), **common)
    if arch in (None, "BertModel"):
      pooler = any(n.endswith("pooler.dense.weight") for n in weight_names)
      return lambda rngs: Bert(config, with_pooler=pooler, rngs=rngs)
    if arch in ("BertForMaskedLM", "BertForPreTraining"):
      return lambda rngs: BertForMaskedLM(config, rngs=rngs)
    if arch == "BertForSequenceClassification":
      labels = len(hf["id2label"]) if hf.get("id2label") else get("num_labels", 2)
      # classifier_pooling: written by jaxlm for a mean-pooling head (the key ModernBERT's HF config uses)
      need(hf.get("classifier_pooling", "cls") in ("cls", "mean"), "classifier_pooling", "cls, mean")
      config = dataclasses.replace(config, classifier_pooling=hf.get("classifier_pooling", "cls"))
      return lambda rngs: BertForSequenceClassification(config, labels, rngs=rngs)
    raise ValueError(f"{where}: architectures={hf.get('architectures')} is not supported for bert (jaxlm supports "
                     "BertModel, BertForMaskedLM, BertForPreTraining, BertForSequenceClassification)")
  raise ValueError(f"{where}: model_type={model_type!r} (architectures={hf.get('architectures')}) is not supported; "
                   "jaxlm reads gpt2, bert and " + ", ".join(DECODER_FAMILIES))


def hf_config(model: nnx.Module) -> dict:
  c = model.config
  common = {"vocab_size": c.vocab_size, "initializer_range": c.init_std, "torch_dtype": c.param_dtype,
            "bos_token_id": None, "eos_token_id": None}
  if isinstance(model, GPT) and c.flavour == "gpt2":
    if (c.num_kv_heads or c.num_heads) != c.num_heads:
      raise ValueError(f"model.num_kv_heads={c.num_kv_heads}: HF GPT-2 has no grouped-query attention; use llama")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": c.num_layers,
            "n_embd": c.d_model, "n_head": c.num_heads, "n_inner": c.d_ff or None, "n_positions": c.max_seq_len,
            "layer_norm_epsilon": c.layer_norm_eps, "activation_function": "gelu_new", "scale_attn_weights": True,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,  # jaxlm trains without dropout
            "tie_word_embeddings": c.tie_embeddings, **common}
  if isinstance(model, GPT):
    return hf_decoders.decoder_hf_keys(c, common)
  arch = {Bert: "BertModel", BertForMaskedLM: "BertForMaskedLM",
          BertForSequenceClassification: "BertForSequenceClassification"}[type(model)]
  out = {"architectures": [arch], "model_type": "bert", "num_hidden_layers": c.num_layers, "hidden_size": c.d_model,
         "num_attention_heads": c.num_heads, "intermediate_size": c.mlp_width, "hidden_act": "gelu",
         "max_position_embeddings": c.max_seq_len, "type_vocab_size": c.type_vocab_size,
         "layer_norm_eps": c.layer_norm_eps, "position_embedding_type": "absolute", "pad_token_id": 0,
         "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, **common}
  if isinstance(model, BertForSequenceClassification):
    out["id2label"] = {str(i): f"LABEL_{i}" for i in range(model.num_labels)}
    out["label2id"] = {f"LABEL_{i}": i for i in range(model.num_labels)}
    if c.classifier_pooling == "mean":  # transformers' BertForSequenceClassification ignores it and pools [CLS]
      out["classifier_pooling"] = "mean"
  return out
