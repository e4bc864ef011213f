"""Fine-tuning a BERT encoder for sequence classification (single texts or text pairs).

The run reuses pre-training's pieces: the mesh and sharded init (`train.init_train_state`), the optimizer and exact
gradient accumulation (`train.make_train_step` with a classification loss), orbax checkpoints with the loader
position (`Checkpointer`), NaN skipping and stop signals (`reliability`) and the metrics writer. What it adds:

  init_from   (jaxlm/pretrained.py) an HF checkpoint folder (config.json + safetensors, e.g. all-MiniLM-L6-v2)
              or a jaxlm run workdir (its latest orbax checkpoint); the encoder (and a classification head for the
              same classes) is loaded, anything missing (the head, a pooler) starts from the seeded random init. The
              model's shape comes from the checkpoint; `model.compute_dtype`, `model.param_dtype` and `model.remat`
              from the config.
  tokenizer   the checkpoint's own (tokenizer.json or vocab.txt); `data.tokenizer` when init_from is empty.
  eval        every `train.eval_every_steps` and at the end, on every held-out example: accuracy, precision,
              recall, F1 (macro, weighted, per class), confusion matrix (jaxlm/evaluate.py).
  best model  `<workdir>/best_model/`: an HF folder (config.json with the class names, model.safetensors,
              tokenizer.json, eval.json) of the step with the best `train.best_metric`; transformers loads it and
              `jaxlm.hf.from_pretrained` returns a BertForSequenceClassification.
  eval.json   the final evaluation as flat numbers, plus best_step and best_<metric>.

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

from jaxlm import evaluate, files, hf, optim, reliability, sharding, telemetry, train
from jaxlm import pretrained as pretrained_lib
from jaxlm.checkpoint import Checkpointer, abstract_with_shardings
from jaxlm.config import Config
from jaxlm.data import classification as cls_data
from jaxlm.models.bert import BertForSequenceClassification
from jaxlm.pretrained import LABELS_FILE, TOKENIZER_FILE

BEST_MODEL = "best_model"


# ----------------------------------------------------------------------------------------------- steps


def make_classification_loss_fn(graphdef: nnx.GraphDef) -> optim.SumLossFn:
  """Sum of per-example cross-entropies weighted by `weights`, the weight sum, and correct predictions."""

  def loss_fn(params, batch):
    logits_BC = nnx.merge(graphdef, params)(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    losses_B = optax.softmax_cross_entropy_with_integer_labels(logits_BC, batch["labels"])
    weights_B = batch["weights"]
    correct_B = (jnp.argmax(logits_BC, axis=-1) == batch["labels"]).astype(jnp.float32)
    return (losses_B * weights_B).sum(), (weights_B.sum(), {"correct": (correct_B * weights_B).sum()})

  return loss_fn


def make_eval_step(graphdef: nnx.GraphDef):
  def eval_step(params, batch):
    logits_BC = nnx.merge(graphdef, params)(batch["input_ids"], batch["attention_mask"], batch["token_type_ids"])
    losses_B = optax.softmax_cross_entropy_with_integer_labels(logits_BC, batch["labels"])
    return {"loss_sum": (losses_B * batch["weights"]).sum(),
            "predictions": jnp.argmax(logits_BC, axis=-1).astype(jnp.int32)}
  return eval_step


def _batch_shardings(mesh: Mesh) -> dict:
  two_d = sharding.batch_sharding(mesh, 2)
  one_d = sharding.batch_sharding(mesh, 1)
  return {"input_ids": two_d, "attention_mask": two_d, "token_type_ids": two_d, "labels": one_d, "weights": one_d}


def run_eval(eval_step, params, batches: list[dict], examples: cls_data.Examples, class_names: list[str],
             mesh: Mesh) -> dict[str, float]:
  """Classification metrics over every held-out example (the filler rows of the last batch are dropped)."""
  predictions, loss_sum = [], 0.0
  for batch in batches:
    out = jax.device_get(eval_step(params, train.to_global_batch(batch, mesh)))
    predictions.append(out["predictions"])
    loss_sum += float(out["loss_sum"])
  order = cls_data.eval_order(examples)
  predicted = np.concatenate(predictions)[: len(order)]
  metrics = evaluate.classification_metrics(examples.labels[order], predicted, len(class_names), class_names)
  metrics["loss"] = loss_sum / max(1, len(order))
  return metrics


# ----------------------------------------------------------------------------------------------- the loop


def finetune(config: Config, workdir: str, stop_at_step: int | None = None) -> dict:
  """Fine-tunes (or resumes) a classifier into `workdir`; returns the final evaluation (also in eval.json).

  As in `train.train`: SIGTERM/SIGINT or `stop_at_step` checkpoint and return early (`preempted_at_step`), and
  re-running with the same workdir resumes."""
  with reliability.StopSignals() as stop:
    return _finetune(config, workdir, stop_at_step, stop)


def _finetune(config: Config, workdir: str, stop_at_step: int | None, stop: reliability.StopSignals) -> dict:
  started = time.time()
  mesh = train.prepare_run(config, workdir)
  t, d = config.train, config.data

  pretrained = pretrained_lib.load_pretrained(config, mesh)
  model_config = pretrained.model_config
  if d.seq_len > model_config.max_seq_len:
    raise ValueError(f"data.seq_len={d.seq_len} exceeds the model's {model_config.max_seq_len} positions; lower "
                     f"data.seq_len (longer texts are cut and counted)")
  config = dataclasses.replace(config, model=model_config)
  data = cls_data.build_classification_data(d, pretrained.tokenizer, t.seed,
                                            os.path.join(workdir, "data_cache", "hf"), model_config.vocab_size)
  class_names = data.class_names
  known_metrics = [*evaluate.classification_metrics(np.zeros(1, np.int64), np.zeros(1, np.int64), len(class_names),
                                                     class_names), "loss"]
  if t.best_metric not in known_metrics:
    raise ValueError(f"train.best_metric={t.best_metric!r} is not an eval metric; use one of "
                     f"{', '.join(k for k in known_metrics if '/' not in k)} or f1/<class>")
  _check_labels_file(workdir, class_names)
  stats_line = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in data.stats.items())
  if jax.process_index() == 0:
    print(f"data: {stats_line}", flush=True)

  num_labels = len(class_names)
  optimizer = optim.make_optimizer(t)
  make_model = lambda rngs: BertForSequenceClassification(model_config, num_labels, rngs=rngs)
  graphdef, state, state_shardings = train.init_train_state(config, mesh, optimizer, make_model)
  batch_shardings = _batch_shardings(mesh)
  schedule = optim.learning_rate_schedule(t)
  # Traced under the mesh (and its rule overrides) like train.jit_steps, so the models' constraints and FSDP
  # weight gathering apply.
  overrides = sharding.rule_overrides(config.mesh)
  train_step = jax.jit(
      sharding.traced_on(mesh, train.make_train_step(graphdef, optimizer, t.grad_accum, schedule, mesh,
                                                     config.mesh.gradient_sync,
                                                     loss_fn=make_classification_loss_fn(graphdef)), overrides),
      in_shardings=(state_shardings, batch_shardings),
      out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=0)
  eval_step = jax.jit(sharding.traced_on(mesh, make_eval_step(graphdef), overrides),
                      in_shardings=(state_shardings["params"], batch_shardings),
                      out_shardings=sharding.replicated(mesh))

  loader = cls_data.ClassificationLoader(data.train, t.batch_size, t.seed, d.batching, d.seq_len, d.shuffle)
  eval_batches = cls_data.eval_batches(data.eval, t.batch_size, d.seq_len, d.batching)

  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), config.checkpoint.every_steps,
                              config.checkpoint.keep)
  restored = checkpointer.restore_latest(abstract_with_shardings(state, state_shardings), model_config)
  start_step = 0
  if restored is not None:
    start_step, state, data_state = restored
    loader.set_state(data_state)
  elif pretrained.params is not None:
    # The checkpoint's head is kept only for the same classes in the same order (or HF's anonymous LABEL_i names).
    saved_names = pretrained.class_names
    head_fits = saved_names is not None and (saved_names == class_names or (
        len(saved_names) == num_labels and saved_names == [f"LABEL_{i}" for i in range(num_labels)]))
    params = pretrained.params if head_fits else {"bert": pretrained.params["bert"]}
    state["params"], kept_random = pretrained_lib.merge_pretrained(state["params"], params,
                                                                   state_shardings["params"], config.init_from)
    if jax.process_index() == 0:
      fresh = sorted({"/".join(p.split("/")[:2]) for p in kept_random}) or ["nothing"]
      print(f"init_from {config.init_from}: loaded; random init for {', '.join(fresh)}", flush=True)
  pretrained.params = None
  _write_json(os.path.join(workdir, "config.json"), dataclasses.asdict(config))
  if jax.process_index() == 0:
    path = os.path.join(workdir, TOKENIZER_FILE)  # init_from=<this workdir> needs it whole
    pretrained.tokenizer.save(path + ".tmp")
    os.replace(path + ".tmp", path)

  peak_per_device, peak_source = telemetry.peak_flops_per_device(dtype=model_config.compute_dtype)
  # A classifier has no vocabulary matmul: the embedding is a lookup, so vocab_size is left out of the FLOPs.
  flops_model = dataclasses.replace(model_config, vocab_size=0)
  writer = telemetry.MetricsWriter(workdir, start_step=start_step)
  bar = telemetry.ProgressBar(t.steps, initial_step=start_step, enable=config.log.progress_bar)
  nonfinite = reliability.NonFiniteCounter(t.max_consecutive_nonfinite)
  best = _read_best(workdir, t.best_metric)
  window: list[tuple[dict, dict]] = []
  totals = {"tokens": 0, "padded": 0, "examples": 0, "seconds": 0.0}
  last: dict[str, Any] = {}
  eval_metrics: dict[str, float] = {}
  failure = None
  clock = [time.time()]

  def finish_step(step: int, device_metrics: dict, host: dict, evaluated: dict | None) -> None:
    nonlocal last, failure
    jax.block_until_ready(device_metrics)
    now = time.time()
    seconds, clock[0] = now - clock[0], now
    failure = failure or nonfinite.update(step, bool(device_metrics["skipped_steps"]))
    if step > start_step + 1:  # the first step of a run holds the compile
      for key in ("tokens", "padded", "examples"):
        totals[key] += host[key]
      totals["seconds"] += seconds
    window.append((device_metrics, {**host, "seconds": seconds}))
    if step == start_step + 1 or step % config.log.every_steps == 0 or evaluated or step == t.steps:
      fetched = [(jax.device_get(m), h) for m, h in window]
      applied = [(m, h) for m, h in fetched if not m["skipped_steps"]] or fetched
      last = {k: float(np.mean([m[k] for m, _ in applied])) for k in fetched[-1][0]}
      last["train_accuracy"] = last.pop("token_accuracy")
      last["examples"] = last.pop("tokens")
      last["skipped_steps"] = float(sum(m["skipped_steps"] for m, _ in fetched))
      last["skipped_steps_total"] = nonfinite.total
      last.update({k: float(fetched[-1][0][k]) for k in ("learning_rate", "param_norm")})
      seconds = sum(h["seconds"] for _, h in fetched)
      if step > start_step + 1 and seconds > 0:
        padded = sum(h["padded"] for _, h in fetched)
        last["tokens_per_sec"] = sum(h["tokens"] for _, h in fetched) / seconds
        last["padded_tokens_per_sec"] = padded / seconds
        last["examples_per_sec"] = sum(h["examples"] for _, h in fetched) / seconds
        length = max(h["length"] for _, h in fetched)
        flops = padded * telemetry.flops_per_token(flops_model, length)
        last["mfu"] = flops / seconds / (peak_per_device * jax.device_count())
      if evaluated:
        last.update({f"eval_{k}": v for k, v in evaluated.items() if not k.startswith(("confusion/", "support/"))
                     and not k.startswith(("precision/", "recall/"))})
      writer.write(step, last)
      window.clear()
      bar.update(step, loss=last["loss"], acc=last.get("eval_accuracy", last["train_accuracy"]),
                 tokens_per_sec=last.get("tokens_per_sec"))
    else:
      bar.update(step)

  stopped_at = start_step if reliability.should_stop(stop.requested, start_step) else None
  pending = None
  for step in range(start_step + 1, t.steps + 1):
    if stopped_at is not None:
      break
    local = next(loader)
    host = {"tokens": int(local["attention_mask"].sum()) * jax.process_count(),
            "padded": local["attention_mask"].size * jax.process_count(), "examples": t.batch_size,
            "length": local["input_ids"].shape[1]}
    state, metrics = train_step(state, train.to_global_batch(local, mesh))
    if pending is not None:
      finish_step(*pending)
      pending = None
    if failure:
      break
    evaluated = None
    if step == t.steps or (t.eval_every_steps and step % t.eval_every_steps == 0):
      evaluated = run_eval(eval_step, state["params"], eval_batches, data.eval, class_names, mesh)
      eval_metrics = evaluated
      value = evaluated[t.best_metric]
      if evaluate.is_better(t.best_metric, value, best[1]):
        best = (step, value)
        _save_best(workdir, graphdef, state["params"], class_names, pretrained.tokenizer,
                   {"step": step, t.best_metric: value, **evaluated})
      clock[0] = time.time()  # eval time is not train time
    pending = (step, metrics, host, evaluated)
    if reliability.should_stop(stop.requested, step) or step == stop_at_step:
      stopped_at = step
    if step == t.steps or stopped_at is not None or checkpointer.should_save(step):
      checkpointer.save(step, state, loader.get_state(), model_config)
  if pending is not None:
    finish_step(*pending)
  bar.close()
  checkpointer.close()
  writer.close()
  if failure:
    raise reliability.NonFiniteError(failure)
  if stopped_at is not None and stopped_at < t.steps:
    if stop.requested:
      last["preempted_at_step"] = stopped_at
    return last
  if not eval_metrics:  # resumed at the last step: evaluate the restored state
    eval_metrics = run_eval(eval_step, state["params"], eval_batches, data.eval, class_names, mesh)

  result: dict[str, Any] = {k: v for k, v in eval_metrics.items()}
  result["eval_loss"] = result.pop("loss")
  result.update({
      "step": t.steps, "best_metric": t.best_metric, f"best_{t.best_metric}": best[1], "best_step": best[0],
      "train_examples": len(data.train), "eval_examples": len(data.eval), "num_classes": num_labels,
      "labels": ",".join(class_names), "final_train_loss": last.get("loss"),
      "wall_time_sec": round(time.time() - started, 1), "devices": jax.device_count(),
      "init_from": config.init_from,
  })
  if totals["seconds"] > 0:  # steps after the first of this run (the first holds the compile)
    result["tokens_per_sec"] = totals["tokens"] / totals["seconds"]
    result["padded_tokens_per_sec"] = totals["padded"] / totals["seconds"]
    result["examples_per_sec"] = totals["examples"] / totals["seconds"]
  _write_json(os.path.join(workdir, "eval.json"), result)
  summary = {k: v for k, v in result.items() if "/" not in k}
  summary.update({"peak_flops_per_device": peak_per_device, "peak_flops_source": peak_source})
  confusion = np.array([[eval_metrics[f"confusion/{a}/{b}"] for b in class_names] for a in class_names])
  per_class = "\n".join(["| class | precision | recall | f1 | support |", "| --- | --- | --- | --- | --- |"] + [
      f"| {c} | {eval_metrics[f'precision/{c}']:.4f} | {eval_metrics[f'recall/{c}']:.4f} | "
      f"{eval_metrics[f'f1/{c}']:.4f} | {int(eval_metrics[f'support/{c}'])} |" for c in class_names])
  telemetry.write_report(workdir, title=f"Fine-tuning run {os.path.basename(os.path.abspath(workdir))}",
                         summary=summary, config_text=json.dumps(dataclasses.asdict(config), indent=2),
                         data_stats=data.stats, extra_sections=[
                             ("Per class (final eval)", per_class),
                             ("Confusion matrix (final eval; rows: true class)",
                              evaluate.confusion_table(confusion, class_names))])
  return result


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
  _write_json(path, class_names)


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
  hf.save_pretrained(nnx.merge(graphdef, params), temp)  # every process joins the gather; process 0 writes
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


def _write_json(path: str, obj: Any) -> None:
  if jax.process_index() == 0:
    files.write_json(path, obj)
