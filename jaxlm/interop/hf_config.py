"""HF config.json <-> jaxlm model configs, for GPT-2, the BERT-style encoder families (hf_encoders.py) and the
Llama-shaped decoder families (hf_decoders.py): which jaxlm model a config.json describes (or a one-line error naming
the key jaxlm does not support), and the config.json transformers needs for a jaxlm model.
The weights' names and shapes are jaxlm/interop/hf_weights.py's tables.
"""

from __future__ import annotations

import json
import os
from typing import Callable

from flax import nnx

from jaxlm.config import ModelConfig
from jaxlm.interop import hf_decoders, hf_encoders, hf_keys
from jaxlm.interop.hf_decoders import DECODER_FAMILIES
from jaxlm.models.gpt import GPT


def model_from_hf_config(hf: dict, where: str, weight_names: set[str], c_dtype: str, p_dtype: str
                          ) -> Callable[[nnx.Rngs], nnx.Module]:
  """A constructor of the jaxlm model that config.json describes, or a one-line error naming the key."""
  get, need = hf_keys.readers(hf, where)

  model_type = hf.get("model_type")
  families = ", ".join(["gpt2", *hf_encoders.ENCODER_FAMILIES, *DECODER_FAMILIES])
  if hf.get("auto_map"):
    raise ValueError(f"{where}: auto_map names custom modelling code; jaxlm never runs remote code "
                     f"(trust_remote_code) and reads only {families}")
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
  if model_type in hf_encoders.ENCODER_FAMILIES:
    return hf_encoders.encoder_model(hf, where, weight_names, common)
  raise ValueError(f"{where}: model_type={model_type!r} (architectures={hf.get('architectures')}) is not supported; "
                   f"jaxlm reads {families}")


def hf_config(model: nnx.Module) -> dict:
  c = model.config
  common = {"vocab_size": c.vocab_size, "initializer_range": c.init_std, "torch_dtype": c.param_dtype,
            "bos_token_id": None, "eos_token_id": None}
  if isinstance(model, GPT) and c.flavour == "gpt2":
    extras = {"sliding_window": c.sliding_window, "attention_softcap": c.attention_softcap,
              "logit_softcap": c.logit_softcap, "query_pre_attn_scalar": c.query_pre_attn_scalar}
    if key := next((k for k, v in extras.items() if v), None):
      raise ValueError(f"model.{key}={extras[key]}: HF GPT-2 has none; export a llama-flavoured model (Mistral, Gemma)")
    if (c.num_kv_heads or c.num_heads) != c.num_heads:
      raise ValueError(f"model.num_kv_heads={c.num_kv_heads}: HF GPT-2 has no grouped-query attention; use llama")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": c.num_layers,
            "n_embd": c.d_model, "n_head": c.num_heads, "n_inner": c.d_ff or None, "n_positions": c.max_seq_len,
            "layer_norm_epsilon": c.layer_norm_eps, "activation_function": "gelu_new", "scale_attn_weights": True,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,  # jaxlm trains without dropout
            "tie_word_embeddings": c.tie_embeddings, **common}
  if isinstance(model, GPT):
    return hf_decoders.decoder_hf_keys(c, common)
  return hf_encoders.encoder_hf_keys(model, common)


def model_config_from_file(path: str, compute_dtype: str = "float32", param_dtype: str = "float32") -> ModelConfig:
  """The ModelConfig an HF config.json describes (`path`: the file, or a folder holding it), from that file alone:
  the model is built abstractly (no weights), as jaxlm.interop.hf_weights builds it. A key jaxlm cannot read is a
  one-line error naming it."""
  where = os.path.join(path, "config.json") if os.path.isdir(path) else path
  if not os.path.isfile(where):
    raise ValueError(f"{where}: not found; give an HF config.json or a folder holding one")
  with open(where) as f:
    try:
      hf = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"{where}: not JSON ({e})") from None
  make = model_from_hf_config(hf, where, set(), compute_dtype, param_dtype)
  return nnx.eval_shape(lambda: make(nnx.Rngs(0))).config
