"""Attention masks: which keys each query may see (causal, packed documents, a KV cache, padding). Every attention
implementation in jaxlm.kernels takes one of these [B, T, S] bool masks, so document boundaries hold on every path.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class SequenceMask(NamedTuple):
  """The causal mask within documents in O(T) instead of [B, T, S]: query i sees key j when time[j] <= time[i] and
  segment[j] == segment[i]. What ring attention takes (context parallelism: the rows are in a permuted order, so
  `time` is each token's index in its original row)."""
  time_BT: jax.Array
  segment_ids_BT: jax.Array


def _seen(query_time, key_time, window: int) -> jax.Array:
  """Causal, and within the last `window` times (the query's own included) when window > 0."""
  seen = key_time <= query_time
  return seen & (query_time - key_time < window) if window else seen


def causal_mask(segment_ids_BT: jax.Array, window: int = 0) -> jax.Array:
  """[B, T, S=T] bool: causal, and only within the same packed document (segment 0 is padding); `window` > 0: each
  query sees only itself and the window - 1 keys before it (sliding-window attention)."""
  t = segment_ids_BT.shape[1]
  causal_TS = _seen(jnp.arange(t)[:, None], jnp.arange(t)[None, :], window)
  return causal_TS[None] & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])


def cache_mask(segment_ids_BT: jax.Array, cache_segment_ids_BS: jax.Array, end: jax.Array,
               window: int = 0) -> jax.Array:
  """[B, T, S] bool for T new tokens written at cache slots end..end+T-1: a query sees the filled slots up to its own
  (the last `window` of them if window > 0) and only those of its own document (the cache's segment ids already
  include the new tokens)."""
  t, s = segment_ids_BT.shape[1], cache_segment_ids_BS.shape[1]
  causal_TS = _seen((end + jnp.arange(t))[:, None], jnp.arange(s)[None, :], window)
  return causal_TS[None] & (segment_ids_BT[:, :, None] == cache_segment_ids_BS[:, None, :])


def rolling_cache_mask(segment_ids_BT: jax.Array, cache_segment_ids_BS: jax.Array, end: jax.Array,
                       window: int) -> jax.Array:
  """[B, T, S + T] bool for T new tokens at times end..end+T-1 against a rolling cache of S slots (before they are
  written; slot s holds the latest time before `end` that is s mod S) followed by the new tokens themselves."""
  t, s = segment_ids_BT.shape[1], cache_segment_ids_BS.shape[1]
  slot_time_S = end - 1 - jnp.mod(end - 1 - jnp.arange(s), s)  # negative: never written
  key_time_U = jnp.concatenate([jnp.where(slot_time_S >= 0, slot_time_S, end + t), end + jnp.arange(t)])
  seen_TU = _seen((end + jnp.arange(t))[:, None], key_time_U[None, :], window)
  key_segments_BU = jnp.concatenate([cache_segment_ids_BS, segment_ids_BT], axis=1)
  return seen_TU[None] & (segment_ids_BT[:, :, None] == key_segments_BU[:, None, :])


def padding_mask(attention_mask_BS: jax.Array, num_queries: int, window: int = 0) -> jax.Array:
  """[B, T, S] bool for a bidirectional encoder: every query sees every non-padding key (HF BERT's mask); `window`
  > 0: only the keys at most window // 2 positions away (ModernBERT's local attention)."""
  b, s = attention_mask_BS.shape
  mask_BTS = jnp.broadcast_to(attention_mask_BS.astype(bool)[:, None, :], (b, num_queries, s))
  if not window:
    return mask_BTS
  near_TS = jnp.abs(jnp.arange(num_queries)[:, None] - jnp.arange(s)[None, :]) <= window // 2
  return mask_BTS & near_TS[None]
