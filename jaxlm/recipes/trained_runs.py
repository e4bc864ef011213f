"""Reading a trained run back from its folder (config.json, tokenizer.json, checkpoints/ or best_model/), for the tools
that use a trained model: experiments/generate.py, lm_eval.py and optimize.py.

  config, graphdef, params, tokenizer, step = trained_runs.load_decoder_run("runs/demo", mesh_tensor=1)
  graphdef, params = trained_runs.with_weights(graphdef, params, "weight_only")   # int8 weights, same mesh
  task = trained_runs.classifier_task("runs/ft", config, calibration_batches=8, finetune_steps=60)  # a TrainedRun
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx

from jaxlm import config as config_lib
from jaxlm import data as data_lib
from jaxlm.compress import distill
from jaxlm.recipes import classifier_finetuning
from jaxlm.inference import generate
from jaxlm.interop import hf_weights
from jaxlm.training import optim
from jaxlm.compress import quantization
from jaxlm.compress import checkpoint_files
from jaxlm.parallel import sharding
from jaxlm.training import steps as steps_lib
from jaxlm.training.checkpoint import Checkpointer, abstract_with_shardings
from jaxlm.data import classification as cls_data
from jaxlm.data.tokenizer import TOKENIZER_FILE
from jaxlm.models.bert import BertForSequenceClassification
from jaxlm.models.gpt import GPT
from jaxlm.recipes import features as features_lib

PREDICTIONS = "predictions"  # a classifier evaluation's (labels, predictions, classes), for comparing variants


def load_decoder_run(workdir: str, mesh_tensor: int = 1, mesh_config: config_lib.MeshConfig | None = None):
  """(config, graphdef, params, tokenizer, step) of a run's newest checkpoint, params sharded on this host's
  devices: on `mesh_config` if given, else heads over `mesh_tensor` devices and replicated over the rest."""
  config_path = os.path.join(workdir, "config.json")
  if not os.path.exists(config_path):
    raise ValueError(f"{config_path} not found: --workdir must be a jaxlm training run folder")
  config = config_lib.from_run_file(config_path)
  config = dataclasses.replace(config, mesh=mesh_config or config_lib.MeshConfig(data=-1, fsdp=1, tensor=mesh_tensor))
  mesh = sharding.make_mesh(config.mesh)
  optimizer = optim.make_optimizer(config.train)
  built = {}

  def init():  # traced only (eval_shape): shapes and shardings of the train state, nothing allocated
    graphdef, state, state_shardings, features = features_lib.train_state_from_config(
      config, mesh, optimizer, features_lib.decoder_factory(config, mesh))
    built.update(graphdef=graphdef, shardings=state_shardings, features=features)
    return state

  abstract_state = jax.eval_shape(init)
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), every_steps=0, keep=config.checkpoint.keep)
  try:
    restored = checkpointer.restore_latest(abstract_with_shardings(abstract_state, built["shardings"]), config.model)
  finally:
    checkpointer.close()
  if restored is None:
    raise ValueError(f"no checkpoint in {workdir}/checkpoints; train first (experiments/train_lm.py)")
  step, state, _ = restored
  tokenizer = data_lib.load_tokenizer(os.path.join(workdir, "tokenizer.json"))
  return config, built["graphdef"], built["features"].model_params(state), tokenizer, step


WEIGHTS = ("float", "weight_only", "w8a8_dynamic")  # the trained weights, or jaxlm.compress.quantization's
                                                    # calibration-free int8


def with_weights(graphdef, params, weights: str = "float"):
  """(graphdef, params) of the decoder with `weights`: "float" as trained, or int8 weights quantized with
  jaxlm.compress.quantization's `weight_only` or `w8a8_dynamic` mode, placed on the mesh of `params` (if any)."""
  if weights not in WEIGHTS:
    raise ValueError(f"weights={weights!r} is not one of {', '.join(WEIGHTS)}")
  if weights == "float":
    return graphdef, params
  model = quantization.quantize(nnx.merge(graphdef, params), weights)
  mesh = generate.mesh_of(params)
  return nnx.split(model if mesh is None else checkpoint_files.place(model, mesh))


@dataclasses.dataclass
class TrainedRun:
  """A trained run read back for post-training optimization (experiments/optimize.py): the float model on its mesh,
  how to evaluate and run it, and the training batches that calibrate its variants and fine-tune the pruned ones."""
  kind: str  # "lm" or "classifier"
  model_config: Any
  make_model: Callable  # (ModelConfig) -> nnx.Module, the float architecture
  model: Any  # the trained float model, placed on the mesh
  mesh: Any
  evaluate: Callable  # (model) -> {metric: value}
  forward: Callable  # (model, batch) -> logits
  timing_batch: dict
  items_per_batch: int  # tokens (LM) or examples (classifier) in timing_batch
  unit: str
  calibration: list
  loss_fn: Callable  # (graphdef) -> sum-loss fn, for the optional pruned fine-tune
  finetune_orders: list  # [orders][steps] training batches: one order per masked fine-tune
  train_config: Any  # the run's TrainConfig (a follow-up fine-tune can reuse its optimizer)


def lm_task(workdir: str, config, *, calibration_batches: int, finetune_steps: int, finetune_orders: int = 1,
            max_eval_batches: int = 64) -> TrainedRun:
  """A train_lm.py run (its config `config`) on the run's mesh: held-out perplexity on up to `max_eval_batches`
  batches, `calibration_batches` shuffled training batches, and `finetune_orders` shuffled orders (seeds train.seed +
  k) of `finetune_steps` batches; the first order and the calibration are one read."""
  run_tokenizer = os.path.join(workdir, TOKENIZER_FILE)
  if config.data.tokenizer and os.path.isfile(run_tokenizer) and (
      data_lib.load_tokenizer(config.data.tokenizer).to_str() != data_lib.load_tokenizer(run_tokenizer).to_str()):
    raise ValueError(f"data.tokenizer={config.data.tokenizer!r} differs from {run_tokenizer}: the calibration and "
                     "eval data would be tokenized differently from the model's training data; make them the same file")
  _, graphdef, params, _, step = load_decoder_run(workdir, mesh_config=config.mesh)
  mesh = sharding.make_mesh(config.mesh)
  model = nnx.merge(graphdef, params)
  datasets = data_lib.build_datasets(config.data, config.model.vocab_size, workdir, config.train.seed)
  batch = config.train.batch_size
  eval_batches = data_lib.eval_batches(datasets.eval, batch, max(1, min(max_eval_batches, len(datasets.eval) // batch)))
  # Shuffled training batches (the run's seed): the first rows in order would be a few neighbouring source files.
  def shuffled(seed, count):
    iterator = data_lib.make_pretraining_batches(datasets, batch, seed, shuffle=True)
    return [next(iterator) for _ in range(count)]
  first = shuffled(config.train.seed, max(calibration_batches, finetune_steps))  # calibration and order 0
  orders = [first[:finetune_steps]] + [shuffled(config.train.seed + k, finetune_steps)
                                       for k in range(1, finetune_orders)]

  def evaluate(m):
    g, p = nnx.split(m)
    result = steps_lib.evaluate(jax.jit(steps_lib.make_eval_step(g)), p, eval_batches, mesh)
    return {"perplexity": result["eval_perplexity"], "loss": result["eval_loss"],
            "token_accuracy": result["eval_token_accuracy"],
            "eval_tokens": len(eval_batches) * batch * config.data.seq_len}

  print(f"LM run {workdir}: step {step}, {len(eval_batches)} eval batches of {batch} x {config.data.seq_len}")
  return TrainedRun("lm", config.model, lambda c: GPT(c, rngs=nnx.Rngs(0)), model, mesh, evaluate,
              lambda m, b: m(b["inputs"], b["positions"], b["segment_ids"]), eval_batches[0],
              batch * config.data.seq_len, "tokens", first[:calibration_batches],
              steps_lib.make_loss_fn, orders, config.train)


def classifier_task(workdir: str, config, *, calibration_batches: int, finetune_steps: int, finetune_orders: int = 1,
                    finetune_seed: int = 0, distill_files: tuple[str, ...] = (), distill_temperature: float = 2.0
                    ) -> TrainedRun:
  """A classifier_finetuning.py run (its config `config`): held-out accuracy and macro-F1 of its best model, whose
  evaluation also returns the predictions (PREDICTIONS), `calibration_batches` training batches spread from short to
  long, and `finetune_orders` random orders (seeds finetune_seed + k) of `finetune_steps` training batches.

  `distill_files` (unlabelled text of the task): the fine-tune batches are drawn from their texts instead, and the
  loss distils the float model's outputs on them (`jaxlm.compress.distill`, `distill_temperature`)."""
  folder = os.path.join(workdir, classifier_finetuning.BEST_MODEL)
  mesh = sharding.make_mesh(config.mesh)
  model = hf_weights.from_pretrained(folder, mesh=mesh, compute_dtype=config.model.compute_dtype,
                             param_dtype=config.model.param_dtype)
  if not isinstance(model, BertForSequenceClassification):
    raise ValueError(f"{folder} holds no sequence classifier")
  tokenizer = cls_data.load_checkpoint_tokenizer(folder)
  d = config.data
  data = cls_data.build_classification_data(d, tokenizer, config.train.seed, model.config.vocab_size)
  batch = config.train.batch_size
  eval_batches = cls_data.eval_batches(data.eval, batch, d.seq_len, d.batching)
  train_batches = cls_data.eval_batches(data.train, batch, d.seq_len, d.batching)
  num_labels = model.num_labels

  def evaluate(m):
    g, p = nnx.split(m)
    result = classifier_finetuning.run_eval(jax.jit(classifier_finetuning.make_eval_step(g)), p, eval_batches,
                                            data.eval, data.class_names, mesh, with_predictions=True)
    return {"accuracy": result["accuracy"], "f1_macro": result["f1_macro"], "loss": result["loss"],
            "eval_examples": result["examples"],
            PREDICTIONS: (result["labels"], result["predictions"], len(data.class_names))}

  forward = lambda m, b: m.classify(b)
  print(f"classifier run {workdir}: {len(data.eval.labels)} eval examples, classes {data.class_names}")
  timing = max(eval_batches, key=lambda b: b["input_ids"].shape[1])  # the longest padded batch
  # The batches are sorted by length: calibrate on evenly spaced ones (short to long) and fine-tune in a seeded
  # random order, so neither sees only the shortest texts.
  stride = max(1, len(train_batches) // max(calibration_batches, 1))
  calibration = train_batches[::stride][:calibration_batches]
  steps = max(finetune_steps, 1)
  loss_fn, finetune_batches = classifier_finetuning.make_classification_loss_fn, train_batches
  if distill_files:
    texts = distill.read_texts(distill_files, d, tokenizer, data.seq_len)
    finetune_batches = distill.teacher_batches(model, forward, texts, batch, data.seq_len, d.batching)
    loss_fn = functools.partial(distill.make_distillation_loss_fn, temperature=distill_temperature)
    print(f"masked fine-tunes distil the float model on {len(texts)} texts of {', '.join(distill_files)}")

  def order(seed):
    indices = np.concatenate([np.random.default_rng(s + 1000 * seed).permutation(len(finetune_batches))
                              for s in range(-(-steps // len(finetune_batches)))])
    return [finetune_batches[i] for i in indices][:finetune_steps]

  return TrainedRun("classifier", model.config,
              lambda c: BertForSequenceClassification(c, num_labels, rngs=nnx.Rngs(0)), model, mesh, evaluate,
              forward, timing, int(timing["input_ids"].shape[0]), "examples",
              calibration, loss_fn,
              [order(finetune_seed + k) for k in range(finetune_orders)],
              config.train)
