"""The tables between HF checkpoints and jaxlm parameters: a `Rule` maps HF tensors (name, shape) to jaxlm parameter
paths with a pure reshape/transpose/split between them (`to_jax`, `to_hf`), so a round trip is bit-identical; and the
decoders' tables (GPT-2, the Llama-shaped families). The encoders' tables are hf_encoders.py's; hf_weights.py loads and
saves with them all."""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from jaxlm.config import ModelConfig
from jaxlm.interop import hf_decoders
from jaxlm.models.gpt import GPT


@dataclasses.dataclass(frozen=True)
class Rule:
  """HF tensors (name, shape) <-> jaxlm parameters. `{i}` in a name is the layer; those rules fill the stacked
  `blocks/...` parameters one layer at a time. `kind`: copy (reshape only, incl. GPT-2's Conv1D [in, out]),
  linear (nn.Linear [out, in]: transpose, then reshape), fused (GPT-2's c_attn: split/join q, k, v on the last axis),
  fused_linear (an nn.Linear holding several: Phi-3's qkv_proj and gate_up_proj, split/joined on the out axis)."""
  kind: str
  hf: str  # HF tensor name
  shape: tuple[int, ...]  # its shape, as config.json implies
  jax: tuple[str, ...]  # jaxlm parameter paths ("a/b/c")
  first_layer_fill: float | None = None  # a number: layer 0 has no HF tensor and holds this value (ModernBERT's
                                         # first attention norm, an Identity in HF)

  @property
  def per_layer(self) -> bool:
    return "{i}" in self.hf

  @property
  def per_expert(self) -> bool:
    """`{e}` in the name: one HF tensor per expert of each layer fills the [L, E, ...] parameter."""
    return "{e}" in self.hf


def rule(kind: str, hf_name: str, hf_shape: tuple[int, ...], *jax_paths: str, fill: float | None = None) -> Rule:
  return Rule(kind, hf_name, hf_shape, jax_paths, fill)


def to_jax(rule: Rule, hf: np.ndarray, shapes: list[tuple]) -> list[np.ndarray]:
  if rule.kind == "copy":
    return [hf.reshape(shapes[0])]
  if rule.kind == "linear":
    return [hf.T.reshape(shapes[0])]
  joined = hf.T if rule.kind == "fused_linear" else hf
  # Each part's width on the joined last axis: its size over the size of the other (leading) axes.
  widths = [math.prod(s) // math.prod(joined.shape[:-1]) for s in shapes]
  parts = np.split(joined, np.cumsum(widths)[:-1], axis=-1)
  return [part.reshape(s) for part, s in zip(parts, shapes)]


def to_hf(rule: Rule, arrays: list[np.ndarray]) -> np.ndarray:
  if rule.kind == "copy":
    return arrays[0].reshape(rule.shape)
  if rule.kind == "linear":
    return arrays[0].reshape(rule.shape[::-1]).T
  if rule.kind == "fused_linear":
    return np.concatenate([a.reshape(rule.shape[1:] + (-1,)) for a in arrays], axis=-1).T
  return np.concatenate([a.reshape(rule.shape[:-1] + (-1,)) for a in arrays], axis=-1)


def gpt2_rules(c: ModelConfig) -> list[Rule]:
  d, f, v = c.d_model, c.mlp_width, c.vocab_size
  rules = [rule("copy", "wte.weight", (v, d), "token_embed/embedding"),
           rule("copy", "wpe.weight", (c.max_seq_len, d), "position_embed/embedding"),
           rule("copy", "ln_f.weight", (d,), "final_norm/scale"), rule("copy", "ln_f.bias", (d,), "final_norm/bias")]
  layer = [("ln_1.weight", (d,), "attn_norm/scale"), ("ln_1.bias", (d,), "attn_norm/bias"),
           ("attn.c_proj.weight", (d, d), "attn/w_o"), ("attn.c_proj.bias", (d,), "attn/b_o"),
           ("ln_2.weight", (d,), "mlp_norm/scale"), ("ln_2.bias", (d,), "mlp_norm/bias"),
           ("mlp.c_fc.weight", (d, f), "mlp/w_in"), ("mlp.c_fc.bias", (f,), "mlp/b_in"),
           ("mlp.c_proj.weight", (f, d), "mlp/w_out"), ("mlp.c_proj.bias", (d,), "mlp/b_out")]
  rules += [rule("copy", f"h.{{i}}.{name}", shape, f"blocks/{path}") for name, shape, path in layer]
  rules += [rule("fused", "h.{i}.attn.c_attn.weight", (d, 3 * d), *(f"blocks/attn/w_{x}" for x in "qkv")),
            rule("fused", "h.{i}.attn.c_attn.bias", (3 * d,), *(f"blocks/attn/b_{x}" for x in "qkv"))]
  return rules


def llama_rules(c: ModelConfig) -> list[Rule]:
  d, f, v = c.d_model, c.mlp_width, c.vocab_size
  qd, kvd = c.num_heads * c.head_dim, (c.num_kv_heads or c.num_heads) * c.head_dim
  rules = [rule("copy", "embed_tokens.weight", (v, d), "token_embed/embedding"),
           rule("copy", "norm.weight", (d,), "final_norm/scale")]
  norms = {"pre": [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "mlp_norm")],
           "sandwich": [("input_layernorm", "attn_norm"), ("post_attention_layernorm", "attn_post_norm"),
                        ("pre_feedforward_layernorm", "mlp_norm"), ("post_feedforward_layernorm", "mlp_post_norm")],
           "post": [("post_attention_layernorm", "attn_post_norm"),
                    ("post_feedforward_layernorm", "mlp_post_norm")]}[c.block_norms]
  layer = [("copy", f"{hf_name}.weight", (d,), f"{path}/scale") for hf_name, path in norms]
  layer += [("linear", "self_attn.q_proj.weight", (qd, d), "attn/w_q"),
            ("linear", "self_attn.k_proj.weight", (kvd, d), "attn/w_k"),
            ("linear", "self_attn.v_proj.weight", (kvd, d), "attn/w_v"),
            ("linear", "self_attn.o_proj.weight", (d, qd), "attn/w_o"),
            ("linear", "mlp.gate_proj.weight", (f, d), "mlp/w_gate"),
            ("linear", "mlp.up_proj.weight", (f, d), "mlp/w_up"),
            ("linear", "mlp.down_proj.weight", (d, f), "mlp/w_down")]
  if c.num_experts:  # a router and one MLP per expert (transformers saves them one tensor each)
    f = c.expert_width
    if hf_decoders.hf_family(c) == "mixtral":
      router, gate, up, down = ("block_sparse_moe.gate", *(f"block_sparse_moe.experts.{{e}}.{w}" for w in
                                                           ("w1", "w3", "w2")))
    else:  # Qwen3-MoE, OLMoE
      router, gate, up, down = ("mlp.gate", *(f"mlp.experts.{{e}}.{w}_proj" for w in ("gate", "up", "down")))
    layer[-3:] = [("linear", f"{router}.weight", (c.num_experts, d), "mlp/w_router"),
                  ("linear", f"{gate}.weight", (f, d), "mlp/w_gate"),
                  ("linear", f"{up}.weight", (f, d), "mlp/w_up"),
                  ("linear", f"{down}.weight", (d, f), "mlp/w_down")]
  if c.qkv_bias:  # Qwen2
    layer += [("copy", "self_attn.q_proj.bias", (qd,), "attn/b_q"),
              ("copy", "self_attn.k_proj.bias", (kvd,), "attn/b_k"),
              ("copy", "self_attn.v_proj.bias", (kvd,), "attn/b_v")]
  if c.qk_norm:  # Qwen3: one scale per head dimension; OLMoE: one per element of all heads
    q_size, k_size = (c.head_dim, c.head_dim) if c.qk_norm == "head" else (qd, kvd)
    layer += [("copy", "self_attn.q_norm.weight", (q_size,), "attn/q_norm"),
              ("copy", "self_attn.k_norm.weight", (k_size,), "attn/k_norm")]
  rules += [rule(kind, f"layers.{{i}}.{name}", shape, f"blocks/{path}") for kind, name, shape, path in layer]
  if hf_decoders.hf_family(c) == "phi3":  # q, k, v and gate, up each one nn.Linear
    fused = {"attn/w_q": ("self_attn.qkv_proj.weight", (qd + 2 * kvd, d), ("attn/w_q", "attn/w_k", "attn/w_v")),
             "mlp/w_gate": ("mlp.gate_up_proj.weight", (2 * f, d), ("mlp/w_gate", "mlp/w_up"))}
    parts = {p for _, _, paths in fused.values() for p in paths}
    rules = [r for r in rules if r.jax[0].removeprefix("blocks/") not in parts]
    rules += [Rule("fused_linear", f"layers.{{i}}.{name}", shape, tuple(f"blocks/{p}" for p in paths))
              for name, shape, paths in fused.values()]
  return rules


def decoder_head_rules(model: GPT) -> list[Rule]:
  """Rules outside the base model's prefix (HF names without `transformer.` / `model.`)."""
  c = model.config
  return [] if c.tie_embeddings else [rule("copy", "lm_head.weight", (c.vocab_size, c.d_model), "lm_head/embedding")]
