"""Text sampling from a decoder.

This first version recomputes the whole fixed-length buffer for every new token (no KV cache): one compiled program
for any prompt, simple and exact, and fast enough for the report's sample. KV-cache decoding replaces it for long
generations.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx


def sample_tokens(graphdef: nnx.GraphDef, params: Any, prompt_ids: list[int], num_tokens: int, max_len: int,
                  temperature: float = 0.8, top_k: int = 40, seed: int = 0, eos_id: int | None = None) -> list[int]:
  """Returns the prompt followed by up to `num_tokens` sampled tokens (stopping after `eos_id`)."""
  if not prompt_ids:
    raise ValueError("sample_tokens needs a non-empty prompt")
  prompt_ids = prompt_ids[-(max_len - 1):]
  length = min(max_len, len(prompt_ids) + num_tokens)
  buffer = jnp.zeros((1, length), jnp.int32).at[0, :len(prompt_ids)].set(jnp.asarray(prompt_ids, jnp.int32))
  out = _sample_loop(graphdef, params, buffer, len(prompt_ids), jax.random.key(seed), temperature, top_k)
  tokens = [int(t) for t in jax.device_get(out)[0]]
  generated = tokens[len(prompt_ids):]
  if eos_id is not None and eos_id in generated:
    generated = generated[:generated.index(eos_id) + 1]
  return prompt_ids + generated


@functools.partial(jax.jit, static_argnums=(0, 6))
def _sample_loop(graphdef, params, buffer_1L, start, key, temperature, top_k):
  model = nnx.merge(graphdef, params)

  def step(i, carry):
    buffer_1L, key = carry
    key, sub = jax.random.split(key)
    logits_V = model(buffer_1L)[0, i - 1]  # causal: positions >= i do not affect position i - 1
    kth = jax.lax.top_k(logits_V, min(top_k, logits_V.shape[-1]))[0][-1]
    logits_V = jnp.where(logits_V < kth, -jnp.inf, logits_V) / temperature
    token = jax.random.categorical(sub, logits_V).astype(jnp.int32)
    return buffer_1L.at[0, i].set(token), key

  buffer_1L, _ = jax.lax.fori_loop(start, buffer_1L.shape[1], step, (buffer_1L, key))
  return buffer_1L
