"""Fine-tuning a BERT encoder for sequence classification (single texts or text pairs).

The run goes through pretraining's loop, `loop.run_loop` (resume, stop signals, non-finite skipping, metric windows,
eval cadence, checkpoints with the loader position, report.md), and its pieces: the sharded init
(`features_lib.train_state_from_config`) and the jitted steps (`steps_lib.jit_steps` with a classification loss). This
module keeps what is specific to classification (its `loop.Task`):

  init_from   (jaxlm/recipes/init_from.py) an HF checkpoint folder (config.json + safetensors, e.g. all-MiniLM-L6-v2)
              or a jaxlm run workdir (its latest orbax checkpoint); the encoder (and a classification head for the
              same classes) is loaded, anything missing (the head, a pooler) starts from the seeded random init. The
              model's shape comes from the checkpoint; `model.compute_dtype`, `model.param_dtype` and `kernels`
              from the config.
  tokenizer   the checkpoint's own (tokenizer.json or vocab.txt); `data.tokenizer` when init_from is empty.
  eval        every `train.eval_every_steps` and at the end, on every held-out example: accuracy, precision,
              recall, F1 (macro, weighted, per class), confusion matrix (jaxlm/training/metrics.py).
  best model  `<workdir>/best_model/`: an HF folder (config.json with the class names, model.safetensors,
              tokenizer.json, eval.json) of the step with the best `train.best_metric`; transformers loads it and
              `jaxlm.hf.from_pretrained` returns a BertForSequenceClassification.
  eval.json   the final evaluation as flat numbers, plus best_step and best_<metric>, the trainable parameter count
              and the per-device bytes of the trainable params, optimizer state and frozen base
              (jaxlm.adapters.lora.state_bytes).
  LoRA        `lora.rank > 0`: only adapters and the head train (jaxlm/adapters/lora.py); best_model/ holds the merged
              weights, `<workdir>/adapter/` the final adapters as a PEFT folder (jaxlm/interop/peft_folders.py).

Metrics in metrics.jsonl: `loss`, `train_accuracy`, `tokens_per_sec` (real, unpadded tokens), `padded_tokens_per_sec`,
`examples_per_sec`, `mfu` (of the padded tokens), `grad_norm`, `update_norm`, `param_norm`, `learning_rate`,
`skipped_steps`; on eval steps `eval_loss`, `eval_accuracy`, `eval_f1_macro`, ... and `eval_f1/<class>`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import tokenizers
from flax import nnx
from jax.sharding import Mesh

from jaxlm.adapters import lora
from jaxlm.config import Config
from jaxlm.data.tuning import classification as cls_data
from jaxlm.data.tuning import seq_lengths
from jaxlm.interop import hf_weights, peft_folders, streaming
from jaxlm.kernels import Kernels
from jaxlm.models.bert import BertForSequenceClassification
from jaxlm.recipes import data_defaults
from jaxlm.recipes import features as features_lib
from jaxlm.recipes import init_from as pretrained_lib
from jaxlm.recipes.init_from import LABELS_FILE, TOKENIZER_FILE
from jaxlm.training import atomic_files, loop, optim, reliability, telemetry
from jaxlm.training import metrics as metrics_lib
from jaxlm.training import steps as steps_lib
from jaxlm.training.state import TrainState

BEST_MODEL = "best_model"
ADAPTER = "adapter"  # LoRA runs: the final adapters as a PEFT folder


# ----------------------------------------------------------------------------------------------- steps


def make_classification_loss_fn(graphdef: nnx.GraphDef) -> optim.SumLossFn:
  """Sum of per-example cross-entropies weighted by `weights`, the weight sum, and correct predictions."""

  def loss_fn(params, batch):
    logits_BC = nnx.merge(graphdef, params).classify(batch)
    losses_B = optax.softmax_cross_entropy_with_integer_labels(logits_BC, batch["labels"])
    weights_B = batch["weights"]
    correct_B = (jnp.argmax(logits_BC, axis=-1) == batch["labels"]).astype(jnp.float32)
    return (losses_B * weights_B).sum(), (weights_B.sum(), {"correct": (correct_B * weights_B).sum()})

  return loss_fn


def make_eval_step(graphdef: nnx.GraphDef):
  def eval_step(params, batch):
    logits_BC = nnx.merge(graphdef, params).classify(batch)
    losses_B = optax.softmax_cross_entropy_with_integer_labels(logits_BC, batch["labels"])
    return {"loss_sum": (losses_B * batch["weights"]).sum(),
            "predictions": jnp.argmax(logits_BC, axis=-1).astype(jnp.int32)}
  return eval_step


def run_eval(eval_step, params, batches: list[dict], examples: cls_data.Examples, class_names: list[str],
             mesh: Mesh, with_predictions: bool = False) -> dict[str, Any]:
  """Classification metrics over every held-out example (the filler rows of the last batch are dropped);
  `with_predictions` adds the `labels` and `predictions` arrays (in the examples' order)."""
  predictions, loss_sum = [], 0.0
  for batch in batches:
    out = jax.device_get(eval_step(params, steps_lib.to_global_batch(batch, mesh)))
    predictions.append(out["predictions"])
    loss_sum += float(out["loss_sum"])
  order = cls_data.eval_order(examples)
  predicted = np.concatenate(predictions)[: len(order)]
  metrics = metrics_lib.classification_metrics(examples.labels[order], predicted, len(class_names), class_names)
  metrics["loss"] = loss_sum / max(1, len(order))
  if with_predictions:
    metrics.update(labels=examples.labels[order], predictions=predicted)
  return metrics


# ----------------------------------------------------------------------------------------------- the run


def finetune(config: Config, workdir: str, stop_at_step: int | None = None) -> dict:
  """Fine-tunes (or resumes) a classifier into `workdir`; returns the final evaluation (also in eval.json).

  The run goes through `loop.run_loop`, as pretraining does: SIGTERM/SIGINT or `stop_at_step` checkpoint and return
  early (`preempted_at_step`), and re-running with the same workdir resumes."""
  with reliability.StopSignals() as stop:
    started = time.time()
    config, mesh, kernels = loop.prepare_run(config, workdir, causal=False)
    config, task = classification_task(config, workdir, mesh, kernels)
    return loop.run_loop(config, workdir, mesh, task, stop, stop_at_step, started)


def classification_task(config: Config, workdir: str, mesh: Mesh, kernels: Kernels) -> tuple[Config, loop.Task]:
  """The run's config (its model from init_from) and its `loop.Task`: labelled data, the classification loss,
  classification metrics on every eval, the best model kept, eval.json and the per-class report."""
  t, d = config.train, config.data
  if config.distill.teacher:
    raise ValueError("distill.teacher distils decoders (train_lm.py, or finetune.py from a decoder's init_from); a "
                     "classifier distils its pruned copy with optimize.py --prune_distill_files")
  pretrained = pretrained_lib.load_pretrained(config, mesh)
  model_config = pretrained.model_config
  if d.seq_len > model_config.max_seq_len:
    raise ValueError(f"data.seq_len={d.seq_len} exceeds the model's {model_config.max_seq_len} positions; lower "
                     f"data.seq_len (longer texts are cut and counted)")
  data = cls_data.build_classification_data(d, pretrained.tokenizer, t.seed, model_config.vocab_size,
                                            model_config.max_seq_len)
  # The defaults that fit the data (jaxlm/recipes/data_defaults.py): steps from train.epochs, seq_len from the tokenized
  # lengths.
  derived_steps, chosen_seq_len = t.steps == 0, d.seq_len == 0
  t = data_defaults.resolve_learning_rate(t, config.lora.rank)
  t, d = data_defaults.resolve_steps(t, len(data.train)), dataclasses.replace(d, seq_len=data.seq_len)
  config = dataclasses.replace(config, model=model_config, train=t, data=d)
  class_names = data.class_names
  known_metrics = [*metrics_lib.classification_metrics(np.zeros(1, np.int64), np.zeros(1, np.int64), len(class_names),
                                                     class_names), "loss"]
  if t.best_metric not in known_metrics:
    raise ValueError(f"train.best_metric={t.best_metric!r} is not an eval metric; use one of "
                     f"{', '.join(k for k in known_metrics if '/' not in k)} or f1/<class>")
  _check_labels_file(workdir, class_names)
  stats_line = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in data.stats.items())
  data_defaults.print_on_process_0(seq_lengths.truncation_warning(data.stats["truncated_examples"],
                                                                  len(data.train) + len(data.eval), d.seq_len,
                                                                  model_config.max_seq_len, chosen_seq_len))
  data_defaults.print_on_process_0(data_defaults.describe_steps(t, len(data.train), derived=derived_steps))
  if jax.process_index() == 0:
    print(f"data: {stats_line}", flush=True)
    path = os.path.join(workdir, TOKENIZER_FILE)  # init_from=<this workdir> needs it whole
    atomic_files.write_text(path, pretrained.tokenizer.to_str(pretty=True))

  num_labels = len(class_names)
  optimizer = optim.make_optimizer(t)
  make_model = lambda rngs: BertForSequenceClassification(model_config, num_labels, kernels=kernels, rngs=rngs)
  graphdef, state, state_shardings, features = features_lib.train_state_from_config(
      config, mesh, optimizer, make_model, language_model_loss=False)
  train_step, eval_step = steps_lib.jit_steps(graphdef, optimizer, config, mesh, state_shardings, features,
                                              loss_fn=make_classification_loss_fn(graphdef),
                                              eval_fn=make_eval_step(graphdef))
  eval_batches = cls_data.eval_batches(data.eval, t.batch_size, d.seq_len, d.batching)
  best = _read_best(workdir, t.best_metric)  # (step, value) of best_model/, kept across resumes
  latest: dict[str, float] = {}  # the latest evaluation, every metric

  def start(state: TrainState, start_step: int) -> TrainState:
    if start_step == 0 and pretrained.params is not None:
      # The checkpoint's head is kept only for the same classes in the same order (or HF's anonymous LABEL_i names).
      saved_names = pretrained.class_names
      head_fits = saved_names is not None and (saved_names == class_names or (
          len(saved_names) == num_labels and saved_names == [f"LABEL_{i}" for i in range(num_labels)]))
      # Another head: its task layers start afresh; the encoder (and ModernBERT's transform) are kept.
      params = pretrained.params if head_fits else {k: v for k, v in pretrained.params.items()
                                                     if f"{k}/" not in lora.HEAD_PREFIXES}
      if "frozen" in state:  # LoRA: the checkpoint becomes the frozen base (jaxlm/adapters/lora.py);
                             # adapters start fresh
        state, kept_random = streaming.load_base(state, state_shardings, config.lora, make_model, mesh, params,
                                               config.init_from, t.seed, strict=False)  # one leaf at a time
      else:
        state["params"], kept_random = pretrained_lib.merge_pretrained(state["params"], params,
                                                                       state_shardings["params"], config.init_from)
      if jax.process_index() == 0:
        fresh = sorted({"/".join(p.split("/")[:2]) for p in kept_random}) or ["nothing"]
        print(f"init_from {config.init_from}: loaded; random init for {', '.join(fresh)}", flush=True)
    pretrained.params = None  # a resumed run never needs them
    return state

  def count(local: dict) -> dict[str, float]:
    """Real (unpadded) and padded tokens of the global batch, its examples, and the FLOPs of the padded tokens: the
    encoder's on every token, the head's on the pooled one (no vocabulary matmul; LoRA: no frozen weight gradients)."""
    mask, processes = local["attention_mask"], jax.process_count()
    flops_per_token = telemetry.flops_per_token(model_config, mask.shape[1], num_labels=num_labels, lora=config.lora)
    return {"tokens": int(mask.sum()) * processes, "padded_tokens": mask.size * processes, "examples": t.batch_size,
            "flops": mask.size * processes * flops_per_token}

  def evaluate_step(step: int, params) -> dict[str, float]:
    nonlocal best
    latest.clear()
    latest.update(run_eval(eval_step, params, eval_batches, data.eval, class_names, mesh))
    value = latest[t.best_metric]
    if metrics_lib.is_better(t.best_metric, value, best[1]):
      best = (step, value)
      _save_best(workdir, graphdef, params, class_names, pretrained.tokenizer,  # LoRA: merged weight by weight
                 {"step": step, t.best_metric: value, **latest})
    return {f"eval_{k}": v for k, v in latest.items()
            if not k.startswith(("confusion/", "support/", "precision/", "recall/"))}

  def finish(end: loop.RunEnd) -> loop.Report:
    result: dict[str, Any] = dict(latest)
    result["eval_loss"] = result.pop("loss")
    result.update({
        "step": t.steps, "best_metric": t.best_metric, f"best_{t.best_metric}": best[1], "best_step": best[0],
        "train_examples": len(data.train), "eval_examples": len(data.eval), "num_classes": num_labels,
        "labels": ",".join(class_names), "final_train_loss": end.last.get("loss"),
        "wall_time_sec": end.facts["wall_time_sec"], "devices": jax.device_count(), "init_from": config.init_from,
    })
    result.update({k: v for k, v in end.rates.items() if k.endswith("_per_sec")})  # real, padded tokens; examples
    result.update(lora.state_bytes(end.state))  # per device: trainable params, optimizer state, frozen base
    if config.lora.rank:  # the adapters as a PEFT folder (peft.PeftModel.from_pretrained loads it onto the base)
      result.update(lora_rank=config.lora.rank, lora_alpha=config.lora.alpha, lora_targets=config.lora.targets,
                    lora_base=config.lora.base)
      peft_folders.save_adapters(nnx.merge(graphdef, features.model_params(end.state)), os.path.join(workdir, ADAPTER),
                            base_model_name_or_path=config.init_from)
    atomic_files.write_json_on_process_0(os.path.join(workdir, "eval.json"), result)
    summary = {k: v for k, v in result.items() if "/" not in k}
    summary.update({k: end.facts[k] for k in ("peak_flops_per_device", "peak_flops_source")})
    confusion = np.array([[latest[f"confusion/{a}/{b}"] for b in class_names] for a in class_names])
    per_class = "\n".join(["| class | precision | recall | f1 | support |", "| --- | --- | --- | --- | --- |"] + [
        f"| {c} | {latest[f'precision/{c}']:.4f} | {latest[f'recall/{c}']:.4f} | {latest[f'f1/{c}']:.4f} | "
        f"{int(latest[f'support/{c}'])} |" for c in class_names])
    return loop.Report(summary, result=result, data_stats=data.stats, sections=[
        ("Per class (final eval)", per_class),
        ("Confusion matrix (final eval; rows: true class)", metrics_lib.confusion_table(confusion, class_names))])

  return config, loop.Task(
      title="Fine-tuning run", state=state, state_shardings=state_shardings, train_step=train_step,
      batches=cls_data.ClassificationLoader(data.train, t.batch_size, t.seed, d.batching, d.seq_len, d.shuffle),
      count=count, evaluate=evaluate_step, finish=finish, start=start,
      renames={"token_accuracy": "train_accuracy", "tokens": "examples"}, features=features)


# ----------------------------------------------------------------------------------------------- workdir files


def _check_labels_file(workdir: str, class_names: list[str]) -> None:
  """labels.json pins the class order of a run: a resumed run whose data gives other classes fails clearly."""
  path = os.path.join(workdir, LABELS_FILE)
  if os.path.isfile(path):
    with open(path) as f:
      saved = json.load(f)
    if saved != class_names and os.path.isdir(os.path.join(workdir, "checkpoints")):
      raise ValueError(f"{path} holds classes {saved[:10]} but the data now gives {class_names[:10]}; use another "
                       f"--workdir or set data.labels to the saved classes")
  atomic_files.write_json_on_process_0(path, class_names)


def _read_best(workdir: str, metric: str) -> tuple[int | None, float | None]:
  path = os.path.join(workdir, BEST_MODEL, "eval.json")
  if not os.path.isfile(path):
    return None, None
  with open(path) as f:
    saved = json.load(f)
  return (saved.get("step"), saved.get(metric)) if metric in saved else (None, None)


def _save_best(workdir: str, graphdef, params, class_names: list[str], tokenizer: tokenizers.Tokenizer,
               metrics: dict) -> None:
  """Writes the HF folder into best_model.tmp and swaps it in, so a kill never leaves a half-written best model."""
  folder = os.path.join(workdir, BEST_MODEL)
  temp = folder + ".tmp"
  if jax.process_index() == 0 and os.path.isdir(temp):
    shutil.rmtree(temp)
  hf_weights.save_pretrained(nnx.merge(graphdef, params), temp)  # every process joins the gather; process 0 writes
  if jax.process_index() != 0:
    return
  config_path = os.path.join(temp, "config.json")
  with open(config_path) as f:
    hf_config = json.load(f)
  hf_config["id2label"] = {str(i): name for i, name in enumerate(class_names)}
  hf_config["label2id"] = {name: i for i, name in enumerate(class_names)}
  with open(config_path, "w") as f:
    json.dump(hf_config, f, indent=2)
  tokenizer.save(os.path.join(temp, TOKENIZER_FILE))
  with open(os.path.join(temp, "eval.json"), "w") as f:
    json.dump({k: v for k, v in metrics.items()}, f, indent=2)
  # Never a moment without a best model on disk: the old one is moved aside, the new one moved in, then the old
  # one deleted (a kill in between leaves <folder>.old and the new folder, or the old folder and the temp one).
  old = folder + ".old"
  if os.path.isdir(old):
    shutil.rmtree(old)
  if os.path.isdir(folder):
    os.replace(folder, old)
  os.replace(temp, folder)
  shutil.rmtree(old, ignore_errors=True)
