"""jaxlm.training.metrics agrees with scikit-learn (tests only) on random labels, absent classes and edge cases."""

import numpy as np
import pytest

from jaxlm.training import metrics as metrics_lib

sklearn_metrics = pytest.importorskip("sklearn.metrics", reason="needs the dev extra (scikit-learn)")


@pytest.mark.parametrize("num_classes,size,seed", [(2, 50, 0), (3, 200, 1), (7, 40, 2), (5, 5, 3)])
def test_classification_metrics_match_sklearn(num_classes, size, seed):
  rng = np.random.default_rng(seed)
  labels = rng.integers(0, num_classes, size)
  # Predictions right about half the time, so scores are neither 0 nor 1; a few classes may never occur at all.
  predictions = np.where(rng.random(size) < 0.5, labels, rng.integers(0, num_classes, size))
  ours = metrics_lib.classification_metrics(labels, predictions, num_classes)
  classes = list(range(num_classes))
  assert ours["accuracy"] == pytest.approx(sklearn_metrics.accuracy_score(labels, predictions), abs=1e-12)
  for average in ("macro", "weighted"):
    p, r, f, _ = sklearn_metrics.precision_recall_fscore_support(labels, predictions, labels=classes,
                                                                 average=average, zero_division=0)
    assert ours[f"precision_{average}"] == pytest.approx(p, abs=1e-12)
    assert ours[f"recall_{average}"] == pytest.approx(r, abs=1e-12)
    assert ours[f"f1_{average}"] == pytest.approx(f, abs=1e-12)
  p, r, f, support = sklearn_metrics.precision_recall_fscore_support(labels, predictions, labels=classes,
                                                                     average=None, zero_division=0)
  for c in classes:
    assert (ours[f"precision/{c}"], ours[f"recall/{c}"], ours[f"support/{c}"]) == pytest.approx(
        (p[c], r[c], support[c]))
    assert ours[f"f1/{c}"] == pytest.approx(f[c], abs=1e-12)
  expected = sklearn_metrics.confusion_matrix(labels, predictions, labels=classes)
  np.testing.assert_array_equal(metrics_lib.confusion_matrix(labels, predictions, num_classes), expected)
  assert all(ours[f"confusion/{i}/{j}"] == expected[i, j] for i in classes for j in classes)


def test_a_class_that_never_occurs_counts_zero_in_the_macro_average():
  labels, predictions = np.array([0, 0, 1, 1]), np.array([0, 0, 1, 1])
  metrics = metrics_lib.classification_metrics(labels, predictions, 3, ["a", "b", "c"])
  assert metrics["accuracy"] == 1.0 and metrics["f1/c"] == 0.0
  assert metrics["f1_macro"] == pytest.approx(2 / 3) and metrics["f1_weighted"] == 1.0
  expected = sklearn_metrics.f1_score(labels, predictions, labels=[0, 1, 2], average="macro", zero_division=0)
  assert metrics["f1_macro"] == pytest.approx(expected)


def test_bad_ids_are_one_line_errors():
  with pytest.raises(ValueError, match=r"label 3 is outside the class range 0\.\.2"):
    metrics_lib.classification_metrics(np.array([0, 3]), np.array([0, 1]), 3)
  with pytest.raises(ValueError, match="2 labels but 3 predictions"):
    metrics_lib.confusion_matrix(np.array([0, 1]), np.array([0, 1, 1]), 2)
  with pytest.raises(ValueError, match="integer class ids"):
    metrics_lib.confusion_matrix(np.array([0.0, 1.0]), np.array([0, 1]), 2)


def test_paired_change_is_a_bootstrap_of_both_models_on_the_same_resampled_examples():
  rng = np.random.default_rng(3)
  labels = rng.integers(0, 4, 300)
  reference = np.where(rng.random(300) < 0.7, labels, rng.integers(0, 4, 300))
  predictions = reference.copy()
  changed = rng.choice(300, 12, replace=False)
  predictions[changed] = (predictions[changed] + 1) % 4
  out = metrics_lib.paired_change(labels, reference, predictions, 4, samples=300, seed=5)
  assert out["flips"] == 12
  # The reference: each resample drawn as in paired_change, both models scored by classification_metrics.
  counts = np.random.default_rng(5).multinomial(300, np.full(300, 1 / 300), size=300)
  changes = {"accuracy": [], "f1_macro": []}
  for row in counts:
    index = np.repeat(np.arange(300), row)
    a = metrics_lib.classification_metrics(labels[index], reference[index], 4, per_class=False)
    b = metrics_lib.classification_metrics(labels[index], predictions[index], 4, per_class=False)
    for name in changes:
      changes[name].append(b[name] - a[name])
  for name, values in changes.items():
    low, high = np.percentile(values, [2.5, 97.5])
    np.testing.assert_allclose([out[f"{name}_change_ci95_low"], out[f"{name}_change_ci95_high"]], [low, high],
                               rtol=1e-12, atol=1e-12)
  observed = np.mean(predictions == labels) - np.mean(reference == labels)
  assert out["accuracy_change_ci95_low"] <= observed <= out["accuracy_change_ci95_high"]
  # The same predictions: no flips and an interval of exactly zero.
  same = metrics_lib.paired_change(labels, reference, reference, 4)
  assert same["flips"] == 0 and same["accuracy_change_ci95_low"] == same["f1_macro_change_ci95_high"] == 0.0


def test_is_better_minimises_losses_and_maximises_scores():
  assert metrics_lib.is_better("f1_macro", 0.9, 0.8) and not metrics_lib.is_better("f1_macro", 0.7, 0.8)
  assert metrics_lib.is_better("eval_loss", 0.5, 0.6) and not metrics_lib.is_better("loss", 0.7, 0.6)
  assert metrics_lib.is_better("accuracy", 0.1, None) and not metrics_lib.is_better("accuracy", float("nan"), None)


def test_lm_metrics_on_texts_counts_every_target_once_whatever_the_batch():
  from flax import nnx

  from jaxlm.config import ModelConfig
  from jaxlm.data.tokenizer import train_bpe
  from jaxlm.models.gpt import GPT

  texts = [f"line {i}: the quick brown fox {i * 7} jumps" for i in range(12)]
  tokenizer = train_bpe(texts, 300)
  model = GPT(ModelConfig(vocab_size=300, num_layers=1, d_model=32, num_heads=2, max_seq_len=16,
                          compute_dtype="float32"), rngs=nnx.Rngs(0))
  small, large = (metrics_lib.lm_metrics_on_texts(model, tokenizer, texts, 16, batch_size=b) for b in (3, 8))
  assert small == pytest.approx(large, rel=1e-5)
  # An untrained model is close to uniform over the vocabulary: perplexity near the vocabulary size.
  assert 100 < small["eval_perplexity"] < 1000 and 0 <= small["eval_token_accuracy"] <= 1
  assert small["eval_perplexity"] == pytest.approx(np.exp(small["eval_loss"]))
