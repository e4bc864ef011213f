"""HF config.json <-> jaxlm model configs, for GPT-2, BERT and the Llama-shaped decoders (Llama, Mixtral, Qwen3,
Qwen3-MoE, OLMoE): which jaxlm model a config.json describes (or a
one-line error naming the key jaxlm does not support), and the config.json transformers needs for a jaxlm model.
The weights' names and shapes are jaxlm/interop/hf_weights.py's tables.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from flax import nnx

from jaxlm.config import ModelConfig
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
                     "(trust_remote_code) and reads only gpt2, bert and " + ", ".join(LLAMA_FAMILIES))
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
  if model_type in LLAMA_FAMILIES:
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    need(rope_type in ("default", "linear", "llama3"), "rope_parameters" if "rope_parameters" in hf else
         "rope_scaling", "rope_type default, linear, llama3")
    need(get("hidden_act", "silu") == "silu", "hidden_act", "silu")
    need(not hf.get("attention_bias") and not hf.get("mlp_bias"), "attention_bias", "no biases")
    need(not hf.get("use_sliding_window") and (not hf.get("sliding_window") or hf["sliding_window"] >= get(
        "max_position_embeddings", 2048)), "sliding_window", "none, or at least max_position_embeddings")
    d, h = get("hidden_size"), get("num_attention_heads")
    head_dim = hf.get("head_dim") or d // h
    if model_type in ("llama", "mixtral"):
      need(head_dim == d // h, "head_dim", "hidden_size / num_attention_heads")
    config = ModelConfig(flavour="llama", num_layers=get("num_hidden_layers"), d_model=d, num_heads=h,
                         num_kv_heads=get("num_key_value_heads", None) or h, d_ff=get("intermediate_size"),
                         attention_head_dim=0 if head_dim * h == d else head_dim,
                         qk_norm={"qwen3": "head", "qwen3_moe": "head", "olmoe": "full"}.get(model_type, ""),
                         qkv_bias=model_type == "qwen2",
                         max_seq_len=get("max_position_embeddings", 2048), layer_norm_eps=get("rms_norm_eps", 1e-6),
                         rope_theta=float(hf.get("rope_theta") or rope.get("rope_theta") or 10000.0),
                         rope_scaling="" if rope_type == "default" else rope_type,
                         rope_factor=float(rope.get("factor", 1.0)),
                         rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
                         rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
                         rope_original_max_positions=int(rope.get("original_max_position_embeddings", 8192)),
                         tie_embeddings=get("tie_word_embeddings", False), **common)
    if model_type == "mixtral":
      need(not hf.get("router_jitter_noise"), "router_jitter_noise", "0")
      config = dataclasses.replace(config, num_experts=get("num_local_experts"), expert_d_ff=config.d_ff)
    elif model_type == "qwen3_moe":
      need(get("decoder_sparse_step", 1) == 1, "decoder_sparse_step", "1 (every layer a mixture of experts)")
      need(not hf.get("mlp_only_layers"), "mlp_only_layers", "none (every layer a mixture of experts)")
      experts = hf.get("num_experts") or get("num_local_experts")
      config = dataclasses.replace(config, num_experts=experts, expert_d_ff=get("moe_intermediate_size"),
                                   router_normalize_topk=bool(get("norm_topk_prob", False)))
    elif model_type == "olmoe":
      need(hf.get("clip_qkv") is None, "clip_qkv", "null")
      config = dataclasses.replace(config, num_experts=get("num_experts"), expert_d_ff=config.d_ff,
                                   router_normalize_topk=bool(get("norm_topk_prob", False)))
    if config.num_experts:
      config = dataclasses.replace(config, experts_per_token=get("num_experts_per_tok"), router_z_weight=0.0,
                                   router_balance_weight=get("router_aux_loss_coef", 0.001))
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
                   "jaxlm reads gpt2, bert and " + ", ".join(LLAMA_FAMILIES))


# The Llama-shaped decoders jaxlm reads and writes: model_type -> architecture.
LLAMA_FAMILIES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                  "qwen3": "Qwen3ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}


def hf_family(c: ModelConfig) -> str:
  """The HF model_type of a llama-flavoured jaxlm decoder, from its query/key norm and experts."""
  family = {("", False, False): "llama", ("", True, False): "mixtral", ("", False, True): "qwen2",
            ("head", False, False): "qwen3", ("head", True, False): "qwen3_moe",
            ("full", True, False): "olmoe"}.get((c.qk_norm, bool(c.num_experts), c.qkv_bias))
  if family is None:
    raise ValueError(f"model.qk_norm={c.qk_norm!r} with model.num_experts={c.num_experts} and "
                     f"model.qkv_bias={c.qkv_bias} has no HF counterpart jaxlm writes")
  return family


def _rope_parameters(c: ModelConfig) -> dict:
  """config.json's `rope_parameters` of the model's rotary frequencies."""
  if not c.rope_scaling:
    return {"rope_type": "default", "rope_theta": c.rope_theta}
  out = {"rope_type": c.rope_scaling, "rope_theta": c.rope_theta, "factor": c.rope_factor}
  if c.rope_scaling == "llama3":
    out.update(low_freq_factor=c.rope_low_freq_factor, high_freq_factor=c.rope_high_freq_factor,
               original_max_position_embeddings=c.rope_original_max_positions)
  return out


def _llama_keys(c: ModelConfig, common: dict) -> dict:
  """The config.json keys of a Llama-style decoder (Llama, and Mixtral's non-expert part)."""
  return {"num_hidden_layers": c.num_layers, "hidden_size": c.d_model, "num_attention_heads": c.num_heads,
          "num_key_value_heads": c.num_kv_heads or c.num_heads, "head_dim": c.head_dim,
          "intermediate_size": c.mlp_width, "hidden_act": "silu", "max_position_embeddings": c.max_seq_len,
          "rms_norm_eps": c.layer_norm_eps, "rope_theta": c.rope_theta,  # transformers < 5 reads rope_theta
          "rope_parameters": _rope_parameters(c), "attention_bias": False,
          **({"rope_scaling": _rope_parameters(c)} if c.rope_scaling else {}),  # transformers < 5's key
          "mlp_bias": False, "tie_word_embeddings": c.tie_embeddings, **common}


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
    family = hf_family(c)
    keys = {**_llama_keys(c, common), "architectures": [LLAMA_FAMILIES[family]], "model_type": family}
    if c.num_experts:
      if c.shared_expert_d_ff:
        raise ValueError(f"model.shared_expert_d_ff={c.shared_expert_d_ff}: HF {family} has no shared expert")
      keys.update(num_experts_per_tok=c.experts_per_token, router_aux_loss_coef=c.router_balance_weight,
                  output_router_logits=False, norm_topk_prob=c.router_normalize_topk)
      if family == "mixtral":
        if not c.router_normalize_topk:
          raise ValueError("HF Mixtral renormalises the top-k weights; model.router_normalize_topk=False has no "
                           "Mixtral counterpart (OLMoE's needs model.qk_norm=full)")
        keys.update(intermediate_size=c.expert_width, num_local_experts=c.num_experts, router_jitter_noise=0.0)
      elif family == "qwen3_moe":
        keys.update(moe_intermediate_size=c.expert_width, num_experts=c.num_experts, decoder_sparse_step=1,
                    mlp_only_layers=[])
      else:
        keys.update(intermediate_size=c.expert_width, num_experts=c.num_experts, clip_qkv=None)
    return keys
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
