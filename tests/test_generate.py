"""KV-cache decoding equals recomputing the whole sequence (1 and 4 devices, packed documents); sampling filters (the
top-k candidates' cutoff equals a full sort's, draws follow the filtered distribution, settings that need no filter
run none); batched generation of prompts of different lengths; stop tokens; the group sampler (greedy groups, stops,
1 vs 4 devices); the int8 KV cache (logits near the float cache's, the same greedy tokens, with float and int8
weights; its bytes); the experiments/generate.py loader."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import script_with_flags
from flax import nnx

from jaxlm.config import MeshConfig, ModelConfig
from jaxlm.inference import generate
from jaxlm.models.gpt import GPT
from jaxlm.parallel import sharding

GPT2 = ModelConfig(vocab_size=300, num_layers=2, d_model=32, num_heads=4, max_seq_len=32, compute_dtype="float32")
LLAMA = dataclasses.replace(GPT2, flavour="llama", num_kv_heads=2, d_ff=48, tie_embeddings=False, rope_theta=100.0)
MQA = dataclasses.replace(LLAMA, num_kv_heads=1, tie_embeddings=True)
CONFIGS = {"gpt2": GPT2, "llama_gqa": LLAMA, "llama_mqa": MQA}
TOKENS = np.random.default_rng(0).integers(0, GPT2.vocab_size, (2, 14)).astype(np.int32)
# Two packed documents per row: 6 tokens, then 8 with positions restarting at 0.
SEGMENTS = np.array([[1] * 6 + [2] * 8] * 2, np.int32)
POSITIONS = np.array([list(range(6)) + list(range(8))] * 2, np.int32)
# Four prompts of different lengths within one prompt bucket: the tests' float generations of 6 tokens share one
# compiled program per flavour, and their groups one program (two prompts per data shard on the mesh).
PROMPTS = [[11], [200, 13, 7, 7, 91, 4, 150, 33, 2, 64, 18], [5, 250, 60, 9], [3, 4]]


_MODELS = {}


def _split(name):
  """(graphdef, params) of a small random model, built once per test module."""
  if name not in _MODELS:
    graphdef, state = nnx.split(GPT(CONFIGS[name], rngs=nnx.Rngs(1)))
    _MODELS[name] = graphdef, state.to_pure_dict()
  return _MODELS[name]


@functools.partial(jax.jit, static_argnums=0)
def _full(graphdef, params, tokens, positions, segments):
  return nnx.merge(graphdef, params)(tokens, positions, segments)


CHUNKS = (4, 3, 7)  # prefill, a chunk across the document boundary at position 6, the rest (generation feeds 1)


@functools.partial(jax.jit, static_argnames=("graphdef", "chunks", "quantized"))
def _cached(graphdef, params, tokens, positions, segments, chunks=CHUNKS, quantized=False):
  """Logits from prefilling chunks[0] tokens, then feeding the rest in `chunks[1:]`-sized pieces."""
  model = nnx.merge(graphdef, params)
  cache = model.init_cache(tokens.shape[0], tokens.shape[1] + 3, quantized)  # spare slots stay empty and masked
  outs, start = [], 0
  for size in chunks:
    logits, cache = model.decode(tokens[:, start:start + size], cache, positions[:, start:start + size],
                                 segments[:, start:start + size])
    outs.append(logits)
    start += size
  return jnp.concatenate(outs, axis=1)


def _assert_close(ours, reference):
  np.testing.assert_allclose(ours, reference, rtol=1e-5, atol=1e-5 * float(jnp.abs(reference).max()))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_kv_cache_equals_full_recompute_with_packed_documents(name):
  graphdef, params = _split(name)
  full = _full(graphdef, params, TOKENS, POSITIONS, SEGMENTS)
  cached = _cached(graphdef, params, TOKENS, POSITIONS, SEGMENTS)
  _assert_close(cached, full)
  if name == "llama_gqa":  # the second document really ignores the first: alone it gives the same logits
    _assert_close(cached[:, 6:], _full(graphdef, params, TOKENS[:, 6:], POSITIONS[:, 6:], SEGMENTS[:, 6:]))


def _greedy_by_recompute(graphdef, params, prompts, steps):
  """Greedy decoding without a cache, one prompt at a time: the whole fixed-length buffer is recomputed for every
  token (causal, so the zeros after position i - 1 do not matter); one compiled program for every prompt."""

  @jax.jit
  def next_token(params, buffer, i):
    return jnp.argmax(nnx.merge(graphdef, params)(buffer)[0, i - 1])

  outs = []
  for prompt in prompts:
    buffer = np.zeros((1, max(map(len, prompts)) + steps), np.int32)
    buffer[0, :len(prompt)] = prompt
    for i in range(len(prompt), len(prompt) + steps):
      buffer[0, i] = int(next_token(params, buffer, i))
    outs.append(buffer[0, len(prompt):len(prompt) + steps].tolist())
  return outs


@pytest.mark.parametrize("name", ["gpt2", "llama_gqa"])
def test_greedy_batch_of_different_lengths_equals_each_prompt_recomputed_alone(name):
  graphdef, params = _split(name)
  assert generate.generate(graphdef, params, PROMPTS, 6) == _greedy_by_recompute(graphdef, params, PROMPTS, 6)


def test_stop_tokens_end_each_row_on_its_own():
  graphdef, params = _split("llama_gqa")
  free = generate.generate(graphdef, params, PROMPTS, 6)
  stop = free[0][2]
  stopped = generate.generate(graphdef, params, PROMPTS, 6, stop_tokens=(stop,))
  assert stopped[0] == free[0][:free[0].index(stop) + 1]
  assert any(stop not in row for row in free)  # a row without the stop token runs to the end
  assert stopped == [row[:row.index(stop) + 1] if stop in row else row for row in free]


# One compiled filter per logits shape (the settings are traced), shared by the tests below.
_filter = jax.jit(generate.filter_logits)


def test_filters_keep_the_top_k_and_the_nucleus():
  logits = jnp.log(jnp.array([[0.5, 0.25, 0.15, 0.1]]))
  one = np.float32(1.0)
  kept = lambda top_k, top_p: np.isfinite(np.asarray(_filter(logits, one, np.int32(top_k), np.float32(top_p))))[0]
  assert kept(2, 1.0).tolist() == [True, True, False, False]
  assert kept(0, 0.7).tolist() == [True, True, False, False]
  assert kept(0, 0.76).tolist() == [True, True, True, False]
  assert kept(0, 1e-3).tolist() == [True, False, False, False]
  assert kept(0, 1.0).tolist() == [True] * 4


def _sorted_filter(logits, temperature, top_k, top_p):
  """The filter as a full sort of every row computes it (jaxlm's before the top-k candidates): the reference."""
  logits = logits.astype(jnp.float32) / jnp.maximum(temperature, 1e-6)
  sorted_BV = jnp.sort(logits, axis=-1)[:, ::-1]
  v = logits.shape[-1]
  k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
  sorted_BV = jnp.where(jnp.arange(v)[None, :] < k, sorted_BV, -jnp.inf)
  probs_BV = jax.nn.softmax(sorted_BV, axis=-1)
  kept_BV = ((jnp.cumsum(probs_BV, axis=-1) - probs_BV) < jnp.where(top_p < 1.0, top_p, jnp.inf)) & (
      jnp.arange(v)[None, :] < k)
  cutoff_B1 = jnp.min(jnp.where(kept_BV, sorted_BV, jnp.inf), axis=-1, keepdims=True)
  return jnp.where(logits < cutoff_B1, -jnp.inf, logits)


FILTER_VOCAB = 5000  # above both NUCLEUS_TIERS, so every tier and the full sort get their turn


def _filter_logits():
  """Rows [8, FILTER_VOCAB] from sharp to flat, on a grid of 1/4 (ties everywhere, also at the k-th token)."""
  rng = np.random.default_rng(0)
  scales = np.array([40.0, 20.0, 8.0, 3.0, 1.0, 0.3, 0.05, 0.0])[:, None]  # the last row: every token tied
  return jnp.asarray(np.round(rng.standard_normal((8, FILTER_VOCAB)) * scales * 4) / 4, jnp.float32)


# The reference for a grid of (top_k, top_p) at one temperature: one sort of the row, shared by the grid.
_sorted_filters = jax.jit(jax.vmap(_sorted_filter, in_axes=(None, None, 0, 0)))


def test_filter_equals_a_full_sort_on_every_path_with_ties():
  assert max(generate.NUCLEUS_TIERS) < FILTER_VOCAB
  logits = _filter_logits()
  grid = [(top_k, top_p) for top_k in (0, 1, 3, 50, 256, 257, 1000, 4096, 4500, FILTER_VOCAB, FILTER_VOCAB + 7)
          for top_p in (1.0, 0.95, 0.5, 1e-3)]
  top_ks, top_ps = np.array([k for k, _ in grid], np.int32), np.array([p for _, p in grid], np.float32)
  kept_sizes = set()
  for temperature in (1.0, 0.5, 2.0):
    wanted = np.asarray(_sorted_filters(logits, np.float32(temperature), top_ks, top_ps))
    for (top_k, top_p), want in zip(grid, wanted):
      ours = _filter(logits, np.float32(temperature), np.int32(top_k), np.float32(top_p))
      np.testing.assert_array_equal(np.asarray(ours), want, err_msg=f"{temperature=} {top_k=} {top_p=}")
      kept_sizes.update(np.isfinite(want).sum(-1).tolist())
  # The cases covered: one token, a nucleus within each tier, beyond both (the sort), and every tied token kept.
  tiers = generate.NUCLEUS_TIERS
  assert 1 in kept_sizes and FILTER_VOCAB in kept_sizes
  assert any(1 < n <= tiers[0] for n in kept_sizes) and any(tiers[0] < n <= tiers[1] for n in kept_sizes)
  assert any(tiers[1] < n < FILTER_VOCAB for n in kept_sizes)


def test_top_candidates_of_a_long_row_equal_lax_top_k_with_ties():
  """Over 70,000 entries the candidates come from the blocks with the largest maxima: the same values as lax.top_k
  (tied ones may carry other ids), and the filter built on them still equals the full sort."""
  v = 70000
  assert 256 * generate.TOP_K_BLOCK * 4 <= v  # the two-step path
  logits = jnp.asarray(np.round(np.random.default_rng(2).standard_normal((4, v)) * 12) / 4, jnp.float32)
  values, ids = jax.jit(generate.top_candidates, static_argnums=1)(logits, 256)
  np.testing.assert_array_equal(values, jax.lax.top_k(logits, 256)[0])
  np.testing.assert_array_equal(np.take_along_axis(np.asarray(logits), np.asarray(ids), -1), values)
  assert all(len(set(row)) == 256 for row in np.asarray(ids).tolist())
  for top_k, top_p in ((50, 0.95), (0, 0.9), (300, 1.0)):
    args = (logits, np.float32(1.0), np.int32(top_k), np.float32(top_p))
    np.testing.assert_array_equal(_filter(*args), jax.jit(_sorted_filter)(*args))


def _frequencies(tokens, v):
  return np.bincount(np.asarray(tokens).ravel(), minlength=v) / np.asarray(tokens).size


def _chi_square_fits(got, want, rows):
  """Whether frequencies `got` of `rows` draws fit probabilities `want`: Pearson's chi-square over bins of tokens
  pooled (least likely first) until each expects 100 draws, below its mean + 5 standard deviations."""
  observed, expected, bins = 0.0, 0.0, []
  for token in np.argsort(want):
    observed, expected = observed + got[token] * rows, expected + want[token] * rows
    if expected >= 100:
      bins.append((observed, expected))
      observed, expected = 0.0, 0.0
  chi2 = sum((o - e) ** 2 / e for o, e in bins)
  return chi2 < len(bins) - 1 + 5 * np.sqrt(2 * (len(bins) - 1))


def _draw_logits(scale, v=600):
  """One row of logits on a grid of 1/4 (ties), 50 tokens tied around the 256th largest (top_k=256 keeps all of them,
  most outside the candidates); `scale` sets how much of the mass the top few tokens hold."""
  rng = np.random.default_rng(1)
  spread = np.round(rng.standard_normal(v) * scale) / 4
  spread[:300] = np.sort(spread[:300])[::-1]
  spread[250:300] = spread[250]
  spread[300:] = np.minimum(spread[300:], spread[250] - 1.0)
  return rng.permutation(spread)


def test_draws_follow_the_filtered_distribution():
  """Many rows of one set of logits, one draw each: the frequencies match softmax(filter_logits) and never fall
  outside it, on the candidates' path (sharp logits), the whole row's (flat logits, where the tokens tied with the
  last candidate hold a tenth of the mass: a sampler that drops them fails the fit) and without a filter. Sampler
  bugs (ties at the cutoff dropped on either path, the temperature missing or applied twice, the nucleus skipped, a
  draw one token off) fail a fit at these rows."""
  v, rows = 600, 5000
  sharp, flat = (jnp.asarray(np.broadcast_to(_draw_logits(scale), (rows, v)), jnp.float32) for scale in (8, 2))
  draw = jax.jit(generate.sample)
  for logits, temperature, top_k, top_p in ((sharp, 0.7, 0, 1.0), (sharp, 1.0, 5, 1.0), (sharp, 0.7, 0, 0.8),
                                            (sharp, 1.5, 40, 0.9), (flat, 1.0, 256, 1.0)):
    settings = (np.float32(temperature), np.int32(top_k), np.float32(top_p))
    want = np.asarray(jax.nn.softmax(_filter(logits[:1], *settings)))[0]
    got = _frequencies(draw(logits, jax.random.key(top_k), *settings), v)
    assert np.all(got[want == 0] == 0), (temperature, top_k, top_p)
    assert _chi_square_fits(got, want, rows), (temperature, top_k, top_p)
  with_minus_inf = jnp.asarray([[0.0, -jnp.inf, 1.0, 2.0, -jnp.inf]] * rows)
  got = _frequencies(jax.jit(generate.categorical)(jax.random.key(5), with_minus_inf), 5)
  assert _chi_square_fits(got, np.asarray(jax.nn.softmax(with_minus_inf[0])), rows)
  assert got[1] == got[4] == 0


def test_settings_that_need_no_filter_run_none():
  """Greedy, unfiltered and filtered sampling are branches of lax.cond on the traced settings: the sort, the
  candidates and the random draw all sit inside branches, none at the top of the program."""
  logits = jnp.zeros((2, 1000))
  jaxpr = jax.make_jaxpr(generate.sample)(logits, jax.random.key(0), np.float32(0), np.int32(0), np.float32(1))
  top = {e.primitive.name for e in jaxpr.jaxpr.eqns}
  assert "cond" in top and not top & {"sort", "top_k", "random_bits", "random_wrap", "threefry2x32"}
  assert np.asarray(generate.sample(logits.at[1, 7].set(1), jax.random.key(0), 0.0, 0, 1.0)).tolist() == [0, 7]


def test_sampling_is_seeded_and_top_k_1_is_greedy():
  graphdef, params = _split("llama_gqa")
  greedy = generate.generate(graphdef, params, PROMPTS, 6)
  assert generate.generate(graphdef, params, PROMPTS, 6, temperature=1.0, top_k=1, seed=3) == greedy
  hot = dict(temperature=5.0, top_p=0.99, seed=7)
  drawn = generate.generate(graphdef, params, PROMPTS, 6, **hot)
  assert drawn == generate.generate(graphdef, params, PROMPTS, 6, **hot)
  assert drawn != greedy  # at temperature 5 the draws differ from the argmax


@functools.cache
def _on_mesh():
  """(mesh, llama_gqa's params sharded over it): batch over data=2, heads over tensor=2."""
  graphdef, params = _split("llama_gqa")
  mesh = sharding.make_mesh(MeshConfig(data=2, fsdp=1, tensor=2), jax.devices()[:4])
  return mesh, jax.device_put(params, sharding.param_shardings(nnx.split(nnx.merge(graphdef, params))[1], mesh))


def test_kv_cache_and_generation_on_a_four_device_mesh_equal_one_device():
  graphdef, params = _split("llama_gqa")
  mesh, sharded = _on_mesh()
  assert sharded["blocks"]["attn"]["w_k"].addressable_shards[0].data.shape[2] == 1  # 2 KV heads over tensor=2
  with jax.set_mesh(mesh):
    cached = _cached(graphdef, sharded, TOKENS, POSITIONS, SEGMENTS)
  _assert_close(cached, _full(graphdef, params, TOKENS, POSITIONS, SEGMENTS))
  assert generate.generate(graphdef, sharded, PROMPTS, 6) == generate.generate(graphdef, params, PROMPTS, 6)


STOP_WIDTH = 104  # every test's stop list padded with -1 (matches nothing) to one length: one compiled program


@functools.partial(jax.jit, static_argnames=("graphdef", "num_generations", "max_new_tokens"))
def _run_groups(graphdef, params, tokens, pads, key, temperature, top_k, top_p, stop_ids, pad_id, *, num_generations,
                max_new_tokens):
  """sample_groups inside a jitted function with traced settings, as an RL step calls it."""
  return generate.sample_groups(nnx.merge(graphdef, params), tokens, pads, key, num_generations=num_generations,
                                max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                                stop_ids=stop_ids, pad_id=pad_id)


def _groups(graphdef, params, key, temperature, top_k=0, top_p=1.0, stop_ids=(), pad_id=0, mesh=None):
  """3 samples of 6 tokens for each of PROMPTS, left-padded to 16 tokens (on `mesh`: split over its batch axes)."""
  tokens, pads = generate.left_pad(PROMPTS, 16)
  stops = np.full(STOP_WIDTH, -1, np.int32)
  stops[:len(stop_ids)] = stop_ids
  args = (tokens, pads, key, np.float32(temperature), np.int32(top_k), np.float32(top_p), stops, np.int32(pad_id))
  if mesh is None:
    return np.asarray(_run_groups(graphdef, params, *args, num_generations=3, max_new_tokens=6))
  tokens, pads = (jax.device_put(x, sharding.batch_sharding(mesh, x.ndim)) for x in (tokens, pads))
  with jax.set_mesh(mesh):
    out = _run_groups(graphdef, params, tokens, pads, *args[2:], num_generations=3, max_new_tokens=6)
  assert len(out.sharding.device_set) == 4
  return np.asarray(out)


def test_greedy_groups_repeat_the_greedy_generation():
  graphdef, params = _split("llama_gqa")
  out = _groups(graphdef, params, jax.random.key(0), temperature=0.0)
  greedy = generate.generate(graphdef, params, PROMPTS, 6)
  assert out.shape == (12, 6) and out.tolist() == [row for row in greedy for _ in range(3)]


def test_sampled_groups_stop_pad_and_repeat_exactly():
  graphdef, params = _split("llama_gqa")
  stops = list(range(0, 300, 3))  # a third of the vocabulary: most rows stop within a few tokens
  settings = dict(temperature=3.0, top_k=100, top_p=0.95, stop_ids=stops, pad_id=299)
  out = _groups(graphdef, params, jax.random.key(1), **settings)
  assert out.shape == (12, 6)
  ends = []
  for row in out.tolist():
    hits = [i for i, t in enumerate(row) if t in stops]
    ends.append(hits[0] + 1 if hits else len(row))
    assert row[ends[-1]:] == [299] * (len(row) - ends[-1])
  assert min(ends) < 6 and len({tuple(r) for r in out.tolist()}) > 3  # rows stopped early; the samples differ
  np.testing.assert_array_equal(_groups(graphdef, params, jax.random.key(1), **settings), out)


def test_groups_on_a_four_device_mesh_equal_one_device():
  graphdef, params = _split("llama_gqa")
  mesh, sharded = _on_mesh()
  settings = dict(temperature=1.5, top_k=50, top_p=0.9, stop_ids=[7])
  np.testing.assert_array_equal(_groups(graphdef, sharded, jax.random.key(2), mesh=mesh, **settings),
                                _groups(graphdef, params, jax.random.key(2), **settings))


# Per-token absmax int8 rounds each cached key and value by at most 1/254 of its vector's largest entry; through
# attention that moves these small models' logits by well under 1% of their largest magnitude.
INT8_LOGIT_TOLERANCE = 0.01


def test_int8_kv_cache_logits_are_near_the_float_cache():
  graphdef, params = _split("llama_gqa")  # the cache path is the flavours' shared Attention.decode
  float_cache = _cached(graphdef, params, TOKENS, POSITIONS, SEGMENTS)
  int8_cache = _cached(graphdef, params, TOKENS, POSITIONS, SEGMENTS, quantized=True)
  error = float(jnp.abs(int8_cache - float_cache).max())
  assert 0 < error <= INT8_LOGIT_TOLERANCE * float(jnp.abs(float_cache).max())  # 0 < : the cache really is int8


def test_int8_kv_cache_greedy_tokens_agree_with_float_and_int8_weights():
  from jaxlm.compress import quantization

  graphdef, params = _split("llama_gqa")
  assert (generate.generate(graphdef, params, PROMPTS, 6, kv_cache="int8") ==
          generate.generate(graphdef, params, PROMPTS, 6))
  int8_def, int8_params = nnx.split(quantization.quantize(nnx.merge(graphdef, params), "weight_only"))
  assert (generate.generate(int8_def, int8_params, PROMPTS, 6, kv_cache="int8") ==
          generate.generate(int8_def, int8_params, PROMPTS, 6))


def test_int8_kv_cache_bytes_halve_bf16_and_quarter_f32():
  # Shapes only (no compile): head_dim 64, where the f32 scale per token and head adds 4 bytes to 64 int8 values.
  config = dataclasses.replace(LLAMA, d_model=256, num_heads=4, num_kv_heads=2, num_layers=3)
  sizes = {}
  for dtype in ("float32", "bfloat16"):
    graphdef, params = nnx.split(nnx.eval_shape(lambda: GPT(dataclasses.replace(config, compute_dtype=dtype),
                                                            rngs=nnx.Rngs(0))))
    for kv_cache in generate.KV_CACHES:
      sizes[dtype, kv_cache] = generate.kv_cache_bytes(graphdef, params, batch=4, slots=128, kv_cache=kv_cache)
  segment_bytes = 4 * 128 * 4  # int32 segment id per slot, plus the 4-byte `end`
  kv_values = 2 * 3 * 4 * 128 * 2 * 64  # keys and values: layers x batch x slots x kv heads x head dim
  assert sizes["float32", "float"] == 4 * kv_values + segment_bytes + 4
  assert sizes["bfloat16", "float"] == 2 * kv_values + segment_bytes + 4
  assert sizes["float32", "int8"] == sizes["bfloat16", "int8"] == kv_values * (1 + 4 / 64) + segment_bytes + 4
  assert 0.5 < sizes["bfloat16", "int8"] / sizes["bfloat16", "float"] < 0.55
  assert 0.25 < sizes["float32", "int8"] / sizes["float32", "float"] < 0.28
  with pytest.raises(ValueError, match="kv_cache='int4'"):
    generate.generate(graphdef, params, [[1]], 1, kv_cache="int4")


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory):
  """(a training run's folder, its config, its params): config.json, tokenizer.json and a checkpoint of gpt2's params
  at step 3, written once for the tests below."""
  from jaxlm import data as data_lib
  from jaxlm.config import Config, DataConfig, TrainConfig
  from jaxlm.training import optim
  from jaxlm.training.checkpoint import Checkpointer

  folder = tmp_path_factory.mktemp("run")
  config = Config(model=GPT2, data=DataConfig(seq_len=16), mesh=MeshConfig(data=1),
                  train=TrainConfig(steps=1, warmup_steps=0))
  _, params = _split("gpt2")
  # The train state that jaxlm.training.state.init_train_state builds, without compiling its initialiser.
  state = {"step": jnp.zeros((), jnp.int32), "params": params,
           "opt_state": optim.make_optimizer(config.train).init(params)}
  checkpointer = Checkpointer(str(folder / "checkpoints"), every_steps=1, keep=1)
  checkpointer.save(3, state, {}, config.model)
  checkpointer.close()
  (folder / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
  data_lib.train_bpe(["def f(x):\n  return x\n"] * 20, GPT2.vocab_size, str(folder / "tokenizer.json"))
  return folder, config, params


# The generations below (a run's params as loaded, one prompt of 17 to 31 tokens padded to 31, one new token) share
# one compiled program.
def test_sample_tokens_keeps_its_contract(run_folder):
  from jaxlm.recipes import trained_runs

  _, graphdef, params, _, _ = trained_runs.load_decoder_run(str(run_folder[0]))
  out = generate.sample_tokens(graphdef, params, list(range(40)), 10, max_len=20)
  assert len(out) == 20 and out[:19] == list(range(21, 40))  # prompt cut to max_len - 1, then one new token


@pytest.fixture
def generate_script():
  """experiments/generate.py, whose absl flags (a required --workdir among them) are removed again afterwards: absl's
  FLAGS are one per process, shared with whichever test files `make test` runs in this worker."""
  with script_with_flags("experiments/generate.py") as script:
    yield script


def test_experiment_script_loads_the_latest_checkpoint(run_folder, generate_script):
  folder, config, params = run_folder
  loaded_config, loaded_graphdef, loaded, tokenizer, step = generate_script.load_run(str(folder))
  assert step == 3 and loaded_config.model == config.model
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(loaded), jax.device_get(params))
  assert loaded_graphdef == _split("gpt2")[0]
  prompt = tokenizer.encode("def " * 9).ids
  assert len(prompt) == 18 and len(generate.generate(loaded_graphdef, loaded, [prompt], 1)[0]) == 1


def test_experiment_script_chats_under_the_workdirs_template(run_folder, generate_script):
  """--chat: the prompt becomes a user turn under the workdir's template and the sample stops at its end of turn."""
  from absl import flags
  folder = run_folder[0]
  template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<|endoftext|>{% endfor %}<assistant>"
  (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
  # The fixture undoes this parse afterwards.
  flags.FLAGS(["generate", f"--workdir={folder}", "--chat", "--prompt=def", "--max_new_tokens=1",
               "--temperature=0", f"--output={folder / 'chat.json'}"])
  generate_script.main([])
  text = json.loads((folder / "chat.json").read_text())["sample_0_text"]
  assert text.startswith("<user>def<assistant>")  # decoded without its special tokens
