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


def causal_mask(segment_ids_BT: jax.Array) -> jax.Array:
  """[B, T, S=T] bool: causal, and only within the same packed document (segment 0 is padding)."""
  t = segment_ids_BT.shape[1]
  causal_TS = jnp.tril(jnp.ones((t, t), dtype=bool))
  return causal_TS[None] & (segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :])


def cache_mask(segment_ids_BT: jax.Array, cache_segment_ids_BS: jax.Array, end: jax.Array) -> jax.Array:
  """[B, T, S] bool for T new tokens written at cache slots end..end+T-1: a query sees the filled slots up to its own
  and only those of its own document (the cache's segment ids already include the new tokens)."""
  t, s = segment_ids_BT.shape[1], cache_segment_ids_BS.shape[1]
  causal_TS = jnp.arange(s)[None, :] <= (end + jnp.arange(t))[:, None]
  return causal_TS[None] & (segment_ids_BT[:, :, None] == cache_segment_ids_BS[:, None, :])


def padding_mask(attention_mask_BS: jax.Array, num_queries: int) -> jax.Array:
  """[B, T, S] bool for a bidirectional encoder: every query sees every non-padding key (HF BERT's mask)."""
  b, s = attention_mask_BS.shape
  return jnp.broadcast_to(attention_mask_BS.astype(bool)[:, None, :], (b, num_queries, s))
