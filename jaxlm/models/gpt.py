"""The GPT decoder (GPT-2 flavour): learned positions, pre-LayerNorm blocks, GELU MLP, tied embeddings.

Blocks are created once with a leading layer axis (`nnx.vmap`) and run with `jax.lax.scan`, so compile time does not
grow with depth. `model(input_ids) -> logits [B, T, V]` in f32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm.config import ModelConfig
from jaxlm.models.layers import MLP, Attention, Embed, LayerNorm, attention_mask
from jaxlm.precision import Policy
from jaxlm.sharding import constrain

RESIDUAL_AXES = ("act_batch", "act_seq", "act_embed")

REMAT_POLICIES = {
    "full": None,  # save nothing inside a block: least memory, one extra forward
    "dots": jax.checkpoint_policies.checkpoint_dots,  # keep matmul outputs, recompute elementwise ops
}


class Block(nnx.Module):
  """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

  def __init__(self, config: ModelConfig, policy: Policy, *, rngs: nnx.Rngs):
    std = config.init_std
    out_std = std / math.sqrt(2 * config.num_layers)  # GPT-2: scale residual projections by depth
    self.attn_norm = LayerNorm(config.d_model, config.layer_norm_eps, policy)
    self.attn = Attention(config.d_model, config.num_heads, policy, std, out_std, rngs=rngs)
    self.mlp_norm = LayerNorm(config.d_model, config.layer_norm_eps, policy)
    self.mlp = MLP(config.d_model, config.mlp_width, policy, std, out_std, rngs=rngs)

  def __call__(self, x_BTD: jax.Array, mask_B1TS: jax.Array) -> jax.Array:
    x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), mask_B1TS)
    x_BTD = x_BTD + self.mlp(self.mlp_norm(x_BTD))
    return constrain(x_BTD, RESIDUAL_AXES)


class GPT(nnx.Module):

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    policy = Policy.from_model_config(config)
    self.policy = policy
    self.token_embed = Embed(config.vocab_size, config.d_model, ("vocab", "embed"), policy, config.init_std,
                             rngs=rngs)
    self.position_embed = Embed(config.max_seq_len, config.d_model, ("positions", "embed"), policy,
                                config.init_std / 2, rngs=rngs)

    @nnx.split_rngs(splits=config.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def stacked_blocks(rngs: nnx.Rngs) -> Block:
      return Block(config, policy, rngs=rngs)

    self.blocks = stacked_blocks(rngs)  # every block parameter has a leading [L] axis
    self.final_norm = LayerNorm(config.d_model, config.layer_norm_eps, policy)

  def __call__(self, input_ids_BT: jax.Array, positions_BT: jax.Array | None = None,
               segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, V] in f32. `segment_ids` (packed documents, 0 = padding) restrict attention to one document;
    `positions` restart at each document start. Both default to one unpadded document per row."""
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(input_ids_BT.shape[1]), input_ids_BT.shape)
    if segment_ids_BT is None:
      segment_ids_BT = jnp.ones_like(input_ids_BT)
    mask_B1TS = attention_mask(segment_ids_BT)

    x_BTD = self.token_embed(input_ids_BT) + self.position_embed(positions_BT)
    x_BTD = constrain(x_BTD, RESIDUAL_AXES)

    block_def, block_params = nnx.split(self.blocks)

    def apply_block(x_BTD, params):
      return nnx.merge(block_def, params)(x_BTD, mask_B1TS), None

    if self.config.remat != "none":
      apply_block = jax.checkpoint(apply_block, policy=REMAT_POLICIES[self.config.remat], prevent_cse=False)
    x_BTD, _ = jax.lax.scan(apply_block, x_BTD, block_params)

    logits_BTV = self.token_embed.attend(self.final_norm(x_BTD))
    return constrain(logits_BTV, ("act_batch", "act_seq", "act_vocab"))
