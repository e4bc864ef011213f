"""Incremental decoding with a KV cache: greedy, temperature, top-k and top-p sampling, stop tokens, batches of
prompts of different lengths; one jitted program per (batch size, prompt length bucket, new tokens), on one device
or a mesh.

Prompts are left-padded to a common length P so that every row writes the same cache slot at each step: the prompt
is prefilled in one call, then each step appends one token per row. Padding slots carry segment id 0, so no real
token attends to them, and positions count from each row's first real token, so a padded row computes exactly what
it would alone (checked in tests/test_generate.py).

Sampling runs only what the traced settings need (lax.cond): greedy an argmax, temperature alone one inverse-CDF draw
(`categorical`), top-k / top-p the cutoff from each row's largest logits (`top_candidates`, a full sort only when they
cannot settle it), exactly the cutoff a full sort gives. `sample_groups` is the traceable form for RL rollouts: one
prefill of B prompts, G samples of each from the repeated cache, inside the caller's jitted step; `generate` is its
host-side wrapper (G = 1) for lists of prompts.

Int8 weights (jaxlm.compress.quantization) enter the program as int8, so a step reads their int8 bytes, not a float
copy (`lower` gives the program and its inputs; benchmarks/bench_decode.py times it against bf16 weights).

`kv_cache="int8"` keeps the cache as int8 with one scale per token and KV head (jaxlm.models.kv_cache.KVCache): about
half the bytes of a bf16 cache and a quarter of an f32 one, for a small change in the logits (docs/optimization.md
has the measured agreement with the float cache). The default stays the float cache, which is exact.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from jaxlm.models.kv_cache import KVCache
from jaxlm.parallel import sharding
from jaxlm.parallel.sharding import constrain

PROMPT_BUCKET = 16  # prompts are left-padded to a multiple of this many tokens (one compile per bucket)
STOP_BUCKET = 8  # stop-token lists are padded to a multiple of this length (one compile for most lists)
KV_CACHES = ("float", "int8")  # float: the compute dtype; int8: per-token, per-KV-head scales
# top-k / top-p look at this many largest logits of each row (lax.top_k), the next tier only when a row's nucleus is
# not settled within the previous one, and sort the whole row only beyond the last (top_k above it, or a nucleus
# wider than it): a top-k of a few thousand costs a small share of a full sort (docs/performance.md, the sampler).
NUCLEUS_TIERS = (256, 4096)
DRAW_BLOCK = 256  # `categorical` finds the block of this many tokens that holds the draw, then the token in it
TOP_K_BLOCK = 64  # `top_candidates` looks for the C largest values in the C blocks of this many with the largest maxima


def categorical(key: jax.Array, logits_BV: jax.Array, temperature: float | jax.Array = 1.0,
                cutoff_B1: jax.Array | None = None) -> jax.Array:
  """One draw [B] per row from softmax(logits / temperature), as jax.random.categorical, only among the tokens whose
  logit / temperature is at least `cutoff_B1` (all without it), by inverting the CDF with one uniform per row: the
  row's blocks of DRAW_BLOCK tokens, then the tokens of the block the uniform falls in. jax.random.categorical's
  Gumbel trick needs a random number per token, which over a large vocabulary costs more than the LM head; this reads
  the logits once for the block sums (docs/performance.md, the sampler). A token of probability 0 is never drawn."""
  b, v = logits_BV.shape
  n = -(-v // DRAW_BLOCK)
  temperature = jnp.maximum(jnp.asarray(temperature, jnp.float32), 1e-6)
  logits_BNK = jnp.pad(logits_BV.astype(jnp.float32), ((0, 0), (0, n * DRAW_BLOCK - v)),
                       constant_values=-jnp.inf).reshape(b, n, DRAW_BLOCK)
  top_B11 = jnp.max(logits_BNK, axis=(1, 2), keepdims=True)

  def weights(logits):  # exp((logit - max) / t): the temperature inside the exp keeps it in the reductions' fusion
    top = top_B11.reshape((b,) + (1,) * (logits.ndim - 1))
    weights = jnp.exp((logits - top) / temperature)
    if cutoff_B1 is None:
      return weights
    # The row's largest logit is always kept, also should its scaled value round differently here than in the cutoff.
    below = (logits / temperature < cutoff_B1.reshape(top.shape)) & (logits < top)
    return jnp.where(below, 0.0, weights)

  # exp is recomputed for the chosen block rather than written out for the whole row (64 MiB at batch 64).
  block_sums_BN = jnp.sum(weights(logits_BNK), axis=-1)
  block_ends_BN = jnp.cumsum(block_sums_BN, axis=-1)
  u_B = jax.random.uniform(key, (b,)) * block_ends_BN[:, -1]
  # Rounding can put u past the last block's end or a hair before the chosen block's start: the clamps keep the
  # draw on a token of positive weight.
  last_block_B = jnp.max(jnp.where(block_sums_BN > 0, jnp.arange(n)[None, :], 0), axis=-1)
  block_B = jnp.minimum(jnp.sum(block_ends_BN <= u_B[:, None], axis=-1), last_block_B)
  before_B = jnp.take_along_axis(block_ends_BN - block_sums_BN, block_B[:, None], axis=-1)[:, 0]
  weights_BK = weights(jnp.take_along_axis(logits_BNK, block_B[:, None, None], axis=1)[:, 0])
  first_token_B = jnp.argmax(weights_BK > 0, axis=-1)
  last_token_B = jnp.max(jnp.where(weights_BK > 0, jnp.arange(DRAW_BLOCK)[None, :], 0), axis=-1)
  token_B = jnp.clip(jnp.sum(jnp.cumsum(weights_BK, axis=-1) <= (u_B - before_B)[:, None], axis=-1),
                     first_token_B, last_token_B)
  return (block_B * DRAW_BLOCK + token_B).astype(jnp.int32)


def argmax(logits_BV: jax.Array) -> jax.Array:
  """jnp.argmax over the last axis [B] int32 (the first index of the largest value, or of the first NaN), in two
  levels: the largest value of each block of DRAW_BLOCK tokens, then the position within the first block holding the
  largest. XLA:CPU reduces (value, index) pairs one at a time, so a flat argmax over a large vocabulary is slow
  (docs/performance.md, the sampler)."""
  b, v = logits_BV.shape
  n = -(-v // DRAW_BLOCK)
  logits_BNK = jnp.pad(logits_BV, ((0, 0), (0, n * DRAW_BLOCK - v)),
                       constant_values=-jnp.inf).reshape(b, n, DRAW_BLOCK)  # padding after: never first
  block_B = jnp.argmax(jnp.max(logits_BNK, axis=-1), axis=-1)
  within_B = jnp.argmax(jnp.take_along_axis(logits_BNK, block_B[:, None, None], axis=1)[:, 0], axis=-1)
  return (block_B * DRAW_BLOCK + within_B).astype(jnp.int32)


def top_candidates(x_BV: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
  """(values, ids) [B, C] of the C largest entries of each row, as jax.lax.top_k (tied values may come with other
  ids). Over a long row, in two steps: the C blocks of TOP_K_BLOCK entries with the largest maxima hold the C largest
  values (a block left out has a smaller maximum than C chosen ones, so than C of their entries), and lax.top_k of
  those C x TOP_K_BLOCK entries finds them: half the time of lax.top_k over 262,144 entries at C = 256."""
  b, v = x_BV.shape
  n = -(-v // TOP_K_BLOCK)
  if c * TOP_K_BLOCK * 4 > v:  # the blocks would not save enough to pay for the gather
    return jax.lax.top_k(x_BV, c)
  x_BNK = jnp.pad(x_BV, ((0, 0), (0, n * TOP_K_BLOCK - v)), constant_values=-jnp.inf).reshape(b, n, TOP_K_BLOCK)
  _, blocks_BC = jax.lax.top_k(jnp.max(x_BNK, axis=-1), c)
  candidates_BCK = jnp.take_along_axis(x_BNK, blocks_BC[:, :, None], axis=1)
  values_BC, at_BC = jax.lax.top_k(candidates_BCK.reshape(b, c * TOP_K_BLOCK), c)
  ids_BC = jnp.take_along_axis(blocks_BC, at_BC // TOP_K_BLOCK, axis=-1) * TOP_K_BLOCK + at_BC % TOP_K_BLOCK
  return values_BC, ids_BC.astype(jnp.int32)


def _cutoff(sorted_BC: jax.Array, k: jax.Array, top_p: jax.Array, v: int,
            full_sum_B1: jax.Array | None) -> tuple[jax.Array, jax.Array]:
  """(cutoff [B, 1], settled [B]) from each row's C largest scaled logits, sorted descending: the smallest value kept
  (a token is kept while the probability mass before it, renormalised over the top k, is below top_p), and whether
  these C decide it: they hold the top k, or (top-k off, so the mass is over the whole row, whose sum of
  exp(logit - max) is `full_sum_B1`) the nucleus ends among them."""
  c = sorted_BC.shape[-1]
  in_k_1C = (jnp.arange(c) < k)[None, :]
  # Reductions, not slices, of lax.top_k's output: XLA:CPU turns a top-k with a second slice into a full sort.
  weights_BC = jnp.where(in_k_1C, jnp.exp(sorted_BC - jnp.max(sorted_BC, axis=-1, keepdims=True)), 0.0)
  total_B1 = jnp.sum(weights_BC, axis=-1, keepdims=True)
  if full_sum_B1 is not None:
    total_B1 = jnp.where(k <= c, total_B1, full_sum_B1)
  probs_BC = weights_BC / total_B1
  before_BC = jnp.cumsum(probs_BC, axis=-1) - probs_BC
  kept_BC = (before_BC < top_p) & in_k_1C  # a prefix that holds the first token
  cutoff_B1 = jnp.min(jnp.where(kept_BC, sorted_BC, jnp.inf), axis=-1, keepdims=True)
  return cutoff_B1, (k <= c) | ((k == v) & (before_BC[:, -1] >= top_p))


def _scaled(logits: jax.Array, temperature: jax.Array) -> jax.Array:
  return logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)


def _filtered(logits_BV: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, finish):
  """finish(cutoff [B, 1], candidates [B, C] or None, their token ids [B, C] or None) for the top-k / top-p cutoff of
  logits / temperature in each row: from the first NUCLEUS_TIERS tier that settles every row (lax.cond runs only
  that tier's work), else from a sort of the whole row (candidates None). The candidates are scaled."""
  v = logits_BV.shape[-1]
  k = jnp.where((top_k > 0) & (top_k < v), top_k, v)
  top_p = jnp.where(top_p < 1.0, top_p, jnp.inf)

  def everything():
    cutoff_B1, _ = _cutoff(jnp.sort(_scaled(logits_BV, temperature), axis=-1)[:, ::-1], k, top_p, v, None)
    return finish(cutoff_B1, None, None)

  def tier(c, otherwise):
    def run():
      # Of the logits, not logits / temperature (no [B, V] copy for lax.top_k): dividing by t > 0 keeps the order,
      # so the scaled candidates are the C largest scaled values, ties included.
      top_BC, ids_BC = top_candidates(logits_BV, c)
      top_BC = _scaled(top_BC, temperature)
      # The whole row's mass normalises the nucleus only with top-k off.
      full_sum_B1 = jax.lax.cond(
          k <= c, lambda: jnp.ones((logits_BV.shape[0], 1), jnp.float32),
          lambda: jnp.sum(jnp.exp(_scaled(logits_BV, temperature) - jnp.max(top_BC, axis=-1, keepdims=True)),
                          axis=-1, keepdims=True))
      cutoff_B1, settled_B = _cutoff(top_BC, k, top_p, v, full_sum_B1)
      return jax.lax.cond(jnp.all(settled_B), lambda: finish(cutoff_B1, top_BC, ids_BC), otherwise)
    return run

  run = everything
  for c in reversed(NUCLEUS_TIERS):
    if c < v:
      run = tier(c, run)
  return run()


def filter_logits(logits_BV: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
  """Logits / temperature with everything outside the top-k and outside the top-p nucleus set to -inf.

  top_k = 0 and top_p >= 1 switch those filters off; the most likely token always survives, and so does every token
  tied with the smallest one kept (with the k-th, say). The nucleus is the shortest prefix of the descending order
  whose mass reaches top_p, the mass renormalised over the top k. All three are traced values, so changing them does
  not recompile. Exactly the cutoff of a full sort, from lax.top_k of the NUCLEUS_TIERS candidates (sorting the whole
  row only when they cannot settle it): tests/test_generate.py checks it against a full-sort reference."""
  temperature, top_k, top_p = jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p)

  def cut(cutoff_B1, *_):
    scaled_BV = _scaled(logits_BV, temperature)
    return jnp.where(scaled_BV < cutoff_B1, -jnp.inf, scaled_BV)

  return _filtered(logits_BV, temperature, top_k, top_p, cut)


def sample(logits_BV: jax.Array, key: jax.Array, temperature: jax.Array, top_k: jax.Array,
           top_p: jax.Array) -> jax.Array:
  """Next tokens [B]: argmax when temperature == 0, else a draw from the filtered distribution (`filter_logits`).

  lax.cond on the traced settings runs only the work they need: greedy decoding only the argmax, sampling without
  top-k and top-p only `categorical` on logits / temperature, and the filters only their candidates' work."""
  temperature, top_k, top_p = jnp.asarray(temperature), jnp.asarray(top_k), jnp.asarray(top_p)
  v = logits_BV.shape[-1]

  def finish(cutoff_B1, top_BC, ids_BC):
    whole_row = lambda: categorical(key, logits_BV, temperature, cutoff_B1)
    if top_BC is None:
      return whole_row()
    among_candidates = lambda: jnp.take_along_axis(
        ids_BC, categorical(key, jnp.where(top_BC < cutoff_B1, -jnp.inf, top_BC))[:, None], axis=-1)[:, 0]
    # Tokens tied with the last candidate may lie outside the candidates; then the draw is over the whole row.
    return jax.lax.cond(jnp.any(cutoff_B1[:, 0] <= jnp.min(top_BC, axis=-1)), whole_row, among_candidates)

  def drawn():
    unfiltered = ((top_k <= 0) | (top_k >= v)) & (top_p >= 1.0)
    return jax.lax.cond(unfiltered, lambda: categorical(key, logits_BV, temperature),
                        lambda: _filtered(logits_BV, temperature, top_k, top_p, finish).astype(jnp.int32))

  return jax.lax.cond(temperature > 0, drawn, lambda: argmax(logits_BV))


def _decoder(model: nnx.Module) -> Callable[[], nnx.Module]:
  """make() -> the model to decode with, built where it is called (inside the decode loop's body). Two changes on a
  CPU (measured in docs/performance.md, the sampler), the caller's model left as it is:

  - XLA's dot where the model multiplies through the BLAS custom call (kernels.matmul=blas, chosen for the training
    step's GEMMs): a decode step multiplies a few rows by each weight, which XLA's dot does faster than the custom
    call.
  - The layers as a Python loop over weights split per layer once, before the loop over tokens: a scan over the
    stacked [L, ...] weights copies each layer's weights out of the stack at every step (XLA:CPU's dots take no
    slice of an array). Faster steps, for one copy of the blocks' weights while generating and a longer compile."""
  kernels = getattr(model, "kernels", None)
  if kernels is None or jax.default_backend() != "cpu":
    return lambda: model
  decoding = dataclasses.replace(kernels, matmul="xla" if kernels.matmul == "blas" else kernels.matmul,
                                 layers="loop")
  model = nnx.merge(*nnx.split(model))  # a copy of the module graph
  for _, module in nnx.iter_modules(model):
    if getattr(module, "kernels", None) == kernels:
      module.kernels = decoding
  graphdef, blocks, rest = nnx.split(model, nnx.PathContains("blocks"), ...)
  layers = [jax.tree.map(lambda a: a[i], blocks) for i in range(model.config.num_layers)]
  # Stacked again where the model is used: its loop's per-layer slices of the stack fold back into these arrays.
  return lambda: nnx.merge(graphdef, jax.tree.map(lambda *each: jnp.stack(each), *layers), rest)


def _prefill(model, tokens_BP: jax.Array, pads_B: jax.Array, slots: int, kv_cache: str):
  """(the last prompt token's logits [B, V] in f32, the cache after the prompt) for left-padded prompts. The prompt
  but its last token fills the cache without logits (XLA drops the unused LM head: P x the vocabulary projection),
  then the last token alone gives the logits."""
  b, p = tokens_BP.shape
  slots_P = jnp.arange(p)
  segments_BP = (slots_P[None, :] >= pads_B[:, None]).astype(jnp.int32)  # 0 on the left padding
  positions_BP = jnp.maximum(slots_P[None, :] - pads_B[:, None], 0)
  cache = model.init_cache(b, slots, quantized=kv_cache == "int8")
  if p > 1:
    _, cache = model.decode(tokens_BP[:, :-1], cache, positions_BP[:, :-1], segments_BP[:, :-1])
  logits_B1V, cache = model.decode(tokens_BP[:, -1:], cache, positions_BP[:, -1:], segments_BP[:, -1:])
  return logits_B1V[:, 0], cache


def _repeat_rows(cache: KVCache, g: int) -> KVCache:
  """Each row of the cache G times in a row (row b * G + g is copy g of row b), laid out like a fresh cache."""
  if g == 1:
    return cache
  rows = lambda x, axis: None if x is None else jnp.repeat(x, g, axis=axis)
  kv_axes = (None, "act_batch", None, "act_kv_heads", None)
  k, v, k_scale, v_scale = (None if x is None else constrain(rows(x, 1), kv_axes[:x.ndim])
                            for x in (cache.k_LBSGK, cache.v_LBSGK, cache.k_scale_LBSG, cache.v_scale_LBSG))
  return KVCache(k, v, rows(cache.segment_ids_BS, 0), cache.end, k_scale, v_scale)


def sample_groups(model: nnx.Module, tokens_BP: jax.Array, pads_B: jax.Array, key: jax.Array, *,
                  num_generations: int, max_new_tokens: int, temperature: float | jax.Array = 1.0,
                  top_k: int | jax.Array = 0, top_p: float | jax.Array = 1.0,
                  stop_ids: Sequence[int] | jax.Array = (), pad_id: int | jax.Array = 0,
                  kv_cache: str = "float") -> jax.Array:
  """Completions [B * G, max_new_tokens] int32 of G = num_generations samples per prompt (GRPO's groups): row
  b * G + g is sample g of prompt b, as jnp.repeat(prompts, G, axis=0) orders them.

  Traceable: call it inside a jitted function (on a mesh: under jax.set_mesh, with the params sharded as training
  shards them; the rows are split over the batch axes like activations). One prefill of the B prompts (`tokens_BP`,
  left-padded by `pads_B` tokens; `left_pad` builds both), whose cache and last logits are repeated G times; then
  one token per row per step until every row has emitted one of `stop_ids` or max_new_tokens are made, pad_id after
  a row's stop token (which it keeps). The tokens are a function of (params, prompts, key, settings) alone, the same
  on one device as on a mesh. temperature / top_k / top_p may be traced (no recompile when they change)."""
  b, p = tokens_BP.shape
  g = num_generations
  if kv_cache not in KV_CACHES:
    raise ValueError(f"kv_cache={kv_cache!r} is not one of {', '.join(KV_CACHES)}")
  if g < 1 or max_new_tokens < 1:
    raise ValueError(f"num_generations ({g}) and max_new_tokens ({max_new_tokens}) must be at least 1")
  stop_ids = jnp.asarray(stop_ids, jnp.int32).reshape(-1)
  if stop_ids.size == 0:
    stop_ids = jnp.full((1,), -1, jnp.int32)  # -1 matches nothing
  temperature, top_p = jnp.asarray(temperature, jnp.float32), jnp.asarray(top_p, jnp.float32)
  top_k, pad_id = jnp.asarray(top_k, jnp.int32), jnp.asarray(pad_id, jnp.int32)
  make = _decoder(model)
  logits_BV, cache = _prefill(make(), tokens_BP, pads_B, p + max_new_tokens, kv_cache)
  logits_RV, cache = jnp.repeat(logits_BV, g, axis=0), _repeat_rows(cache, g)
  pads_R = jnp.repeat(pads_B, g, axis=0)
  r = b * g

  def cond(carry):
    i, _, _, done_R, _, _ = carry
    return (i < max_new_tokens) & ~jnp.all(done_R)

  def body(carry):
    i, logits_RV, cache, done_R, out_RN, key = carry
    key, sub = jax.random.split(key)
    token_R = jnp.where(done_R, pad_id, sample(logits_RV, sub, temperature, top_k, top_p))
    out_RN = jax.lax.dynamic_update_slice(out_RN, token_R[:, None], (jnp.zeros((), jnp.int32), i))
    done_R = done_R | jnp.any(token_R[:, None] == stop_ids[None, :], axis=-1)
    # Rows that are done keep feeding padding; their outputs are masked above. The last step's decode is unused.
    logits_R1V, cache = make().decode(token_R[:, None], cache, (p + i - pads_R)[:, None],
                                      jnp.ones((r, 1), jnp.int32))
    return i + 1, logits_R1V[:, 0], cache, done_R, out_RN, key

  out_RN = jnp.full((r, max_new_tokens), pad_id, jnp.int32)
  carry = (jnp.zeros((), jnp.int32), logits_RV, cache, jnp.zeros((r,), bool), out_RN, key)
  return jax.lax.while_loop(cond, body, carry)[4]


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "kv_cache", "out_sharding"))
def _generate(graphdef, params, tokens_BP, pads_B, key, temperature, top_k, top_p, stop_ids, pad_id, *,
              max_new_tokens, kv_cache="float", out_sharding=None):
  """`generate`'s program: sample_groups with one sample per prompt."""
  out_RN = sample_groups(nnx.merge(graphdef, params), tokens_BP, pads_B, key, num_generations=1,
                         max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         stop_ids=stop_ids, pad_id=pad_id, kv_cache=kv_cache)
  return out_RN if out_sharding is None else jax.lax.with_sharding_constraint(out_RN, out_sharding)


def left_pad(prompts: Sequence[Sequence[int]], width: int, pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """(tokens [B, width], pads [B]) int32: each prompt right-aligned after `pads` copies of pad_id (what
  `sample_groups` and the jitted generation take; `prompt_width` gives a width that shares compiled programs)."""
  if any(len(p) > width for p in prompts):
    raise ValueError(f"a prompt of {max(map(len, prompts))} tokens does not fit width {width}")
  tokens = np.full((len(prompts), width), pad_id, np.int32)
  for row, prompt in enumerate(prompts):
    tokens[row, width - len(prompt):] = prompt
  return tokens, np.array([width - len(p) for p in prompts], np.int32)


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
  tokens, pads = left_pad(prompts, prompt_width(config, longest, max_new_tokens), pad_id)
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
