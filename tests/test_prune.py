"""Pruning (jaxlm/compress/prune.py): exact target sparsity (global and per layer), valid 2:4 patterns, masks that
survive a fine-tune, int8 on top of pruning keeping the zeros, Wanda's activation-aware scores and masks (GPT-2, Llama,
BERT), SparseGPT's masks and reconstruction (its exact cases, sequential calibration), and the errors for bad input."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx, traverse_util

from jaxlm.compress import prune, quantization
from jaxlm.config import ModelConfig, TrainConfig
from jaxlm.models.bert import BertForSequenceClassification
from jaxlm.models.gpt import GPT
from jaxlm.training import optim
from jaxlm.training import steps as steps_lib

CONFIG = ModelConfig(vocab_size=64, num_layers=2, d_model=32, num_heads=4, max_seq_len=16, compute_dtype="float32",
                     init_std=0.1)
_MODELS = {}
CALIBRATION = [np.random.default_rng(s).integers(0, CONFIG.vocab_size, (4, 16)).astype(np.int32) for s in (1, 2)]


def _model(name="gpt2"):
  if name not in _MODELS:  # initialised in one compiled program, shared by the tests
    make = {"gpt2": lambda: GPT(CONFIG, rngs=nnx.Rngs(0)),
            "llama": lambda: GPT(dataclasses.replace(CONFIG, flavour="llama", num_kv_heads=2, d_ff=48,
                                                     tie_embeddings=False), rngs=nnx.Rngs(0)),
            "bert": lambda: BertForSequenceClassification(dataclasses.replace(CONFIG, flavour="bert"), 3,
                                                          rngs=nnx.Rngs(0))}[name]
    graphdef, _ = nnx.split(nnx.eval_shape(make))
    _MODELS[name] = nnx.merge(graphdef, jax.jit(lambda: nnx.split(make())[1])())
  return _MODELS[name]


def _forward(model, tokens):
  return model(tokens)


def _masked_values(model, masks):
  flat = traverse_util.flatten_dict(nnx.state(model).to_pure_dict())
  return {p: (np.asarray(flat[p]), np.asarray(m)) for p, m in traverse_util.flatten_dict(masks).items()}


@pytest.mark.parametrize("target", [0.5, 0.3])
def test_global_magnitude_pruning_hits_the_target_exactly_and_drops_the_smallest(target):
  model = _model()
  masks = prune.magnitude_masks(model, target)
  values = _masked_values(model, masks)
  total = sum(w.size for w, _ in values.values())
  pruned = sum(int((~m).sum()) for _, m in values.values())
  assert pruned == round(target * total)
  largest_pruned = max(float(np.max(np.where(m, 0, np.abs(w)))) for w, m in values.values())
  smallest_kept = min(float(np.min(np.where(m, np.abs(w), np.inf))) for w, m in values.values())
  assert largest_pruned <= smallest_kept
  pruned_model = prune.apply_masks(model, masks)
  assert prune.sparsity(pruned_model, masks) == pytest.approx(pruned / total, abs=0)
  assert "token_embed" not in masks  # embedding tables are never pruned
  # Global: layers end up with different sparsities (w_o is scaled down at init, so it loses more).
  per_weight = {p: float((~m).mean()) for p, (_, m) in values.items()}
  assert max(per_weight.values()) - min(per_weight.values()) > 0.05


def test_per_layer_pruning_hits_the_target_in_every_layer_of_every_matrix():
  masks = prune.magnitude_masks(_model(), 0.5, per_layer=True)
  for path, (w, m) in _masked_values(_model(), masks).items():
    assert m.shape == w.shape
    for layer in range(CONFIG.num_layers):  # blocks are stacked [L, ...]
      assert int((~m[layer]).sum()) == round(0.5 * m[layer].size), (path, layer)


def test_two_four_pattern_is_valid_along_the_contracted_axis():
  model = _model()
  masks = prune.two_four_masks(model)
  pruned = prune.apply_masks(model, masks)
  values = _masked_values(pruned, masks)
  assert values
  for path, (w, m) in values.items():
    axis = {"w_o": 2}.get(path[-1], 1)  # the innermost contracted axis of a stacked weight
    assert prune.is_n_m(w, axis), path
    groups = np.moveaxis(m, axis, -1).reshape(-1, 4)
    assert bool(np.all(groups.sum(-1) == 2)), path  # exactly 2 of 4 kept: 50% sparsity
    # The kept two are the two largest magnitudes of each group.
    original = _masked_values(model, masks)[path][0]
    mags = np.moveaxis(np.abs(original), axis, -1).reshape(-1, 4)
    kept_min = np.min(np.where(groups, mags, np.inf), -1)
    dropped_max = np.max(np.where(groups, -np.inf, mags), -1)
    assert bool(np.all(kept_min >= dropped_max)), path
  assert not prune.is_n_m(np.ones((8, 4)), 0)
  with pytest.raises(ValueError, match="multiple of 4"):
    prune.n_m_mask(jnp.ones((6, 4)), 0)


def test_masks_survive_fine_tuning_and_int8_keeps_the_zeros():
  model = _model()
  masks = prune.magnitude_masks(model, 0.5)
  graphdef, state = nnx.split(model)
  params = state.to_pure_dict()
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, CONFIG.vocab_size, (3, 4, 17)).astype(np.int32)
  batches = [{"inputs": t[:, :-1], "targets": t[:, 1:], "positions": np.broadcast_to(np.arange(16), (4, 16)),
              "segment_ids": np.ones((4, 16), np.int32), "loss_mask": np.ones((4, 16), np.float32)} for t in tokens]
  loss_fn = steps_lib.make_loss_fn(graphdef)
  tuned = prune.finetune(graphdef, params, masks, loss_fn, batches, learning_rate=1e-2, weight_decay=0.1)
  before = prune.apply_masks(params, masks)
  for path, m in traverse_util.flatten_dict(masks).items():
    old, new = traverse_util.flatten_dict(before)[path], traverse_util.flatten_dict(tuned)[path]
    assert bool(np.all(np.where(m, True, new == 0))), path  # pruned stay exactly zero
    assert float(np.mean(np.where(m, new != old, False)) / np.mean(m)) > 0.9, path  # the rest trained
  assert prune.sparsity(tuned, masks) == pytest.approx(0.5, abs=1e-6)
  # A given optimizer replaces the plain AdamW (optimize.py's --prune_finetune_like_run): a zero rate moves nothing.
  frozen = prune.finetune(graphdef, params, masks, loss_fn, batches[:1], optimizer=optax.sgd(0.0))
  jax.tree.map(np.testing.assert_array_equal, frozen, before)
  # A soup of fine-tunes in two batch orders: their element-wise mean (by hand in float64), zeros kept exactly.
  other = prune.finetune(graphdef, params, masks, loss_fn, batches[::-1], learning_rate=1e-2, weight_decay=0.1)
  soup = prune.soup([tuned, other])
  jax.tree.map(lambda s, a, b: np.testing.assert_allclose(
      s, (np.asarray(a, np.float64) + np.asarray(b, np.float64)) / 2, rtol=1e-6, atol=1e-7), soup, tuned, other)
  assert prune.sparsity(soup, masks) == pytest.approx(0.5, abs=1e-6)
  assert not np.allclose(traverse_util.flatten_dict(soup)[("blocks", "mlp", "w_in")],
                         traverse_util.flatten_dict(tuned)[("blocks", "mlp", "w_in")])
  jax.tree.map(np.testing.assert_array_equal, prune.soup([tuned]), tuned)
  # finetune_soup: the same fine-tunes with one compiled step, averaged.
  together = prune.finetune_soup(graphdef, params, masks, loss_fn, [batches, batches[::-1]], learning_rate=1e-2,
                                 weight_decay=0.1)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), together, soup)
  # int8 on top of pruning: a zero weight quantizes to exactly zero.
  tuned_state = jax.tree.map(lambda x: x, state)
  nnx.replace_by_pure_dict(tuned_state, tuned)
  tuned_model = nnx.merge(graphdef, tuned_state)
  qmodel = quantization.quantize(tuned_model, "weight_only")
  qflat = dict(nnx.to_flat_state(nnx.state(qmodel)))
  for path, m in traverse_util.flatten_dict(masks).items():
    assert bool(np.all(np.where(m, True, qflat[path].get_value().q.qvalue == 0))), path


def test_wanda_scores_are_weight_magnitude_times_input_norm_by_hand():
  model = _model()
  masks = prune.wanda_masks(model, 0.5, CALIBRATION, _forward)
  # The first layer's query projection reads LayerNorm(embeddings): its input, norms, scores and mask by hand.
  block_def, block_state = nnx.split(model.blocks)
  layer0 = nnx.merge(block_def, jax.tree.map(lambda v: v[0], block_state))
  positions = np.broadcast_to(np.arange(16), (4, 16))
  inputs = np.concatenate([np.asarray(layer0.attn_norm(model._embed(jnp.asarray(t), positions))).reshape(-1, 32)
                           for t in CALIBRATION])  # [every token, D]
  norms = np.sqrt(np.sum(inputs.astype(np.float64) ** 2, axis=0))  # ||X_j|| over all calibration tokens
  w = np.asarray(nnx.state(model).to_pure_dict()["blocks"]["attn"]["w_q"][0])  # [D, H, K]
  scores = np.abs(w) * norms[:, None, None]
  np.testing.assert_allclose(prune.wanda_scores(jnp.asarray(w)[None], norms[None], (1,))[0], scores, rtol=1e-5)
  # Each output (h, k) keeps its 16 highest-scoring of 32 inputs.
  rows = scores.reshape(32, -1).T  # [outputs, inputs]
  expected = np.zeros_like(rows, bool)
  np.put_along_axis(expected, np.argsort(rows, axis=1)[:, 16:], True, axis=1)
  np.testing.assert_array_equal(np.asarray(masks["blocks"]["attn"]["w_q"][0]).reshape(32, -1).T, expected)
  # Not magnitude pruning in disguise: the input norms change which weights go.
  assert not np.array_equal(expected, prune.row_mask(np.abs(w), (0,), 16).reshape(32, -1).T)


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_wanda_masks_prune_each_output_row_to_the_target_and_keep_the_two_four_pattern(name):
  model = _model(name)
  weights = prune.prunable(model)
  assert all("blocks" in path for path in weights)  # embeddings and heads (BERT's classifier) stay dense
  for sparsity in (0.5, 0.25):
    masks = traverse_util.flatten_dict(prune.wanda_masks(model, sparsity, CALIBRATION, _forward))
    assert set(masks) == set(weights)
    for path, (w, contracted) in weights.items():
      m = np.asarray(masks[path])
      outputs = [a for a in range(m.ndim) if a not in contracted]
      rows = np.moveaxis(m, outputs, range(len(outputs))).reshape(int(np.prod([m.shape[a] for a in outputs])), -1)
      assert bool(np.all((~rows).sum(axis=1) == round(sparsity * rows.shape[1]))), (path, sparsity)
  masks = prune.wanda_masks(model, 0.5, CALIBRATION, _forward, pattern="2:4")
  pruned = prune.apply_masks(model, masks)
  for path, (w, m) in _masked_values(pruned, masks).items():
    axis = max(weights[path][1])
    assert prune.is_n_m(w, axis), path
    assert bool(np.all(np.moveaxis(m, axis, -1).reshape(-1, 4).sum(-1) == 2)), path


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_attention_ratio_moves_sparsity_from_the_mlp_to_attention_and_keeps_the_total(name):
  model = _model(name)
  weights = prune.prunable(model)
  rates = prune.allocation(model, 0.5, attention_ratio=1.2)
  assert {rates[p] for p in weights if p[-1] in prune.ATTENTION} == {0.6}
  total = sum(w.size for w, _ in weights.values())
  assert sum(rates[p] * w.size for p, (w, _) in weights.items()) == pytest.approx(0.5 * total)
  assert set(prune.allocation(model, 0.5).values()) == {0.5}
  _, sparsegpt_masks = prune.sparsegpt(model, 0.5, CALIBRATION, _forward, attention_ratio=1.2)
  per_row = [sparsegpt_masks, prune.wanda_masks(model, 0.5, CALIBRATION, _forward, attention_ratio=1.2)]
  per_matrix = prune.magnitude_masks(model, 0.5, per_layer=True, attention_ratio=1.2)
  for masks in per_row + [per_matrix]:
    for path, (w, contracted) in weights.items():
      m = np.asarray(traverse_util.flatten_dict(masks)[path])
      outputs = [a for a in range(m.ndim) if a not in contracted]
      rows = np.moveaxis(m, outputs, range(len(outputs))).reshape(int(np.prod([m.shape[a] for a in outputs])), -1)
      if masks is per_matrix:  # each layer's matrix to its rate, rounded once
        assert bool(np.all((~m).reshape(m.shape[0], -1).sum(1) == round(rates[path] * m[0].size))), path
      else:  # each output row to its rate
        assert bool(np.all((~rows).sum(axis=1) == round(rates[path] * rows.shape[1]))), path
  with pytest.raises(ValueError, match="attention ratio 2.5 at sparsity 0.5 gives attention 1.250"):
    prune.allocation(model, 0.5, attention_ratio=2.5)
  with pytest.raises(ValueError, match="attention ratio 1.2 applies to unstructured pruning only"):
    prune.sparsegpt(model, 0.5, CALIBRATION, _forward, pattern="2:4", attention_ratio=1.2)


def test_bad_pruning_input_is_refused():
  model = _model()
  for sparsity in (1.0, -0.1):
    with pytest.raises(ValueError, match=f"sparsity {sparsity} is out of range: it must be in \\[0, 1\\)"):
      prune.wanda_masks(model, sparsity, CALIBRATION, _forward)
    with pytest.raises(ValueError, match=f"sparsity {sparsity} is out of range"):
      prune.magnitude_masks(model, sparsity)
  with pytest.raises(ValueError, match="pruning pattern '4:8' is not one of unstructured, 2:4"):
    prune.wanda_masks(model, 0.5, CALIBRATION, _forward, pattern="4:8")
  with pytest.raises(ValueError, match="2:4 pruning zeroes exactly half of each row, not sparsity 0.3"):
    prune.wanda_masks(model, 0.3, CALIBRATION, _forward, pattern="2:4")
  with pytest.raises(ValueError, match="the calibration data is empty"):
    prune.wanda_masks(model, 0.5, [], _forward)
  with pytest.raises(ValueError, match="calibration batch 0 holds token id 64, outside the model's vocabulary"):
    prune.wanda_masks(model, 0.5, [np.full((2, 8), 64, np.int32)], _forward)


def _reconstruction_error(w, pruned, gram, contracted):
  """||X W - X W'||^2 summed over outputs, from the Gram matrix of the inputs X."""
  matrix, _ = prune._flat_matrix(np.asarray(w, np.float64), contracted)
  delta = matrix - prune._flat_matrix(np.asarray(pruned, np.float64), contracted)[0]
  return float(np.einsum("io,ij,jo->", delta, gram, delta))


@pytest.mark.parametrize("name", ["gpt2", "llama", "bert"])
def test_sparsegpt_keeps_the_row_sparsity_and_2_4_and_reconstructs_better_than_masks_alone(name):
  from jaxlm.compress import calibration

  model = _model(name)
  weights = prune.prunable(model)
  statistics = calibration.input_statistics(model, CALIBRATION, _forward, gram=True)
  for pattern in ("unstructured", "2:4"):
    # One pass (every layer calibrated on the dense model), so the Gram matrices above are the ones it used.
    pruned_model, masks = prune.sparsegpt(model, 0.5, CALIBRATION, _forward, pattern, sequential=False)
    masks = traverse_util.flatten_dict(masks)
    pruned = traverse_util.flatten_dict(nnx.state(pruned_model).to_pure_dict())
    assert set(masks) == set(weights)
    total = wanda_total = 0.0
    for path, (w, contracted) in weights.items():
      m, p = np.asarray(masks[path]), np.asarray(pruned[path])
      assert bool(np.all(p[~m] == 0)), path  # pruned weights are exactly zero
      outputs = [a for a in range(m.ndim) if a not in contracted]
      rows = np.moveaxis(m, outputs, range(len(outputs))).reshape(int(np.prod([m.shape[a] for a in outputs])), -1)
      assert bool(np.all((~rows).sum(axis=1) == rows.shape[1] // 2)), (path, pattern)
      if pattern == "2:4":
        axis = max(contracted)
        assert prune.is_n_m(p, axis), path
        assert bool(np.all(np.moveaxis(m, axis, -1).reshape(-1, 4).sum(-1) == 2)), path
      stats = statistics["/".join(map(str, path))]
      np.testing.assert_allclose(np.diagonal(stats.gram, axis1=-2, axis2=-1),  # X^T X's diagonal is the sum of squares
                                 stats.sumsq.reshape(stats.sumsq.shape[0], -1), rtol=1e-4)
      gram, scores = stats.gram, prune.wanda_scores(w, np.sqrt(stats.sumsq), contracted)
      wanda = (prune.n_m_mask(jnp.asarray(scores), max(contracted)) if pattern == "2:4"
               else prune.row_mask(scores, contracted, rows.shape[1] // 2))
      assert np.asarray(wanda).sum() == m.sum()  # the same sparsity
      for layer in range(w.shape[0]):
        axes = tuple(a - 1 for a in contracted)
        pick = lambda a: np.asarray(a)[layer]  # noqa: E731
        g = gram[layer]
        ours = _reconstruction_error(pick(w), pick(p), g, axes)
        assert ours < _reconstruction_error(pick(w), np.where(pick(m), pick(w), 0), g, axes), (path, layer)
        total += ours
        wanda_total += _reconstruction_error(pick(w), np.where(pick(wanda), pick(w), 0), g, axes)
    # Over the model; not in every matrix: its mask is chosen greedily, so one matrix in ~40 here does worse.
    assert total < 0.9 * wanda_total, (pattern, total, wanda_total)


def test_sparsegpt_exact_cases_and_bad_input():
  rng = np.random.default_rng(0)
  w = rng.normal(size=(16, 6))
  x = rng.normal(size=(64, 16))
  # Sparsity 0: nothing pruned, nothing changes.
  same, keep = prune.sparsegpt_matrix(w, x.T @ x, 0.0)
  assert bool(keep.all())
  np.testing.assert_array_equal(same, w)
  # Uncorrelated inputs of equal energy (a diagonal Gram matrix): no error to spread, so the mask is plain
  # magnitude per output row and the kept weights stay as they were.
  pruned, keep = prune.sparsegpt_matrix(w, 3.0 * np.eye(16), 0.5, block_size=16)
  np.testing.assert_array_equal(keep, prune.row_mask(np.abs(w), (0,), 8))
  np.testing.assert_array_equal(pruned, np.where(keep, w, 0))
  # A weight exactly representable by half its inputs (the other half copies of them): rebuilt exactly.
  half = rng.normal(size=(64, 8))
  x = np.concatenate([half, half], axis=1)
  pruned, keep = prune.sparsegpt_matrix(w, x.T @ x, 0.5, damping=1e-6)
  np.testing.assert_allclose(x @ pruned, x @ w, atol=1e-3 * np.abs(x @ w).max())
  # An input that was always zero costs nothing: pruned first.
  x = rng.normal(size=(64, 16))
  x[:, 3] = 0
  _, keep = prune.sparsegpt_matrix(w, x.T @ x, 1 / 16)
  assert not keep[3].any() and keep[np.arange(16) != 3].all()
  model = _model()
  with pytest.raises(ValueError, match="sparsity 1.0 is out of range: it must be in \\[0, 1\\)"):
    prune.sparsegpt(model, 1.0, CALIBRATION, _forward)
  with pytest.raises(ValueError, match="2:4 pruning zeroes exactly half of each row, not sparsity 0.3"):
    prune.sparsegpt(model, 0.3, CALIBRATION, _forward, pattern="2:4")
  with pytest.raises(ValueError, match="the calibration data is empty"):
    prune.sparsegpt(model, 0.5, [], _forward)
  with pytest.raises(ValueError, match="the Gram matrix is \\(8, 8\\), the weight has 16 inputs"):
    prune.sparsegpt_matrix(w, np.eye(8), 0.5)


def test_sequential_sparsegpt_calibrates_later_layers_on_the_pruned_ones():
  model = _model("bert")
  one_pass, one_masks = prune.sparsegpt(model, 0.5, CALIBRATION, _forward, sequential=False)
  sequential, masks = prune.sparsegpt(model, 0.5, CALIBRATION, _forward)
  flat = lambda m: traverse_util.flatten_dict(nnx.state(m).to_pure_dict())  # noqa: E731
  a, b = flat(one_pass), flat(sequential)
  path = ("bert", "blocks", "attn", "w_q")
  np.testing.assert_array_equal(np.asarray(a[path][0]), np.asarray(b[path][0]))  # layer 0 sees the same inputs
  assert not np.array_equal(np.asarray(a[path][1]), np.asarray(b[path][1]))  # layer 1 sees pruned layer 0's output
  assert prune.sparsity(sequential, masks) == pytest.approx(0.5, abs=0)


def test_the_masked_finetune_follows_the_runs_schedule_or_holds_its_rate():
  run = TrainConfig(steps=300, learning_rate=5e-5, warmup_steps=-1, warmup_fraction=0.1, min_lr_ratio=0.1,
                    weight_decay=0.01, layer_lr_decay=0.8)
  like_run = optim.follow_up_config(run, 2e-5, 100, "run")
  rate = optim.learning_rate_schedule(like_run)
  assert (like_run.steps, optim.warmup_steps(like_run)) == (100, 10)  # the run's 10% warm-up share
  assert float(rate(0)) == 0.0 and float(rate(10)) == pytest.approx(2e-5) and float(rate(100)) == pytest.approx(2e-6)
  assert (like_run.weight_decay, like_run.layer_lr_decay) == (0.01, 0.8)  # the run's AdamW and layer decay
  constant = optim.learning_rate_schedule(optim.follow_up_config(run, 2e-5, 100, "constant"))
  assert all(float(constant(s)) == pytest.approx(2e-5) for s in (0, 50, 100))
