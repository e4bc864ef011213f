"""BERT-style bidirectional encoders with masked-LM and sequence-classification heads (`ModelConfig.flavour =
"bert"`): BERT, and as options of the same model RoBERTa, DistilBERT and ModernBERT.

BERT: word + learned position + token-type embeddings, then LayerNorm; post-LayerNorm blocks (x = norm(x + f(x)))
with exact-GELU MLPs and biases everywhere, as in HF `BertModel`. The options (jaxlm/config.py, beside
type_vocab_size): RoBERTa counts its positions from `position_start`; DistilBERT has no token types
(`type_vocab_size=0`); ModernBERT has rotary positions, pre-LayerNorm blocks and a final norm, a GeGLU MLP, no biases,
and local layers that see only the keys within `encoder_window // 2` positions between its global ones. The heads
before a classifier's last linear layer are `classifier_head`'s. Padding is a key mask: padded positions are still
computed (and match HF's values) but no position attends to them.

  Bert                           model.encode(input_ids, attention_mask=..., token_type_ids=...) -> [B, T, D]
                                 model.pool(hidden) -> [B, D] (tanh(dense(first token)))
  BertForMaskedLM                model(input_ids, ...) -> logits [B, T, V] (decoder tied to the word embeddings)
  BertForSequenceClassification  model(input_ids, ...) -> logits [B, num_labels], from the first token's state
                                 (model.classifier_pooling=cls, as HF) or the mean over the tokens (mean, no pooler),
                                 through model.classifier_head
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm import kernels as kernels_lib
from jaxlm.config import CLASSIFIER_HEADS, ModelConfig
from jaxlm.kernels import Kernels
from jaxlm.models.masks import padding_mask
from jaxlm.models.layers import MLP, Attention, Dense, Embed, GatedMLP, LayerNorm, scan_blocks, stacked
from jaxlm.models.rotary import Rotary, rotary_tables
from jaxlm.models.precision import Policy
from jaxlm.parallel.sharding import constrain

RESIDUAL_AXES = ("act_batch", "act_residual_seq", "act_embed")


def _check(config: ModelConfig, kernels: Kernels | None) -> Kernels:
  """Refuses a decoder config; returns the kernels (None: `auto` resolved for a bidirectional model)."""
  if config.flavour != "bert":
    raise ValueError(f"model.flavour={config.flavour!r}: BERT models need flavour='bert'")
  return kernels or kernels_lib.resolve(compute_dtype=config.compute_dtype, causal=False,
                                         head_dim=config.head_dim)


class BertBlock(nnx.Module):
  """Post-LayerNorm block: x = norm(x + attn(x)), then x = norm(x + mlp(x)); with model.pre_norm x = x +
  attn(norm(x)), then x = x + mlp(norm(x)). The MLP is GELU between two layers, or GELU-gated (model.gated_mlp)."""

  def __init__(self, config: ModelConfig, policy: Policy, kernels: Kernels, *, rngs: nnx.Rngs):
    d, std, eps = config.d_model, config.init_std, config.layer_norm_eps
    self.pre_norm = config.pre_norm
    self.attn = Attention(d, config.num_heads, config.num_kv_heads or config.num_heads, policy, kernels, std, std,
                          use_bias=config.linear_bias, rngs=rngs)
    self.attn_norm = LayerNorm(d, eps, policy, kernels, use_bias=config.norm_bias)
    self.mlp = (GatedMLP(d, config.mlp_width, policy, kernels, std, std, activation="gelu", rngs=rngs)
                if config.gated_mlp else
                MLP(d, config.mlp_width, policy, kernels, std, std, approximate_gelu=False, rngs=rngs))
    self.mlp_norm = LayerNorm(d, eps, policy, kernels, use_bias=config.norm_bias)

  def __call__(self, x_BTD: jax.Array, mask_BTS: jax.Array, rotary: Rotary | None = None,
               first: jax.Array | bool = False) -> jax.Array:
    if not self.pre_norm:
      x_BTD = self.attn_norm(x_BTD + self.attn(x_BTD, mask_BTS, rotary))
      return constrain(self.mlp_norm(x_BTD + self.mlp(x_BTD)), RESIDUAL_AXES)
    # The first block's attention reads the embeddings, already normed, as they are (HF ModernBERT's Identity).
    h_BTD = jnp.where(first, x_BTD, self.attn_norm(x_BTD))
    x_BTD = x_BTD + self.attn(h_BTD, mask_BTS, rotary)
    return constrain(x_BTD + self.mlp(self.mlp_norm(x_BTD)), RESIDUAL_AXES)


def learned_positions(attention_mask_BT: jax.Array, start: int) -> jax.Array:
  """The position ids [B, T] of a learned table: 0, 1, ... for every position (start 0: BERT), or the attended tokens
  counted from `start` with padding at start - 1 (RoBERTa: HF's create_position_ids_from_input_ids, which counts the
  ids that are not the pad id: the same for a padded batch)."""
  if not start:
    return jnp.broadcast_to(jnp.arange(attention_mask_BT.shape[1]), attention_mask_BT.shape)
  attended_BT = attention_mask_BT.astype(jnp.int32)
  return jnp.cumsum(attended_BT, axis=1) * attended_BT + (start - 1)


class Bert(nnx.Module):
  """The encoder (HF `BertModel`); `with_pooler=False` drops the pooler, as HF's masked-LM model does."""

  def __init__(self, config: ModelConfig, kernels: Kernels | None = None, *, with_pooler: bool = True,
               rngs: nnx.Rngs):
    kernels = _check(config, kernels)
    self.config = config
    policy = Policy.from_model_config(config)
    self.policy = policy
    self.kernels = kernels
    c, d, std = config, config.d_model, config.init_std
    self.token_embed = Embed(c.vocab_size, d, ("vocab", "embed"), policy, kernels, std, rngs=rngs)
    self.position_embed = (None if c.rotary_positions else Embed(c.max_seq_len + c.position_start, d,
                                                                 ("positions", "embed"), policy, kernels, std,
                                                                 rngs=rngs))
    self.type_embed = (Embed(c.type_vocab_size, d, (None, "embed"), policy, kernels, std, rngs=rngs)
                       if c.type_vocab_size else None)
    self.embed_norm = LayerNorm(d, c.layer_norm_eps, policy, kernels, use_bias=c.norm_bias)
    self.blocks = stacked(c.num_layers, lambda r: BertBlock(c, policy, kernels, rngs=r), rngs)
    self.final_norm = LayerNorm(d, c.layer_norm_eps, policy, kernels, use_bias=c.norm_bias) if c.pre_norm else None
    self.pooler = Dense(d, d, ("embed", None), policy, kernels, std, rngs=rngs) if with_pooler else None

  def encode(self, input_ids_BT: jax.Array, attention_mask: jax.Array | None = None,
             token_type_ids: jax.Array | None = None) -> jax.Array:
    """Last hidden state [B, T, D] (output dtype, f32). `attention_mask` [B, T]: 1 = token, 0 = padding;
    `token_type_ids` [B, T]: sentence A (0) / B (1), None for a model without token types. Both default as in HF
    (all tokens, type 0)."""
    c, (b, t) = self.config, input_ids_BT.shape
    if attention_mask is None:
      attention_mask = jnp.ones_like(input_ids_BT)
    if token_type_ids is not None and self.type_embed is None:
      raise ValueError("this encoder has no token types (model.type_vocab_size=0); pass token_type_ids=None")
    x_BTD = self.token_embed(input_ids_BT)
    if self.position_embed is not None:
      x_BTD = x_BTD + self.position_embed(learned_positions(attention_mask, c.position_start))
    if self.type_embed is not None:
      x_BTD = x_BTD + self.type_embed(jnp.zeros_like(input_ids_BT) if token_type_ids is None else token_type_ids)
    x_BTD = constrain(self.embed_norm(x_BTD), RESIDUAL_AXES)
    mask_BTS = padding_mask(attention_mask, t)
    local_mask_BTS = padding_mask(attention_mask, t, c.encoder_window) if c.encoder_window else mask_BTS
    rotary = local_rotary = None
    if c.rotary_positions:
      positions_BT = jnp.broadcast_to(jnp.arange(t), (b, t))
      rotary = rotary_tables(positions_BT, c.head_dim, c.rope_theta)
      local_rotary = rotary_tables(positions_BT, c.head_dim, c.rope_local_theta) if c.rope_local_theta else rotary
    # Per layer: local (its window and rotary base; layers 0, N, 2N, ... are global) and first.
    layer_L = np.arange(c.num_layers)
    local_L = layer_L % c.encoder_global_every != 0 if c.encoder_window else np.zeros(c.num_layers, bool)

    def body(block, x_BTD, flags):
      local, first = flags
      pick = (lambda if_local, if_global: jnp.where(local, if_local, if_global)) if c.encoder_window else (
          lambda _, if_global: if_global)
      rot = None if rotary is None else Rotary(*map(pick, local_rotary, rotary))
      return block(x_BTD, pick(local_mask_BTS, mask_BTS), rot, first), None

    x_BTD, _ = scan_blocks(self.blocks, body, x_BTD, self.kernels, xs=(jnp.asarray(local_L),
                                                                       jnp.asarray(layer_L == 0)))
    if self.final_norm is not None:
      x_BTD = self.final_norm(x_BTD)
    return self.policy.cast_to_output(x_BTD)

  def __call__(self, input_ids_BT, attention_mask=None, token_type_ids=None) -> jax.Array:
    return self.encode(input_ids_BT, attention_mask, token_type_ids)

  def pool(self, hidden_BTD: jax.Array) -> jax.Array:
    """HF's pooled output [B, D]: tanh(dense(hidden state of the first ([CLS]) token))."""
    if self.pooler is None:
      raise ValueError("this Bert was built with_pooler=False (as inside BertForMaskedLM); it has no pooler")
    return self.policy.cast_to_output(jnp.tanh(self.pooler(hidden_BTD[:, 0])))


class BertForMaskedLM(nnx.Module):
  """Masked-LM head: dense + GELU + LayerNorm, then the (tied) word embedding plus a vocabulary bias."""

  def __init__(self, config: ModelConfig, kernels: Kernels | None = None, *, rngs: nnx.Rngs):
    kernels = _check(config, kernels)
    self.config = config
    policy = Policy.from_model_config(config)
    self.bert = Bert(config, kernels, with_pooler=False, rngs=rngs)
    self.transform = Dense(config.d_model, config.d_model, ("embed", None), policy, kernels, config.init_std,
                           use_bias=config.linear_bias, rngs=rngs)
    self.transform_norm = LayerNorm(config.d_model, config.layer_norm_eps, policy, kernels,
                                    use_bias=config.norm_bias)
    self.vocab_bias = nnx.Param(jnp.zeros((config.vocab_size,), policy.param_dtype), axes=("vocab",))

  def encode(self, input_ids_BT, attention_mask=None, token_type_ids=None) -> jax.Array:
    return self.bert.encode(input_ids_BT, attention_mask, token_type_ids)

  def __call__(self, input_ids_BT, attention_mask=None, token_type_ids=None) -> jax.Array:
    """Logits [B, T, V] in f32."""
    h_BTD = self.transform_norm(jax.nn.gelu(self.transform(self.encode(input_ids_BT, attention_mask,
                                                                       token_type_ids)), approximate=False))
    logits_BTV = self.bert.token_embed.attend(h_BTD) + self.vocab_bias[...].astype(jnp.float32)[None, None]
    return constrain(logits_BTV, ("act_batch", "act_seq", "act_vocab"))


def mean_pool(hidden_BTD: jax.Array, attention_mask_BT: jax.Array | None) -> jax.Array:
  """[B, D]: the mean of each row's token states, padding left out (sentence-transformers' mean pooling)."""
  if attention_mask_BT is None:
    return hidden_BTD.mean(axis=1)
  weights_BT1 = attention_mask_BT.astype(hidden_BTD.dtype)[..., None]
  return (hidden_BTD * weights_BT1).sum(axis=1) / jnp.maximum(weights_BT1.sum(axis=1), 1.0)


class BertForSequenceClassification(nnx.Module):
  """Classifier on the first token's state (`classifier_pooling="cls"`) or on the mean of the tokens' states
  (`"mean"`: no pooler weights), through `classifier_head` (BERT's pooler, a dense layer and its activation, or
  ModernBERT's masked-LM-style transform), then a linear layer: logits [B, num_labels]."""

  def __init__(self, config: ModelConfig, num_labels: int, kernels: Kernels | None = None, *, rngs: nnx.Rngs):
    kernels = _check(config, kernels)
    if num_labels < 1:
      raise ValueError(f"num_labels={num_labels} must be >= 1")
    if config.classifier_pooling not in ("cls", "mean"):
      raise ValueError(f"model.classifier_pooling={config.classifier_pooling!r}: a classifier pools by cls or mean "
                       "(auto is resolved from init_from when fine-tuning)")
    self.config = config
    self.num_labels = num_labels
    policy = Policy.from_model_config(config)
    head, d, std = config.classifier_head, config.d_model, config.init_std
    if head not in CLASSIFIER_HEADS:
      raise ValueError(f"model.classifier_head={head!r} is not one of {', '.join(CLASSIFIER_HEADS)}")
    self.bert = Bert(config, kernels, with_pooler=head == "pooler" and config.classifier_pooling == "cls", rngs=rngs)
    # The head's own dense layer (RoBERTa, DistilBERT) is trained with the classifier, as peft's modules_to_save;
    # ModernBERT's transform carries the masked-LM head's names.
    self.pre_classifier = (Dense(d, d, ("embed", None), policy, kernels, std, rngs=rngs)
                           if head in ("dense_tanh", "dense_relu") else None)
    self.transform = (Dense(d, d, ("embed", None), policy, kernels, std, use_bias=config.linear_bias, rngs=rngs)
                      if head == "transform" else None)
    self.transform_norm = (LayerNorm(d, config.layer_norm_eps, policy, kernels, use_bias=config.norm_bias)
                           if head == "transform" else None)
    self.classifier = Dense(d, num_labels, ("embed", None), policy, kernels, std, rngs=rngs)

  def encode(self, input_ids_BT, attention_mask=None, token_type_ids=None) -> jax.Array:
    return self.bert.encode(input_ids_BT, attention_mask, token_type_ids)

  def classify(self, batch: dict) -> jax.Array:
    """The logits of a classification batch (input_ids, attention_mask, token_type_ids): the token types are fed
    only to a model that has them (model.type_vocab_size > 0)."""
    types = batch["token_type_ids"] if self.bert.type_embed is not None else None
    return self(batch["input_ids"], batch["attention_mask"], types)

  def __call__(self, input_ids_BT, attention_mask=None, token_type_ids=None) -> jax.Array:
    hidden_BTD = self.encode(input_ids_BT, attention_mask, token_type_ids)
    if self.config.classifier_pooling == "mean":
      pooled_BD = mean_pool(hidden_BTD, attention_mask)
    elif self.bert.pooler is not None:
      pooled_BD = self.bert.pool(hidden_BTD)
    else:
      pooled_BD = hidden_BTD[:, 0]
    head = self.config.classifier_head
    if head == "dense_tanh":
      pooled_BD = jnp.tanh(self.pre_classifier(pooled_BD))
    elif head == "dense_relu":
      pooled_BD = jax.nn.relu(self.pre_classifier(pooled_BD))
    elif head == "transform":
      pooled_BD = self.transform_norm(jax.nn.gelu(self.transform(pooled_BD), approximate=False))
    return self.classifier(pooled_BD).astype(jnp.float32)
