"""Evaluation metrics: classification (accuracy, precision/recall/F1, confusion matrix) and language modelling
(perplexity, token accuracy on held-out text).

Classification metrics are plain numpy over integer class ids and match scikit-learn's
`precision_recall_fscore_support(..., labels=range(K), zero_division=0)` (tested against it): every one of the K
classes counts in the macro average, also one that never occurs; a 0/0 precision, recall or F1 is 0. F1 per class is
2 tp / (2 tp + fp + fn), and the macro F1 is the mean of the per-class F1 scores (not the F1 of the macro precision
and recall). Weighted averages weight each class by its support (true count).

  metrics = classification_metrics(labels, predictions, num_classes=3, class_names=["neg", "neu", "pos"])
  metrics["accuracy"], metrics["f1_macro"], metrics["f1/neg"], metrics["confusion/neg/pos"]
  change = paired_change(labels, predictions_a, predictions_b, num_classes=3)  # flips, 95% interval of the change

Every result is a flat dict of floats, ready for metrics.jsonl, TensorBoard and eval.json.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# Metrics where lower is better; every other metric name is maximised when choosing the best checkpoint.
LOWER_IS_BETTER_SUFFIXES = ("loss", "perplexity")


def confusion_matrix(labels: np.ndarray, predictions: np.ndarray, num_classes: int) -> np.ndarray:
  """[K, K] int64 counts; row = true class, column = predicted class (scikit-learn's layout)."""
  labels, predictions = _check_ids(labels, predictions, num_classes)
  counts = np.zeros((num_classes, num_classes), np.int64)
  np.add.at(counts, (labels, predictions), 1)
  return counts


def per_class_scores(confusion_KK: np.ndarray) -> dict[str, np.ndarray]:
  """precision, recall, f1 and support [K] from a confusion matrix; 0/0 gives 0."""
  tp = np.diag(confusion_KK).astype(np.float64)
  predicted = confusion_KK.sum(axis=0).astype(np.float64)  # tp + fp
  support = confusion_KK.sum(axis=1).astype(np.float64)  # tp + fn
  return {
      "precision": _safe_divide(tp, predicted),
      "recall": _safe_divide(tp, support),
      "f1": _safe_divide(2 * tp, predicted + support),
      "support": support,
  }


def classification_metrics(labels: np.ndarray, predictions: np.ndarray, num_classes: int,
                           class_names: Sequence[str] | None = None, per_class: bool = True) -> dict[str, float]:
  """accuracy, {precision,recall,f1}_{macro,weighted}, examples; with `per_class`, also `{precision,recall,f1,
  support}/<class>` and `confusion/<true>/<predicted>` counts."""
  names = [str(n) for n in class_names] if class_names is not None else [str(i) for i in range(num_classes)]
  if len(names) != num_classes:
    raise ValueError(f"{len(names)} class names for num_classes={num_classes}")
  confusion = confusion_matrix(labels, predictions, num_classes)
  scores = per_class_scores(confusion)
  total = confusion.sum()
  out = {"examples": float(total), "accuracy": float(np.trace(confusion) / total) if total else 0.0}
  weights = scores["support"] / total if total else np.zeros(num_classes)
  for name in ("precision", "recall", "f1"):
    out[f"{name}_macro"] = float(scores[name].mean())
    out[f"{name}_weighted"] = float((scores[name] * weights).sum())
  if per_class:
    for name in ("precision", "recall", "f1", "support"):
      out.update({f"{name}/{c}": float(v) for c, v in zip(names, scores[name])})
    out.update({f"confusion/{t}/{p}": float(confusion[i, j])
                for i, t in enumerate(names) for j, p in enumerate(names)})
  return out


def paired_change(labels: np.ndarray, reference: np.ndarray, predictions: np.ndarray, num_classes: int,
                  samples: int = 2000, seed: int = 0) -> dict[str, float]:
  """How far `predictions` are from `reference` predictions of the same examples: `flips` (examples predicted
  differently) and 95% paired-bootstrap intervals of the accuracy and macro-F1 change (fractions; both models scored
  on the same resampled examples, so the interval is the change's own noise, not each model's).

  Ours, in numpy: one draw of example counts per resample scores both models at once (scipy's bootstrap would
  resample an index array per statistic call)."""
  labels, reference = _check_ids(labels, reference, num_classes)
  _, predictions = _check_ids(labels, predictions, num_classes)
  n = labels.size
  counts = np.random.default_rng(seed).multinomial(n, np.full(n, 1.0 / n), size=samples).astype(np.float64)
  one_hot = np.eye(num_classes)
  support = counts @ one_hot[labels]  # [S, K] true count per class in each resample

  def scores(pred):
    tp = counts @ (one_hot[labels] * (labels == pred)[:, None])
    f1 = _safe_divide(2 * tp, counts @ one_hot[pred] + support)
    return tp.sum(axis=1) / n, f1.mean(axis=1)

  (acc_ref, f1_ref), (acc, f1) = scores(reference), scores(predictions)
  out = {"flips": float(np.sum(reference != predictions))}
  for name, change in (("accuracy", acc - acc_ref), ("f1_macro", f1 - f1_ref)):
    out[f"{name}_change_ci95_low"], out[f"{name}_change_ci95_high"] = map(float, np.percentile(change, [2.5, 97.5]))
  return out


def confusion_table(confusion_KK: np.ndarray, class_names: Sequence[str]) -> str:
  """The confusion matrix as a markdown table (rows: true class, columns: predicted)."""
  names = [str(n).replace("|", "\\|") for n in class_names]
  lines = ["| true \\ predicted | " + " | ".join(names) + " |", "| --- |" + " --- |" * len(names)]
  lines += [f"| {t} | " + " | ".join(str(int(v)) for v in row) + " |" for t, row in zip(names, confusion_KK)]
  return "\n".join(lines)


def is_better(metric: str, value: float, best: float | None) -> bool:
  """Whether `value` improves on `best` for `metric` (lower is better for losses and perplexities)."""
  if best is None or not np.isfinite(best):
    return bool(np.isfinite(value))
  lower = metric.endswith(LOWER_IS_BETTER_SUFFIXES)
  return bool(value < best) if lower else bool(value > best)


# ----------------------------------------------------------------------------------------------- language models


def lm_metrics(loss_sum: float, tokens: float, correct: float) -> dict[str, float]:
  """eval_loss (mean nats per target token), eval_perplexity = exp(loss) (capped at exp(50) so a diverged run logs
  a number), eval_token_accuracy (argmax == target) from summed token losses, target count and correct count."""
  tokens = max(float(tokens), 1.0)
  loss = float(loss_sum) / tokens
  return {"eval_loss": loss, "eval_perplexity": float(np.exp(min(loss, 50.0))),
          "eval_token_accuracy": float(correct) / tokens}


def lm_metrics_on_texts(model, tokenizer, texts: Sequence[str], seq_len: int, batch_size: int = 8) -> dict[str, float]:
  """Perplexity and token accuracy of a decoder (`jaxlm.models.gpt.GPT`) on held-out `texts`.

  The texts are tokenized and packed as in training (EOS after each document, no target across a document
  boundary); every target is counted once, so the result does not depend on `batch_size`.
  """
  import jax  # noqa: PLC0415 (the classification metrics above need no jax)
  import optax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from jaxlm.data.packing import pack  # noqa: PLC0415
  from jaxlm.data.tokenizer import eos_id  # noqa: PLC0415

  texts = [t for t in texts if isinstance(t, str) and t.strip()]
  if not texts:
    raise ValueError("lm_metrics_on_texts got no non-empty texts")
  packed = pack(tokenizer, texts, seq_len, eos_id(tokenizer))
  graphdef, params = nnx.split(model)

  @jax.jit
  def sums(params, batch):
    logits_BTV = nnx.merge(graphdef, params)(batch["inputs"], batch["positions"], batch["segment_ids"])
    mask_BT = batch["loss_mask"]
    losses_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch["targets"])
    correct_BT = (logits_BTV.argmax(-1) == batch["targets"]).astype(mask_BT.dtype)
    return (losses_BT * mask_BT).sum(), mask_BT.sum(), (correct_BT * mask_BT).sum()

  totals = np.zeros(3)
  for start in range(0, len(packed), batch_size):
    rows = np.arange(start, start + batch_size) % len(packed)  # a full last batch keeps one compiled shape
    batch = packed.batch(rows)
    weight = (np.arange(start, start + batch_size) < len(packed)).astype(np.float32)  # wrapped rows count 0
    batch["loss_mask"] = batch["loss_mask"] * weight[:, None]
    totals += np.array([float(x) for x in sums(params, batch)])
  return lm_metrics(*totals)


# ----------------------------------------------------------------------------------------------- helpers


def _safe_divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
  return np.divide(numerator, denominator, out=np.zeros_like(numerator, dtype=np.float64), where=denominator > 0)


def _check_ids(labels, predictions, num_classes: int) -> tuple[np.ndarray, np.ndarray]:
  labels, predictions = np.asarray(labels).reshape(-1), np.asarray(predictions).reshape(-1)
  if labels.shape != predictions.shape:
    raise ValueError(f"{labels.size} labels but {predictions.size} predictions")
  for name, ids in (("label", labels), ("prediction", predictions)):
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
      raise ValueError(f"{name}s must be integer class ids, got dtype {ids.dtype}")
    if ids.size and (ids.min() < 0 or ids.max() >= num_classes):
      bad = ids[(ids < 0) | (ids >= num_classes)][0]
      raise ValueError(f"{name} {bad} is outside the class range 0..{num_classes - 1}")
  return labels.astype(np.int64), predictions.astype(np.int64)
