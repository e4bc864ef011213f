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
from jaxlm.models.masks import SequenceMask, cache_mask, causal_mask, rolling_cache_mask
from jaxlm.models.moe import MoE
from jaxlm.models.kv_cache import KVCache, LayerKV, rolling_slots
from jaxlm.models.layers import MLP, Attention, Embed, GatedMLP, LayerNorm, RMSNorm, scan_blocks, stacked
from jaxlm.models.rotary import (Rotary, dynamic_frequencies, rotary_frequencies, rotary_tables,
                                 yarn_attention_factor)
from jaxlm.models.precision import Policy
from jaxlm.parallel.sharding import CONTEXT_AXIS, axis_size, constrain, gather_fsdp

RESIDUAL_AXES = ("act_batch", "act_residual_seq", "act_embed")
FLAVOURS = ("gpt2", "llama")


def context_order(length: int) -> np.ndarray | None:
  """Under context parallelism (a traced mesh with `context` > 1), the order of a row's tokens that puts an early and
  a late chunk on each device (jaxlm/kernels/ring_attention.py); else None."""
  devices = axis_size(CONTEXT_AXIS)
  return balanced_order(length, devices) if devices > 1 else None


def _apply(norm: nnx.Module | None, x_BTD: jax.Array) -> jax.Array:
  return x_BTD if norm is None else norm(x_BTD)


class Block(nnx.Module):
  """Transformer block: x + attn(norm(x)), then x + mlp(norm(x)) (model.block_norms=pre); `sandwich` also norms each
  sublayer's output before the residual add (Gemma 2/3), `post` norms only the output (OLMo 2)."""

  def __init__(self, config: ModelConfig, policy: Policy, kernels: Kernels, *, rngs: nnx.Rngs):
    std = config.init_std
    out_std = std / math.sqrt(2 * config.num_layers)  # GPT-2: scale residual projections by depth
    llama = config.flavour == "llama"
    d, eps = config.d_model, config.layer_norm_eps
    norm = (lambda: RMSNorm(d, eps, policy, kernels, config.norm_plus_one)) if llama else (
        lambda: LayerNorm(d, eps, policy, kernels))
    pre, post = config.block_norms in ("pre", "sandwich"), config.block_norms in ("sandwich", "post")
    self.attn_norm = norm() if pre else None
    # A sliding window lives in the mask, so the library kernels must be given it (document_mask=True).
    self.attn = Attention(d, config.num_heads, config.num_kv_heads or config.num_heads, policy, kernels,
                          std, out_std, use_bias=not llama, causal=True,
                          document_mask=config.document_mask or bool(config.sliding_window),
                          head_dim=config.head_dim, qk_norm=config.qk_norm, norm_eps=eps,
                          qkv_bias=config.qkv_bias if llama else None, norm_plus_one=config.norm_plus_one,
                          softcap=config.attention_softcap, query_pre_attn_scalar=config.query_pre_attn_scalar,
                          rngs=rngs)
    self.attn_post_norm = norm() if post else None
    self.mlp_norm = norm() if pre else None
    if config.num_experts:
      self.mlp = MoE(d, config.num_experts, config.experts_per_token, config.expert_width, policy,
                     kernels, std, out_std, gated=llama, normalize_topk=config.router_normalize_topk,
                     shared_d_ff=config.shared_expert_d_ff, rngs=rngs)
    elif llama:
      self.mlp = GatedMLP(d, config.mlp_width, policy, kernels, std, out_std, activation=config.glu_activation,
                          rngs=rngs)
    else:
      self.mlp = MLP(d, config.mlp_width, policy, kernels, std, out_std, rngs=rngs)
    self.mlp_post_norm = norm() if post else None

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
    attn_BTD = _apply(self.attn_post_norm, self.attn(_apply(self.attn_norm, x_BTD), mask_BTS, rotary))
    x_BTD = constrain(x_BTD + attn_BTD, RESIDUAL_AXES)
    mlp_BTD, stats = self._mlp(_apply(self.mlp_norm, x_BTD), valid_BT)
    return constrain(x_BTD + _apply(self.mlp_post_norm, mlp_BTD), RESIDUAL_AXES), stats

  def decode(self, x_BTD, mask_BTS, rotary, kv: LayerKV, end, rolling: bool = False):
    attend = self.attn.decode_rolling if rolling else self.attn.decode
    attn_BTD, kv = attend(_apply(self.attn_norm, x_BTD), mask_BTS, rotary, kv, end)
    x_BTD = x_BTD + _apply(self.attn_post_norm, attn_BTD)
    x_BTD = x_BTD + _apply(self.mlp_post_norm, self._mlp(_apply(self.mlp_norm, x_BTD), None)[0])
    return constrain(x_BTD, RESIDUAL_AXES), kv


class GPT(nnx.Module):

  def __init__(self, config: ModelConfig, kernels: Kernels | None = None, *, rngs: nnx.Rngs):
    if config.flavour not in FLAVOURS:
      raise ValueError(f"model.flavour={config.flavour!r} is not a decoder flavour ({', '.join(FLAVOURS)}); "
                       "use jaxlm.models.bert for bert")
    self.config = config
    policy = Policy.from_model_config(config)
    kernels = kernels or kernels_lib.resolve(compute_dtype=config.compute_dtype, causal=True,
                                             **config.kernel_needs)
    self.policy = policy
    self.kernels = kernels
    self.token_embed = Embed(config.vocab_size, config.d_model, ("vocab", "embed"), policy, kernels,
                             config.init_std, rngs=rngs)
    self.position_embed = (Embed(config.max_seq_len, config.d_model, ("positions", "embed"), policy, kernels,
                                 config.init_std / 2, rngs=rngs) if config.flavour == "gpt2" else None)
    self.blocks = stacked(config.num_layers, lambda r: Block(config, policy, kernels, rngs=r), rngs)
    self.final_norm = (RMSNorm(config.d_model, config.layer_norm_eps, policy, kernels, config.norm_plus_one)
                       if config.flavour == "llama" else LayerNorm(config.d_model, config.layer_norm_eps, policy,
                                                                   kernels))
    # Untied embeddings: a separate [V, D] output table.
    self.lm_head = (None if config.tie_embeddings else
                    Embed(config.vocab_size, config.d_model, ("vocab", "embed"), policy, kernels, config.init_std,
                          rngs=rngs))

  def _embed(self, input_ids_BT: jax.Array, positions_BT: jax.Array) -> jax.Array:
    x_BTD = self.token_embed(input_ids_BT)
    if self.config.scale_embeddings:  # Gemma: sqrt(d) in the compute dtype, as HF rounds it
      x_BTD = x_BTD * jnp.asarray(math.sqrt(self.config.d_model), x_BTD.dtype)
    if self.position_embed is not None:
      x_BTD = x_BTD + self.position_embed(positions_BT)
    return constrain(x_BTD, RESIDUAL_AXES)

  def _rotary(self, positions_BT: jax.Array) -> Rotary | None:
    """The rotary tables every layer shares (llama), or None (gpt2's positions are learned embeddings)."""
    c = self.config
    if c.flavour != "llama":
      return None
    if c.rope_scaling == "dynamic":
      inv_freq = dynamic_frequencies(positions_BT, c.head_dim, c.rope_theta, c.rope_factor, c.max_seq_len)
    else:
      inv_freq = rotary_frequencies(c.head_dim, c.rope_theta, c.rope_scaling, c.rope_factor, c.rope_low_freq_factor,
                                    c.rope_high_freq_factor, c.rope_original_max_positions, c.rope_beta_fast,
                                    c.rope_beta_slow)
    scale = yarn_attention_factor(c.rope_factor, c.rope_attention_factor) if c.rope_scaling == "yarn" else 1.0
    return rotary_tables(positions_BT, c.head_dim, c.rope_theta, inv_freq, scale)

  def _local_layers(self) -> np.ndarray | None:
    """[L] bool: which layers attend within the sliding window, when windowed and global layers alternate
    (model.global_attention_every); None when every layer is alike."""
    c = self.config
    if not (c.sliding_window and c.global_attention_every):
      return None
    return (np.arange(c.num_layers) + 1) % c.global_attention_every != 0

  def _per_layer(self, make_mask, positions_BT):
    """What each layer attends with: `select(local) -> (mask, rotary)` for the layer scan and the [L] flags it scans
    over (None when every layer is alike, and select ignores its argument). `make_mask(window)` builds a mask."""
    c = self.config
    rotary = self._rotary(positions_BT)
    if (local_L := self._local_layers()) is None:
      mask = make_mask(c.sliding_window)
      return (lambda _: (mask, rotary)), None
    global_mask, local_mask = make_mask(0), make_mask(c.sliding_window)
    local_rotary = (rotary_tables(positions_BT, c.head_dim, c.rope_local_theta) if c.rope_local_theta else rotary)

    def select(local):
      pick = lambda a, b: jnp.where(local, a, b)
      rot = None if rotary is None else Rotary(*jax.tree.map(pick, tuple(local_rotary), tuple(rotary)))
      return pick(local_mask, global_mask), rot

    return select, jnp.asarray(local_L)

  def _head(self) -> Embed:
    return self.lm_head if self.lm_head is not None else self.token_embed

  def _logits(self, x_BTD: jax.Array) -> jax.Array:
    return self._vocab_logits(self.final_norm(x_BTD))

  def _vocab_logits(self, features_BTD: jax.Array) -> jax.Array:
    logits_BTV = self.kernels.softcap(self._head().attend(features_BTD), self.config.logit_softcap)
    return constrain(logits_BTV, ("act_batch", "act_seq", "act_vocab"))

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
    return loss_sum, {"correct": correct, **self._router_sums(stats, weights_BT)}

  def _router_sums(self, stats: dict, weights_BT: jax.Array) -> dict:
    """A mixture of experts' `aux_loss` and router statistics from the blocks' `stats` (none for a dense model),
    each times sum(w) (loss_sums)."""
    if not stats:
      return {}
    weight, c = jnp.sum(weights_BT), self.config
    balance, z = jnp.mean(stats["router_balance_loss"]), jnp.mean(stats["router_z_loss"])
    sums = {"aux_loss": (c.router_balance_weight * balance + c.router_z_weight * z) * weight,
            "router_balance_loss": balance * weight, "router_z_loss": z * weight}
    for layer in range(c.num_layers):
      sums[f"expert_load_max_over_mean/layer_{layer}"] = stats["expert_load_max_over_mean"][layer] * weight
    return sums

  def features_and_router_sums(self, input_ids_BT: jax.Array, weights_BT: jax.Array, positions_BT: jax.Array,
                               segment_ids_BT: jax.Array) -> tuple[jax.Array, dict]:
    """`features` and the `loss_sums` entries of a mixture of experts' router (`aux_loss` to add to the objective,
    its statistics): for a task that computes its own loss from the features (distillation)."""
    x_BTD, stats = self._forward(input_ids_BT, positions_BT, segment_ids_BT)
    if (order := context_order(input_ids_BT.shape[1])) is not None:
      x_BTD = x_BTD[:, np.argsort(order)]
    return self.final_norm(x_BTD), self._router_sums(stats, weights_BT)

  def hidden_loss_sums(self, x_BTD: jax.Array, targets_BT: jax.Array,
                       weights_BT: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`loss_sums` from the last block's output: final norm, output table, cross-entropy (the pipeline's head)."""
    features_BTD = self.final_norm(x_BTD)
    b, t, d = features_BTD.shape
    return self.kernels.cross_entropy_sums(features_BTD.reshape(b * t, d), self.output_table(),
                                           targets_BT.reshape(b * t), weights_BT.reshape(b * t),
                                           self.config.logit_softcap)

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
    valid_BT = segment_ids_BT > 0
    if (order := context_order(x_BTD.shape[1])) is not None:  # ring attention: the mask from each token's time
      ring_mask = SequenceMask(jnp.broadcast_to(jnp.asarray(order), documents_BT.shape), documents_BT)
      make_mask = lambda _: ring_mask  # no window under context parallelism (config validation)
    else:
      make_mask = lambda window: causal_mask(documents_BT, window)
    select, local_L = self._per_layer(make_mask, positions_BT)

    def body(block, x_BTD, local):
      return block(x_BTD, *select(local), valid_BT)

    return scan_blocks(self.blocks, body, x_BTD, self.kernels, local_L)

  def _rolling(self) -> bool:
    """Every layer windowed: the KV cache keeps only the window's slots, overwritten in turn."""
    return bool(self.config.sliding_window) and self._local_layers() is None

  def init_cache(self, batch: int, slots: int, quantized: bool = False) -> KVCache:
    """An empty KV cache of `slots` positions per row, in the compute dtype (or int8 with per-token scales). When
    every layer attends within a sliding window, at most the window's slots: a rolling cache."""
    c = self.config
    if self._rolling():
      slots = min(slots, c.sliding_window)
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
    segment_ids_BT = segment_ids_BT.astype(jnp.int32)
    if rolling := self._rolling():
      kept, slots = rolling_slots(cache.end, t, cache.segment_ids_BS.shape[1])
      rolling_mask = rolling_cache_mask(segment_ids_BT, cache.segment_ids_BS, cache.end, self.config.sliding_window)
      make_mask = lambda _: rolling_mask
      cache_segments_BS = cache.segment_ids_BS.at[:, slots].set(segment_ids_BT[:, -kept:])
    else:
      zero = jnp.zeros((), jnp.int32)
      cache_segments_BS = jax.lax.dynamic_update_slice(cache.segment_ids_BS, segment_ids_BT, (zero, cache.end))
      make_mask = lambda window: cache_mask(segment_ids_BT, cache_segments_BS, cache.end, window)
    select, local_L = self._per_layer(make_mask, positions_BT)

    def body(block, x_BTD, kv_and_local):
      kv, local = kv_and_local
      return block.decode(x_BTD, *select(local), kv, cache.end, rolling=rolling)

    x_BTD, kv = scan_blocks(self.blocks, body, self._embed(input_ids_BT, positions_BT), self.kernels,
                            (cache.layers(), local_L), remat=False)
    return self._logits(x_BTD), KVCache(kv.k_BSGK, kv.v_BSGK, cache_segments_BS, cache.end + t, kv.k_scale_BSG,
                                        kv.v_scale_BSG)
