"""BERT: a bidirectional encoder with masked-LM and sequence-classification heads (`ModelConfig.flavour = "bert"`).

Word + learned position + token-type embeddings, then LayerNorm; post-LayerNorm blocks (x = norm(x + f(x))) with
exact-GELU MLPs and biases everywhere, as in HF `BertModel`. Padding is a key mask: padded positions are still
computed (and match HF's values) but no position attends to them.

  Bert                           model.encode(input_ids, attention_mask=..., token_type_ids=...) -> [B, T, D]
                                 model.pool(hidden) -> [B, D] (tanh(dense(first token)))
  BertForMaskedLM                model(input_ids, ...) -> logits [B, T, V] (decoder tied to the word embeddings)
  BertForSequenceClassification  model(input_ids, ...) -> logits [B, num_labels], from the pooled output
                                 (model.classifier_pooling=cls, as HF) or the mean over the tokens (mean, no pooler)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm import kernels as kernels_lib
from jaxlm.config import ModelConfig
from jaxlm.kernels import Kernels
from jaxlm.models.masks import padding_mask
from jaxlm.models.layers import MLP, Attention, Dense, Embed, LayerNorm, scan_blocks, stacked
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
  """Post-LayerNorm block: x = norm(x + attn(x)), then x = norm(x + mlp(x))."""

  def __init__(self, config: ModelConfig, policy: Policy, kernels: Kernels, *, rngs: nnx.Rngs):
    d, std = config.d_model, config.init_std
    self.attn = Attention(d, config.num_heads, config.num_kv_heads or config.num_heads, policy, kernels, std, std,
                          use_bias=True, rngs=rngs)
    self.attn_norm = LayerNorm(d, config.layer_norm_eps, policy, kernels)
    self.mlp = MLP(d, config.mlp_width, policy, kernels, std, std, approximate_gelu=False, rngs=rngs)
    self.mlp_norm = LayerNorm(d, config.layer_norm_eps, policy, kernels)

  def __call__(self, x_BTD: jax.Array, mask_BTS: jax.Array) -> jax.Array:
    x_BTD = self.attn_norm(x_BTD + self.attn(x_BTD, mask_BTS))
    x_BTD = self.mlp_norm(x_BTD + self.mlp(x_BTD))
    return constrain(x_BTD, RESIDUAL_AXES)


class Bert(nnx.Module):
  """The encoder (HF `BertModel`); `with_pooler=False` drops the pooler, as HF's masked-LM model does."""

  def __init__(self, config: ModelConfig, kernels: Kernels | None = None, *, with_pooler: bool = True,
               rngs: nnx.Rngs):
    kernels = _check(config, kernels)
    self.config = config
    policy = Policy.from_model_config(config)
    self.policy = policy
    self.kernels = kernels
    d, std = config.d_model, config.init_std
    self.token_embed = Embed(config.vocab_size, d, ("vocab", "embed"), policy, kernels, std, rngs=rngs)
    self.position_embed = Embed(config.max_seq_len, d, ("positions", "embed"), policy, kernels, std, rngs=rngs)
    self.type_embed = Embed(config.type_vocab_size, d, (None, "embed"), policy, kernels, std, rngs=rngs)
    self.embed_norm = LayerNorm(d, config.layer_norm_eps, policy, kernels)
    self.blocks = stacked(config.num_layers, lambda r: BertBlock(config, policy, kernels, rngs=r), rngs)
    self.pooler = Dense(d, d, ("embed", None), policy, kernels, std, rngs=rngs) if with_pooler else None

  def encode(self, input_ids_BT: jax.Array, attention_mask: jax.Array | None = None,
             token_type_ids: jax.Array | None = None) -> jax.Array:
    """Last hidden state [B, T, D] (output dtype, f32). `attention_mask` [B, T]: 1 = token, 0 = padding;
    `token_type_ids` [B, T]: sentence A (0) / B (1). Both default as in HF (all tokens, type 0)."""
    if attention_mask is None:
      attention_mask = jnp.ones_like(input_ids_BT)
    if token_type_ids is None:
      token_type_ids = jnp.zeros_like(input_ids_BT)
    positions_BT = jnp.broadcast_to(jnp.arange(input_ids_BT.shape[1]), input_ids_BT.shape)
    x_BTD = (self.token_embed(input_ids_BT) + self.position_embed(positions_BT)
             + self.type_embed(token_type_ids))
    x_BTD = constrain(self.embed_norm(x_BTD), RESIDUAL_AXES)
    mask_BTS = padding_mask(attention_mask, input_ids_BT.shape[1])

    def body(block, x_BTD, _):
      return block(x_BTD, mask_BTS), None

    x_BTD, _ = scan_blocks(self.blocks, body, x_BTD, self.kernels)
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
                           rngs=rngs)
    self.transform_norm = LayerNorm(config.d_model, config.layer_norm_eps, policy, kernels)
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
  """Classifier on the pooled [CLS] output (`classifier_pooling="cls"`) or on the mean of the tokens' states
  (`"mean"`: no pooler weights): logits [B, num_labels]."""

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
    self.bert = Bert(config, kernels, with_pooler=config.classifier_pooling == "cls", rngs=rngs)
    self.classifier = Dense(config.d_model, num_labels, ("embed", None), policy, kernels, config.init_std,
                            rngs=rngs)

  def encode(self, input_ids_BT, attention_mask=None, token_type_ids=None) -> jax.Array:
    return self.bert.encode(input_ids_BT, attention_mask, token_type_ids)

  def __call__(self, input_ids_BT, attention_mask=None, token_type_ids=None) -> jax.Array:
    hidden_BTD = self.encode(input_ids_BT, attention_mask, token_type_ids)
    if self.config.classifier_pooling == "mean":
      pooled_BD = mean_pool(hidden_BTD, attention_mask)
    else:
      pooled_BD = self.bert.pool(hidden_BTD)
    return self.classifier(pooled_BD).astype(jnp.float32)
