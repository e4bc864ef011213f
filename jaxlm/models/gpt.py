"""The GPT decoder in two flavours, chosen by `ModelConfig.flavour`:

  gpt2   learned positions, pre-LayerNorm, GELU MLP, biases, tied embeddings
  llama  rotary positions (`rope_theta`), pre-RMSNorm, SwiGLU MLP, no biases, tied or untied embeddings
Both support grouped-query / multi-query attention (`num_kv_heads`) and mixture-of-experts MLPs (`num_experts`,
jaxlm/models/moe.py).

Blocks are created once with a leading layer axis (`nnx.vmap`) and run with `jax.lax.scan` (or a loop, as
`kernels.layers` says). `model(input_ids) -> logits [B, T, V]` in f32; `model.decode(input_ids, cache, ...)` is the
incremental (KV-cache) form of the same function, used by `jaxlm.inference.generate`. `GPT(config, kernels=...)` takes a
resolved `jaxlm.kernels.Kernels`; None resolves `auto` for the default backend.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxlm import kernels as kernels_lib
from jaxlm.config import ModelConfig
from jaxlm.kernels import Kernels
from jaxlm.kernels.ring_attention import balanced_order
from jaxlm.models.masks import SequenceMask, cache_mask, causal_mask
from jaxlm.models.moe import MoE
from jaxlm.models.layers import (MLP, Attention, Embed, GatedMLP, KVCache, LayerKV, LayerNorm, RMSNorm, Rotary,
                                 rotary_frequencies, rotary_tables, scan_blocks, stacked)
from jaxlm.models.precision import Policy
from jaxlm.parallel.sharding import CONTEXT_AXIS, axis_size, constrain, gather_fsdp

RESIDUAL_AXES = ("act_batch", "act_residual_seq", "act_embed")
FLAVOURS = ("gpt2", "llama")


def context_order(length: int) -> np.ndarray | None:
  """Under context parallelism (a traced mesh with `context` > 1), the order of a row's tokens that puts an early and
  a late chunk on each device (jaxlm/kernels/ring_attention.py); else None."""
  devices = axis_size(CONTEXT_AXIS)
  return balanced_order(length, devices) if devices > 1 else None


class Block(nnx.Module):
  """Pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, config: ModelConfig, policy: Policy, kernels: Kernels, *, rngs: nnx.Rngs):
    std = config.init_std
    out_std = std / math.sqrt(2 * config.num_layers)  # GPT-2: scale residual projections by depth
    llama = config.flavour == "llama"
    norm = RMSNorm if llama else LayerNorm
    self.attn_norm = norm(config.d_model, config.layer_norm_eps, policy, kernels)
    self.attn = Attention(config.d_model, config.num_heads, config.num_kv_heads or config.num_heads, policy, kernels,
                          std, out_std, use_bias=not llama, causal=True, document_mask=config.document_mask,
                          head_dim=config.head_dim, qk_norm=config.qk_norm, norm_eps=config.layer_norm_eps,
                          qkv_bias=config.qkv_bias if llama else None, rngs=rngs)
    self.mlp_norm = norm(config.d_model, config.layer_norm_eps, policy, kernels)
    if config.num_experts:
      self.mlp = MoE(config.d_model, config.num_experts, config.experts_per_token, config.expert_width, policy,
                     kernels, std, out_std, gated=llama, normalize_topk=config.router_normalize_topk,
                     shared_d_ff=config.shared_expert_d_ff, rngs=rngs)
    else:
      self.mlp = (GatedMLP if llama else MLP)(config.d_model, config.mlp_width, policy, kernels, std, out_std,
                                              rngs=rngs)

  def _mlp(self, x_BTD: jax.Array, valid_BT: jax.Array | None) -> tuple[jax.Array, dict]:
    """The MLP sublayer's output and its statistics (a mixture of experts' router statistics; none for a dense MLP)."""
    if isinstance(self.mlp, MoE):
      return self.mlp(x_BTD, valid_BT)
    return self.mlp(x_BTD), {}

  def __call__(self, x_BTD: jax.Array, mask_BTS: jax.Array, rotary: Rotary | None,
               valid_BT: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """(output, the MLP's statistics over the tokens where `valid_BT`)."""
    # Constraining after each residual add makes a row-parallel output's all-reduce a reduce-scatter under
    # sequence parallelism (and pins the layout otherwise).
    x_BTD = constrain(x_BTD + self.attn(self.attn_norm(x_BTD), mask_BTS, rotary), RESIDUAL_AXES)
    mlp_BTD, stats = self._mlp(self.mlp_norm(x_BTD), valid_BT)
    return constrain(x_BTD + mlp_BTD, RESIDUAL_AXES), stats

  def decode(self, x_BTD, mask_BTS, rotary, kv: LayerKV, end):
    attn_BTD, kv = self.attn.decode(self.attn_norm(x_BTD), mask_BTS, rotary, kv, end)
    x_BTD = x_BTD + attn_BTD
    x_BTD = x_BTD + self._mlp(self.mlp_norm(x_BTD), None)[0]
    return constrain(x_BTD, RESIDUAL_AXES), kv


class GPT(nnx.Module):

  def __init__(self, config: ModelConfig, kernels: Kernels | None = None, *, rngs: nnx.Rngs):
    if config.flavour not in FLAVOURS:
      raise ValueError(f"model.flavour={config.flavour!r} is not a decoder flavour ({', '.join(FLAVOURS)}); "
                       "use jaxlm.models.bert for bert")
    self.config = config
    policy = Policy.from_model_config(config)
    kernels = kernels or kernels_lib.resolve(compute_dtype=config.compute_dtype, causal=True,
                                             head_dim=config.head_dim)
    self.policy = policy
    self.kernels = kernels
    self.token_embed = Embed(config.vocab_size, config.d_model, ("vocab", "embed"), policy, kernels,
                             config.init_std, rngs=rngs)
    self.position_embed = (Embed(config.max_seq_len, config.d_model, ("positions", "embed"), policy, kernels,
                                 config.init_std / 2, rngs=rngs) if config.flavour == "gpt2" else None)
    self.blocks = stacked(config.num_layers, lambda r: Block(config, policy, kernels, rngs=r), rngs)
    norm = RMSNorm if config.flavour == "llama" else LayerNorm
    self.final_norm = norm(config.d_model, config.layer_norm_eps, policy, kernels)
    # Untied embeddings: a separate [V, D] output table.
    self.lm_head = (None if config.tie_embeddings else
                    Embed(config.vocab_size, config.d_model, ("vocab", "embed"), policy, kernels, config.init_std,
                          rngs=rngs))

  def _embed(self, input_ids_BT: jax.Array, positions_BT: jax.Array) -> jax.Array:
    x_BTD = self.token_embed(input_ids_BT)
    if self.position_embed is not None:
      x_BTD = x_BTD + self.position_embed(positions_BT)
    return constrain(x_BTD, RESIDUAL_AXES)

  def _rotary(self, positions_BT: jax.Array) -> Rotary | None:
    """The rotary tables every layer shares (llama), or None (gpt2's positions are learned embeddings)."""
    c = self.config
    if c.flavour != "llama":
      return None
    inv_freq = rotary_frequencies(c.head_dim, c.rope_theta, c.rope_scaling, c.rope_factor, c.rope_low_freq_factor,
                                  c.rope_high_freq_factor, c.rope_original_max_positions)
    return rotary_tables(positions_BT, c.head_dim, c.rope_theta, inv_freq)

  def _head(self) -> Embed:
    return self.lm_head if self.lm_head is not None else self.token_embed

  def _logits(self, x_BTD: jax.Array) -> jax.Array:
    return self._vocab_logits(self.final_norm(x_BTD))

  def _vocab_logits(self, features_BTD: jax.Array) -> jax.Array:
    return constrain(self._head().attend(features_BTD), ("act_batch", "act_seq", "act_vocab"))

  def output_table(self) -> jax.Array:
    """The output projection [V, D] in the compute dtype: logits = features @ output_table().T (in f32)."""
    return self.policy.cast_to_compute(gather_fsdp(self._head().embedding)[...])

  def __call__(self, input_ids_BT: jax.Array, positions_BT: jax.Array | None = None,
               segment_ids_BT: jax.Array | None = None) -> jax.Array:
    """Logits [B, T, V] in f32. `segment_ids` (packed documents, 0 = padding) restrict attention to one document
    (unless model.document_mask=False); `positions` restart at each document start. Both default to one unpadded
    document per row."""
    return self._vocab_logits(self.features(input_ids_BT, positions_BT, segment_ids_BT))

  def loss_sums(self, input_ids_BT: jax.Array, targets_BT: jax.Array, weights_BT: jax.Array,
                positions_BT: jax.Array | None = None,
                segment_ids_BT: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """(sum of w * cross-entropy over every token, sums): the training loss, computed by `kernels.cross_entropy_sums`
    from the final hidden states (without [B, T, V] logits where the kernel allows). `sums["correct"]` is the sum of
    w * [argmax == target]; a mixture of experts adds `aux_loss` (its router losses times their weights, to add to
    the objective) and its router statistics (moe.py; `expert_load_max_over_mean/layer_<l>` per layer), each
    multiplied by sum(w) so that dividing by the batch's total weight averages them over micro-batches too."""
    x_BTD, stats = self._forward(input_ids_BT, positions_BT, segment_ids_BT)
    if (order := context_order(input_ids_BT.shape[1])) is not None:  # the tokens as _forward ordered them
      targets_BT, weights_BT = targets_BT[:, order], weights_BT[:, order]
    loss_sum, correct = self.hidden_loss_sums(x_BTD, targets_BT, weights_BT)
    sums = {"correct": correct}
    if stats:
      weight, c = jnp.sum(weights_BT), self.config
      balance, z = jnp.mean(stats["router_balance_loss"]), jnp.mean(stats["router_z_loss"])
      sums.update(aux_loss=(c.router_balance_weight * balance + c.router_z_weight * z) * weight,
                  router_balance_loss=balance * weight, router_z_loss=z * weight)
      for layer in range(c.num_layers):
        sums[f"expert_load_max_over_mean/layer_{layer}"] = stats["expert_load_max_over_mean"][layer] * weight
    return loss_sum, sums

  def hidden_loss_sums(self, x_BTD: jax.Array, targets_BT: jax.Array,
                       weights_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`loss_sums` from the last block's output: final norm, output table, cross-entropy (the pipeline's head)."""
    features_BTD = self.final_norm(x_BTD)
    b, t, d = features_BTD.shape
    return self.kernels.cross_entropy_sums(features_BTD.reshape(b * t, d), self.output_table(),
                                           targets_BT.reshape(b * t), weights_BT.reshape(b * t))

  def features(self, input_ids_BT: jax.Array, positions_BT: jax.Array | None = None,
               segment_ids_BT: jax.Array | None = None, final_norm: bool = True) -> jax.Array:
    """The final-normed hidden states [B, T, D] in the compute dtype, before the vocabulary projection (the training
    loss, `kernels.cross_entropy_sums`, takes these and `output_table()` rather than [B, T, V] logits)."""
    x_BTD = self._forward(input_ids_BT, positions_BT, segment_ids_BT)[0]
    if (order := context_order(input_ids_BT.shape[1])) is not None:
      x_BTD = x_BTD[:, np.argsort(order)]
    return self.final_norm(x_BTD) if final_norm else x_BTD

  def _forward(self, input_ids_BT, positions_BT, segment_ids_BT) -> tuple[jax.Array, dict]:
    """(the last block's output [B, T, D], the blocks' statistics [L] each). Under context parallelism the tokens
    come out in `context_order`."""
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(jnp.arange(input_ids_BT.shape[1]), input_ids_BT.shape)
    if segment_ids_BT is None:
      segment_ids_BT = jnp.ones_like(input_ids_BT)
    if (order := context_order(input_ids_BT.shape[1])) is not None:
      input_ids_BT, positions_BT, segment_ids_BT = (a[:, order] for a in (input_ids_BT, positions_BT, segment_ids_BT))
    return self.run_blocks(self._embed(input_ids_BT, positions_BT), positions_BT, segment_ids_BT)

  def embed(self, input_ids_BT: jax.Array, positions_BT: jax.Array) -> jax.Array:
    """The first block's input [B, T, D] (the pipeline's first stage runs this, then `run_blocks`)."""
    return self._embed(input_ids_BT, positions_BT)

  def run_blocks(self, x_BTD: jax.Array, positions_BT: jax.Array,
                 segment_ids_BT: jax.Array) -> tuple[jax.Array, dict]:
    """`self.blocks` applied to x [B, T, D]: all layers, or one pipeline stage's (its slice of the stacked blocks);
    with each layer's statistics stacked ([L] each; none for dense MLPs)."""
    # Without document masking every row is one causal sequence (the library kernels then get no mask at all).
    documents_BT = segment_ids_BT if self.config.document_mask else jnp.ones_like(segment_ids_BT)
    if (order := context_order(x_BTD.shape[1])) is not None:  # ring attention: the mask from each token's time
      mask_BTS = SequenceMask(jnp.broadcast_to(jnp.asarray(order), documents_BT.shape), documents_BT)
    else:
      mask_BTS = causal_mask(documents_BT)

    rotary = self._rotary(positions_BT)

    valid_BT = segment_ids_BT > 0

    def body(block, x_BTD, _):
      return block(x_BTD, mask_BTS, rotary, valid_BT)

    return scan_blocks(self.blocks, body, x_BTD, self.kernels)

  def init_cache(self, batch: int, slots: int, quantized: bool = False) -> KVCache:
    """An empty KV cache of `slots` positions per row, in the compute dtype (or int8 with per-token scales)."""
    c = self.config
    return KVCache.zeros(c.num_layers, batch, slots, c.num_kv_heads or c.num_heads, c.head_dim,
                         self.policy.compute_dtype, quantized)

  def decode(self, input_ids_BT: jax.Array, cache: KVCache, positions_BT: jax.Array | None = None,
             segment_ids_BT: jax.Array | None = None) -> tuple[jax.Array, KVCache]:
    """Appends T tokens to the cache and returns their logits [B, T, V] (as `__call__` on the whole sequence would)
    and the updated cache. Prefill passes the prompt, then each step one token. Defaults: positions continue from
    the cache's end, one document per row."""
    t = input_ids_BT.shape[1]
    if positions_BT is None:
      positions_BT = jnp.broadcast_to(cache.end + jnp.arange(t), input_ids_BT.shape)
    if segment_ids_BT is None:
      segment_ids_BT = jnp.ones_like(input_ids_BT)
    zero = jnp.zeros((), jnp.int32)
    cache_segments_BS = jax.lax.dynamic_update_slice(cache.segment_ids_BS, segment_ids_BT.astype(jnp.int32),
                                                     (zero, cache.end))
    mask_BTS = cache_mask(segment_ids_BT, cache_segments_BS, cache.end)

    rotary = self._rotary(positions_BT)

    def body(block, x_BTD, kv):
      return block.decode(x_BTD, mask_BTS, rotary, kv, cache.end)

    x_BTD, kv = scan_blocks(self.blocks, body, self._embed(input_ids_BT, positions_BT), self.kernels,
                            cache.layers(), remat=False)
    return self._logits(x_BTD), KVCache(kv.k_BSGK, kv.v_BSGK, cache_segments_BS, cache.end + t, kv.k_scale_BSG,
                                        kv.v_scale_BSG)
