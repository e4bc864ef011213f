"""Incremental decoding with a KV cache: greedy, temperature, top-k and top-p sampling, stop tokens, batches of
prompts of different lengths; one jitted program per (batch size, prompt length bucket, new tokens), on one device
or a mesh.

Prompts are left-padded to a common length P so that every row writes the same cache slot at each step: the prompt
is prefilled in one call, then each step appends one token per row. Padding slots carry segment id 0, so no real
token attends to them, and positions count from each row's first real token, so a padded row computes exactly what
it would alone (checked in tests/test_generate.py).

Int8 weights (jaxlm.compress.quantization) enter the program as int8, so a step reads their int8 bytes, not a float
copy (`lower` gives the program and its inputs; benchmarks/bench_decode.py times it against bf16 weights).

`kv_cache="int8"` keeps the cache as int8 with one scale per token and KV head (jaxlm.models.kv_cache.KVCache): about
half the bytes of a bf16 cache and a quarter of an f32 one, for a small change in the logits (docs/optimization.md
has the measured agreement with the float cache). The default stays the float cache, which is exact.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxlm.parallel import sharding

PROMPT_BUCKET = 16  # prompts are left-padded to a multiple of this many tokens (one compile per bucket)
STOP_BUCKET = 8  # stop-token lists are padded to a multiple of this length (one compile for most lists)
KV_CACHES = ("float", "int8")  # float: the compute dtype; int8: per-token, per-KV-head scales


def filter_logits(logits_BV: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Logits / temperature with everything outside the top-k and outside the top-p nucleus set to -inf.

  top_k = 0 and top_p >= 1 switch those filters off; the most likely token always survives. All three are traced
  values, so changing them does not recompile."""
  logits_BV = logits_BV.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
  sorted_BV = jnp.sort(logits_BV, axis=-1)[:, ::-1]
  v = logits_BV.shape[-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
  sorted_BV = jnp.where(jnp.arange(v)[None, :] < k, sorted_BV, -jnp.inf)  # ties with the k-th token survive below
  probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
  # Keep a token while the probability mass before it is below top_p (so the first token is always kept).
  kept_BV = ((jnp.cumsum(probs_BV, axis=-1) - probs_BV) < jnp.where(top_p < 1.0, top_p, jnp.inf)) & (
      jnp.arange(v)[None, :] < k)
  cutoff_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits_BV < cutoff_B1, -jnp.inf, logits_BV)


def sample(logits_BV: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array) -> jax.Array:
  """Next tokens [B]: argmax when temperature == 0, else a draw from the filtered distribution."""
  greedy_B = jnp.argmax(logits_BV, axis=-1)
  drawn_B = jax.random.categorical(key, filter_logits(logits_BV, temperature, top_k, top_p), axis=-1)
  return jnp.where(temperature > 0, drawn_B, greedy_B).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "kv_cache", "out_sharding"))
def _generate(graphdef, params, tokens_BP, pads_B, key, temperature, top_k, top_p, stop_ids, pad_id, *,
              max_new_tokens, kv_cache="float", out_sharding=None):
  model = nnx.merge(graphdef, params)
  b, p = tokens_BP.shape
  slots_P = jnp.arange(p)
  segments_BP = (slots_P[None, :] >= pads_B[:, None]).astype(jnp.int32)  # 0 on the left padding
  positions_BP = jnp.maximum(slots_P[None, :] - pads_B[:, None], 0)
  cache = model.init_cache(b, p + max_new_tokens, quantized=kv_cache == "int8")
  logits_BPV, cache = model.decode(tokens_BP, cache, positions_BP, segments_BP)

  def cond(carry):
    i, _, _, done_B, _, _ = carry
    return (i < max_new_tokens) & ~jnp.all(done_B)

  def body(carry):
    i, logits_BV, cache, done_B, out_BN, key = carry
    key, sub = jax.random.split(key)
    token_B = jnp.where(done_B, pad_id, sample(logits_BV, sub, temperature, top_k, top_p))
    out_BN = jax.lax.dynamic_update_slice(out_BN, token_B[:, None], (jnp.zeros((), jnp.int32), i))
    done_B = done_B | jnp.any(token_B[:, None] == stop_ids[None, :], axis=-1)
    # Rows that are done keep feeding padding; their outputs are masked above. The last step's decode is unused.
    logits_B1V, cache = model.decode(token_B[:, None], cache, (p + i - pads_B)[:, None],
                                     jnp.ones((b, 1), jnp.int32))
    return i + 1, logits_B1V[:, 0], cache, done_B, out_BN, key

  out_BN = jnp.full((b, max_new_tokens), pad_id, jnp.int32)
  carry = (jnp.zeros((), jnp.int32), logits_BPV[:, -1], cache, jnp.zeros((b,), bool), out_BN, key)
  out_BN = jax.lax.while_loop(cond, body, carry)[4]
  return out_BN if out_sharding is None else jax.lax.with_sharding_constraint(out_BN, out_sharding)


def mesh_of(params: Any) -> Mesh | None:
  """The mesh that sharded `params` live on (the first NamedSharding found), or None."""
  for leaf in jax.tree.leaves(params):
    if isinstance(getattr(leaf, "sharding", None), NamedSharding):
      return leaf.sharding.mesh
  return None


def prompt_width(config, longest: int, max_new_tokens: int) -> int:
  """The padded prompt length P of a batch whose longest prompt has `longest` tokens (the cache holds P +
  max_new_tokens slots). Rounded up to a multiple of PROMPT_BUCKET (more left padding), so that prompts of similar
  lengths share one compiled program; the learned position table of gpt2 caps the rounding."""
  width = -(-longest // PROMPT_BUCKET) * PROMPT_BUCKET
  if config.flavour == "gpt2":
    width = max(longest, min(width, config.max_seq_len - max_new_tokens))
  return width


def generate(graphdef: nnx.GraphDef, params: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, *,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, stop_tokens: Sequence[int] = (),
             seed: int = 0, pad_id: int = 0, kv_cache: str = "float") -> list[list[int]]:
  """The tokens generated after each prompt, each list cut after its first stop token (which it keeps).

  `params` may be sharded over a mesh (NamedShardings, e.g. from `jaxlm.hf.from_pretrained(mesh=...)` or a
  training state): the decode then runs on that mesh, with the batch and KV heads split like activations.
  `kv_cache`: "float" (the compute dtype) or "int8"; either works with float or int8 weights
  (jaxlm.compress.quantization)."""
  args, kwargs, mesh = _program(graphdef, params, prompts, max_new_tokens, temperature=temperature, top_k=top_k,
                                top_p=top_p, stop_tokens=stop_tokens, seed=seed, pad_id=pad_id, kv_cache=kv_cache)
  with _on(mesh):
    out = _generate(*args, **kwargs)
  results, stops = [], set(stop_tokens)
  for row in np.asarray(jax.device_get(out)).tolist():
    hits = [i for i, t in enumerate(row) if t in stops]
    results.append(row[:hits[0] + 1] if hits else row)
  return results


def lower(graphdef: nnx.GraphDef, params: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int,
          **settings) -> jax.stages.Lowered:
  """The program `generate` runs for these arguments (same keywords), lowered but not run: its inputs show what
  each step reads (int8 weights enter it as int8: jaxlm.compress.quantization) and `.compile().as_text()` what XLA
  made of it."""
  args, kwargs, mesh = _program(graphdef, params, prompts, max_new_tokens, **settings)
  with _on(mesh):
    return _generate.lower(*args, **kwargs)


def _on(mesh: Mesh | None):
  """The mesh as the current one (so the models' activation constraints apply), or nothing on one device."""
  return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _program(graphdef, params, prompts, max_new_tokens, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, stop_tokens: Sequence[int] = (), seed: int = 0, pad_id: int = 0,
             kv_cache: str = "float") -> tuple[tuple, dict, Mesh | None]:
  """(arguments, keywords, mesh or None) of the jitted `_generate` call for `generate`'s arguments, checked."""
  if not prompts or any(len(p) == 0 for p in prompts):
    raise ValueError("generate needs at least one prompt and no empty prompt")
  if kv_cache not in KV_CACHES:
    raise ValueError(f"kv_cache={kv_cache!r} is not one of {', '.join(KV_CACHES)}")
  config = nnx.merge(graphdef, params).config  # one Python walk of the graph per call, outside jit
  longest = max(len(p) for p in prompts)
  if config.flavour == "gpt2" and longest + max_new_tokens > config.max_seq_len:
    raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the learned position "
                     f"table (model.max_seq_len={config.max_seq_len}); shorten the prompt or generate fewer tokens")
  width = prompt_width(config, longest, max_new_tokens)
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, width - len(prompt):] = prompt
  pads = np.array([width - len(p) for p in prompts], np.int32)
  stop_ids = np.full(-(-max(len(stop_tokens), 1) // STOP_BUCKET) * STOP_BUCKET, -1, np.int32)  # -1 matches nothing
  stop_ids[:len(stop_tokens)] = list(stop_tokens)
  mesh = mesh_of(params)
  kwargs = dict(max_new_tokens=max_new_tokens, kv_cache=kv_cache)
  if mesh is not None:  # the result replicated on every host
    kwargs["out_sharding"] = sharding.replicated(mesh)
  args = (graphdef, params, tokens, pads, jax.random.key(seed), np.float32(temperature), np.int32(top_k),
          np.float32(top_p), stop_ids, np.int32(pad_id))
  return args, kwargs, mesh


def kv_cache_bytes(graphdef: nnx.GraphDef, params: Any, batch: int, slots: int, kv_cache: str = "float") -> int:
  """Bytes of the KV cache `generate` allocates for `batch` rows of `slots` positions (prompt bucket + new tokens):
  keys, values, their scales (int8) and the slots' segment ids. From shapes alone; nothing is allocated."""
  if kv_cache not in KV_CACHES:
    raise ValueError(f"kv_cache={kv_cache!r} is not one of {', '.join(KV_CACHES)}")
  model = nnx.merge(graphdef, params)
  cache = jax.eval_shape(lambda: model.init_cache(batch, slots, quantized=kv_cache == "int8"))
  return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)))


def sample_tokens(graphdef: nnx.GraphDef, params: Any, prompt_ids: list[int], num_tokens: int, max_len: int,
                  temperature: float = 0.8, top_k: int = 40, seed: int = 0, eos_id: int | None = None) -> list[int]:
  """The prompt followed by up to `num_tokens` sampled tokens (stopping after `eos_id`), within `max_len` tokens:
  the report's text sample. Uses the KV-cache decoder."""
  if not prompt_ids:
    raise ValueError("sample_tokens needs a non-empty prompt")
  prompt_ids = list(prompt_ids[-(max_len - 1):])
  num_tokens = min(num_tokens, max_len - len(prompt_ids))
  generated = generate(graphdef, params, [prompt_ids], num_tokens, temperature=temperature, top_k=top_k, seed=seed,
                       stop_tokens=() if eos_id is None else (eos_id,))[0]
  return prompt_ids + generated
