"""config.json <-> ModelConfig for the Llama-shaped decoder families (Llama 1-3, Mistral, Qwen2/2.5/3, Qwen3-MoE,
Mixtral, OLMoE, OLMo 2, Gemma 2/3, Phi-3): each family is a set of options of the one decoder (jaxlm/models/gpt.py),
read from its config.json (a variant jaxlm does not build is a one-line error naming the key) and written back with
the model_type those options imply. The weights' tables are jaxlm/interop/hf_weights.py's."""

from __future__ import annotations

import dataclasses

from jaxlm.config import ModelConfig
from jaxlm.interop import hf_keys

# model_type -> architecture of every decoder family read and written here.
DECODER_FAMILIES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "mixtral": "MixtralForCausalLM",
                    "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                    "olmoe": "OlmoeForCausalLM", "olmo2": "Olmo2ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                    "gemma3_text": "Gemma3ForCausalLM", "phi3": "Phi3ForCausalLM"}
GEMMAS = ("gemma2", "gemma3_text")
WINDOWED = ("mistral", "mixtral", "phi3", *GEMMAS)  # the families whose HF attention reads sliding_window
GATED_WINDOW = ("qwen2", "qwen3", "qwen3_moe")  # sliding_window only with use_sliding_window, which jaxlm refuses
ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn")


def _default_layer_types(hf: dict, model_type: str) -> list[str]:
  """HF's layer pattern when config.json has no layer_types: Gemma 2 alternates windowed and global layers, Gemma 3
  makes every sliding_window_pattern-th layer global (6 by default)."""
  every = {"gemma2": 2, "gemma3_text": hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6}
  if model_type not in every:
    return []
  return ["sliding_attention" if (i + 1) % every[model_type] else "full_attention"
          for i in range(hf.get("num_hidden_layers", 0))]


def _global_every(layer_types: list[str], where: str) -> int:
  """HF's layer_types as model.global_attention_every: every Nth layer full, the others sliding (0: none full)."""
  full = [i for i, kind in enumerate(layer_types) if kind == "full_attention"]
  if any(kind not in ("full_attention", "sliding_attention") for kind in layer_types):
    raise ValueError(f"{where}: layer_types={layer_types} is not supported (jaxlm supports full_attention and "
                     "sliding_attention)")
  every = full[0] + 1 if full else 0
  if every and full != [i for i in range(len(layer_types)) if (i + 1) % every == 0]:
    raise ValueError(f"{where}: layer_types={layer_types} is not supported (jaxlm supports every Nth layer "
                     "full_attention, the others sliding_attention)")
  return every


def decoder_config(hf: dict, where: str, common: dict) -> ModelConfig:
  """The ModelConfig of a decoder family's config.json (model_type in DECODER_FAMILIES), or a one-line error."""
  model_type = hf["model_type"]
  get, need = hf_keys.readers(hf, where)

  rope_key = "rope_parameters" if "rope_parameters" in hf else "rope_scaling"
  rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
  local_rope = {}
  if "full_attention" in rope:  # per layer kind (Gemma 3)
    rope, local_rope = rope["full_attention"], rope.get("sliding_attention", {})
  rope_type = rope.get("rope_type", rope.get("type", "default"))
  need(rope_type in ROPE_TYPES, rope_key, "rope_type " + ", ".join(ROPE_TYPES))
  need(not rope.get("mscale") and not rope.get("mscale_all_dim") and rope.get("truncate", True), rope_key,
       "yarn without mscale, mscale_all_dim or truncate=false")
  need(local_rope.get("rope_type", "default") == "default", rope_key, "default rotary for sliding_attention")
  partial = rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
  need(partial == 1.0, "partial_rotary_factor", "1.0")
  gemma = model_type in GEMMAS
  act_key = "hidden_activation" if gemma else "hidden_act"
  act = hf.get(act_key) or ("gelu_pytorch_tanh" if gemma else "silu")
  need(act in ("silu", "gelu_pytorch_tanh"), act_key, "silu, gelu_pytorch_tanh")
  need(not hf.get("attention_bias") and not hf.get("mlp_bias"), "attention_bias", "no biases")
  need(not hf.get("use_bidirectional_attention"), "use_bidirectional_attention", "false")
  max_positions = get("max_position_embeddings", 2048)
  if model_type in GATED_WINDOW:  # they keep a sliding_window they use only with use_sliding_window (per layer)
    need(not hf.get("use_sliding_window"), "use_sliding_window", "false")
  window = (hf.get("sliding_window") or 0) if model_type in WINDOWED else 0
  window = 0 if window >= max_positions else window  # a window as long as the context is none
  layer_types = hf.get("layer_types") or _default_layer_types(hf, model_type)
  every = _global_every(layer_types, where) if window and layer_types else 0
  if window and layer_types and "sliding_attention" not in layer_types:
    window = 0  # every layer full
  d, h = get("hidden_size"), get("num_attention_heads")
  head_dim = hf.get("head_dim") or d // h
  if model_type in ("llama", "mixtral"):
    need(head_dim == d // h, "head_dim", "hidden_size / num_attention_heads")
  theta = float(rope.get("rope_theta") or hf.get("rope_theta") or 10000.0)
  local_theta = 0.0
  if model_type == "gemma3_text":  # windowed layers: the default rotary at their own base
    local_theta = float(local_rope.get("rope_theta") or hf.get("rope_local_base_freq") or 10000.0)
    if window and not every:  # every layer windowed: all of them take it
      theta, local_theta, rope, rope_type = local_theta, 0.0, {}, "default"
  # Phi-3 keeps the pretrained context at the top level, which HF reads first; yarn's factor defaults to the ratio.
  original = ((hf.get("original_max_position_embeddings") if model_type == "phi3" else None)
              or rope.get("original_max_position_embeddings") or hf.get("original_max_position_embeddings")
              or max_positions)
  factor = rope.get("factor") or (max_positions / original if rope_type == "yarn" else 1.0)
  config = ModelConfig(
      flavour="llama", num_layers=get("num_hidden_layers"), d_model=d, num_heads=h,
      num_kv_heads=get("num_key_value_heads", None) or h, d_ff=get("intermediate_size"),
      attention_head_dim=0 if head_dim * h == d else head_dim,
      qk_norm={"qwen3": "head", "qwen3_moe": "head", "olmoe": "full", "olmo2": "full",
               "gemma3_text": "head"}.get(model_type, ""),
      qkv_bias=model_type == "qwen2", max_seq_len=max_positions,
      layer_norm_eps=get("rms_norm_eps", 1e-6), rope_theta=theta,
      rope_scaling="" if rope_type == "default" else rope_type, rope_factor=float(factor),
      rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
      rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
      rope_original_max_positions=(int(original) if rope_type in ("llama3", "yarn") or model_type == "phi3" else
                                   ModelConfig.rope_original_max_positions),
      rope_beta_fast=float(rope.get("beta_fast") or 32.0), rope_beta_slow=float(rope.get("beta_slow") or 1.0),
      rope_attention_factor=float(rope.get("attention_factor") or 0.0),
      rope_local_theta=local_theta if every else 0.0,
      sliding_window=window, global_attention_every=every,
      attention_softcap=float(hf.get("attn_logit_softcapping") or 0.0) if gemma else 0.0,
      logit_softcap=float(hf.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
      query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or 0.0) if gemma else 0.0,
      block_norms="sandwich" if gemma else "post" if model_type == "olmo2" else "pre",
      glu_activation="gelu_tanh" if act == "gelu_pytorch_tanh" else "silu", norm_plus_one=gemma,
      scale_embeddings=gemma, hf_model_type="phi3" if model_type == "phi3" else "",
      tie_embeddings=get("tie_word_embeddings", gemma), **common)
  if config.query_pre_attn_scalar == config.head_dim:
    config = dataclasses.replace(config, query_pre_attn_scalar=0.0)
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
  return config


def hf_family(c: ModelConfig) -> str:
  """The HF model_type of a llama-flavoured jaxlm decoder, from its options; a combination no HF family holds (which
  an export would silently drop) is a one-line error."""
  def refuse(what: str) -> ValueError:
    return ValueError(f"{what} has no HF counterpart jaxlm writes (docs/models.md lists each family's options)")

  gemma = {"norm_plus_one": c.norm_plus_one, "scale_embeddings": c.scale_embeddings,
           "glu_activation=gelu_tanh": c.glu_activation == "gelu_tanh",
           "block_norms=sandwich": c.block_norms == "sandwich"}
  if any(gemma.values()):
    family = {"": "gemma2", "head": "gemma3_text"}.get(c.qk_norm)
    if not all(gemma.values()) or c.num_experts or c.qkv_bias or c.hf_model_type or family is None:
      raise refuse(f"model.{next(k for k, v in gemma.items() if v)} without the rest of Gemma's options "
                   f"(Gemma: {', '.join(gemma)}, qk_norm '' or head, no experts or q/k/v biases)")
    if family == "gemma2" and (c.rope_local_theta or c.global_attention_every not in (0, 2)):
      raise refuse(f"Gemma 2 with model.rope_local_theta={c.rope_local_theta} or model.global_attention_every="
                   f"{c.global_attention_every} (Gemma 2: every second layer global, one rotary base)")
    if family == "gemma3_text" and (c.attention_softcap or c.logit_softcap):
      raise refuse("Gemma 3 (model.qk_norm=head) with soft-capping")
    return family
  gemma_only = {"attention_softcap": c.attention_softcap, "logit_softcap": c.logit_softcap,
                "query_pre_attn_scalar": c.query_pre_attn_scalar, "global_attention_every": c.global_attention_every,
                "rope_local_theta": c.rope_local_theta}
  if any(gemma_only.values()):
    key = next(k for k, v in gemma_only.items() if v)
    raise refuse(f"model.{key}={gemma_only[key]} outside Gemma's options")
  key = (c.qk_norm, bool(c.num_experts), c.qkv_bias, c.block_norms, bool(c.sliding_window))
  if c.hf_model_type == "phi3":
    family = "phi3" if key[:4] == ("", False, False, "pre") else None
  else:
    family = {("", False, False, "pre", False): "llama", ("", True, False, "pre", False): "mixtral",
              ("", True, False, "pre", True): "mixtral", ("", False, False, "pre", True): "mistral",
              ("", False, True, "pre", False): "qwen2", ("head", False, False, "pre", False): "qwen3",
              ("head", True, False, "pre", False): "qwen3_moe", ("full", True, False, "pre", False): "olmoe",
              ("full", False, False, "post", False): "olmo2"}.get(key)
  if family is None:
    raise refuse(f"model.qk_norm={c.qk_norm!r} with num_experts={c.num_experts}, qkv_bias={c.qkv_bias}, "
                 f"block_norms={c.block_norms}, sliding_window={c.sliding_window}"
                 + (", hf_model_type=phi3" if c.hf_model_type else ""))
  return family


def _rope_parameters(c: ModelConfig) -> dict:
  """config.json's `rope_parameters` of the model's rotary frequencies."""
  if not c.rope_scaling:
    return {"rope_type": "default", "rope_theta": c.rope_theta}
  out = {"rope_type": c.rope_scaling, "rope_theta": c.rope_theta, "factor": c.rope_factor}
  if c.rope_scaling == "llama3":
    out.update(low_freq_factor=c.rope_low_freq_factor, high_freq_factor=c.rope_high_freq_factor,
               original_max_position_embeddings=c.rope_original_max_positions)
  elif c.rope_scaling == "yarn":
    out.update(beta_fast=c.rope_beta_fast, beta_slow=c.rope_beta_slow,
               original_max_position_embeddings=c.rope_original_max_positions)
    if c.rope_attention_factor:
      out["attention_factor"] = c.rope_attention_factor
  return out


def decoder_hf_keys(c: ModelConfig, common: dict) -> dict:
  """The config.json of a llama-flavoured jaxlm decoder, in the family its options imply."""
  family = hf_family(c)
  rope = _rope_parameters(c)
  keys = {"architectures": [DECODER_FAMILIES[family]], "model_type": family, "num_hidden_layers": c.num_layers,
          "hidden_size": c.d_model, "num_attention_heads": c.num_heads,
          "num_key_value_heads": c.num_kv_heads or c.num_heads, "head_dim": c.head_dim,
          "intermediate_size": c.mlp_width, "hidden_act": "silu", "max_position_embeddings": c.max_seq_len,
          "rms_norm_eps": c.layer_norm_eps, "rope_theta": c.rope_theta,  # transformers < 5 reads rope_theta
          "rope_parameters": rope, "attention_bias": False,
          **({"rope_scaling": rope} if c.rope_scaling else {}),  # transformers < 5's key
          "mlp_bias": False, "tie_word_embeddings": c.tie_embeddings, "pad_token_id": None, **common}
  if c.sliding_window:
    keys["sliding_window"] = c.sliding_window
  if family in GEMMAS:
    every, window = c.global_attention_every, c.sliding_window
    keys.update(sliding_window=window or c.max_seq_len, hidden_activation="gelu_pytorch_tanh",
                query_pre_attn_scalar=int(c.query_pre_attn_scalar or c.head_dim),
                attn_logit_softcapping=c.attention_softcap or None, final_logit_softcapping=c.logit_softcap or None,
                layer_types=["sliding_attention" if window and (not every or (i + 1) % every) else "full_attention"
                             for i in range(c.num_layers)])
    if family == "gemma3_text":
      local = {"rope_type": "default", "rope_theta": c.rope_local_theta or c.rope_theta}
      keys.update(rope_parameters={"full_attention": rope, "sliding_attention": local},
                  rope_local_base_freq=local["rope_theta"], sliding_window_pattern=every or c.num_layers + 1)
  if family == "phi3":
    keys.update(original_max_position_embeddings=c.rope_original_max_positions, partial_rotary_factor=1.0)
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
