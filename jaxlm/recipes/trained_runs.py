"""Reading a trained model back from its folder, for the tools that use one: experiments/generate.py, lm_eval.py and
optimize.py. A decoder comes from a jaxlm run (config.json, tokenizer.json, checkpoints/) or from an HF checkpoint
folder (config.json + model.safetensors + tokenizer.json, as transformers' save_pretrained writes it); a classifier
from a finetune.py run (best_model/).

  config, graphdef, params, tokenizer, step = trained_runs.load_decoder("path/to/hf_folder_or_run")  # either kind
  config, graphdef, params, tokenizer, step = trained_runs.load_decoder_run("runs/demo", mesh_tensor=1)
  graphdef, params = trained_runs.with_weights(graphdef, params, "weight_only")   # int8 weights, same mesh
  task = trained_runs.classifier_task("runs/ft", config, calibration_batches=8, finetune_steps=60)  # a TrainedRun
  task = trained_runs.text_lm_task("hf_folder", ["held_out.txt"], calibration_batches=8, finetune_steps=0)
"""

from __future__ import annotations

import dataclasses
import functools
import json
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
from jaxlm.data.tuning import classification as cls_data
from jaxlm.data import files as files_lib
from jaxlm.data import packing
from jaxlm.data.tokenizer import TOKENIZER_FILE
from jaxlm.interop import hf_config
from jaxlm.models.bert import BertForSequenceClassification
from jaxlm.models.gpt import FLAVOURS, GPT
from jaxlm.recipes import features as features_lib

PREDICTIONS = "predictions"  # a classifier evaluation's (labels, predictions, classes), for comparing variants


def load_decoder_run(workdir: str, mesh_tensor: int = 1, mesh_config: config_lib.MeshConfig | None = None):
  """(config, graphdef, params, tokenizer, step) of a run's newest checkpoint, params sharded on this host's
  devices: on `mesh_config` if given, else heads over `mesh_tensor` devices and replicated over the rest."""
  config_path = os.path.join(workdir, "config.json")
  if not os.path.exists(config_path):
    raise ValueError(f"{config_path} not found: --workdir must be a jaxlm training run folder (an HF checkpoint "
                     "folder goes to --init_from)")
  check_not_hf_folder(workdir)
  config = config_lib.from_run_file(config_path)
  _check_decoder(workdir, config.model.flavour, f"a {config.model.flavour} run")
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


def check_not_hf_folder(workdir: str) -> None:
  """A one-line error pointing to --init_from when a --workdir is an HF checkpoint folder (config.json's model_type)."""
  config_path = os.path.join(workdir, "config.json")
  if os.path.isfile(config_path):
    with open(config_path) as f:
      if "model_type" in json.load(f):
        raise ValueError(f"{workdir} is an HF checkpoint folder, not a jaxlm training run: give it as "
                         f"--init_from={workdir}")


FOLDER_HELP = ("an HF checkpoint folder (config.json + model.safetensors + tokenizer.json, as transformers' "
               "save_pretrained writes it) or a jaxlm run workdir")


def chosen_folder(workdir: str | None, init_from: str | None) -> str:
  """The folder of --workdir or --init_from: exactly one of them must be given (a one-line error otherwise)."""
  if workdir and init_from:
    raise ValueError(f"--workdir={workdir} and --init_from={init_from} both given; give one: --workdir=<jaxlm "
                     f"training run> or --init_from=<HF checkpoint folder or jaxlm run>")
  if not workdir and not init_from:
    raise ValueError("no model given: set --workdir=<jaxlm training run> or --init_from=<HF checkpoint folder "
                     "(config.json + model.safetensors + tokenizer.json) or jaxlm run>")
  return workdir or init_from


def is_jaxlm_run(folder: str) -> bool:
  """Whether `folder` is a jaxlm training run (its config.json and checkpoints/), rather than an HF folder."""
  return os.path.isdir(os.path.join(folder, "checkpoints")) and os.path.isfile(os.path.join(folder, "config.json"))


def _check_decoder(folder: str, flavour: str, what: str) -> None:
  if flavour not in FLAVOURS:
    raise ValueError(f"{folder} holds {what}, an encoder; this command needs a decoder (GPT-2, Llama, Qwen, "
                     "Mistral, Gemma, ...). Encoders are fine-tuned by experiments/finetune.py, whose run "
                     "optimize.py --workdir takes")


def check_decoder_folder(folder: str) -> str:
  """"jaxlm" (a run workdir) or "hf" (an HF checkpoint folder) for a folder that holds a decoder, read from its
  config.json alone (no weights); a one-line error for anything else (no folder, an encoder, no config.json)."""
  if not os.path.isdir(folder):
    raise FileNotFoundError(f"{folder!r} is not a folder; give {FOLDER_HELP}")
  if is_jaxlm_run(folder):
    flavour = config_lib.from_run_file(os.path.join(folder, "config.json")).model.flavour
    _check_decoder(folder, flavour, f"a {flavour} run")
    return "jaxlm"
  config_path = os.path.join(folder, "config.json")
  if not os.path.isfile(config_path):
    raise ValueError(f"{folder} has no config.json (nor checkpoints/); give {FOLDER_HELP}")
  with open(config_path) as f:
    model_type = json.load(f).get("model_type")
  _check_decoder(folder, hf_config.model_config_from_file(folder).flavour, f"an HF {model_type!r} model")
  if not os.path.isfile(os.path.join(folder, TOKENIZER_FILE)):
    raise ValueError(f"{folder} has no {TOKENIZER_FILE}; save the model's tokenizer there (transformers: "
                     "AutoTokenizer.from_pretrained(...).save_pretrained(folder) writes it for fast tokenizers)")
  return "hf"


def load_decoder(folder: str, mesh_tensor: int = 1, mesh_config: config_lib.MeshConfig | None = None, *,
                 compute_dtype: str = "float32", param_dtype: str = "float32"):
  """(config, graphdef, params, tokenizer, step) of the decoder in `folder`, sharded as load_decoder_run shards
  them: a jaxlm run workdir is load_decoder_run's (its newest checkpoint, in the run's precision); an HF checkpoint
  folder is read by jaxlm.interop.hf_weights.from_pretrained in `compute_dtype` / `param_dtype`, with its
  tokenizer.json (no padding or truncation), step None and `config` a default jaxlm Config around its model."""
  if check_decoder_folder(folder) == "jaxlm":
    return load_decoder_run(folder, mesh_tensor, mesh_config)
  mesh_config = mesh_config or config_lib.MeshConfig(data=-1, fsdp=1, tensor=mesh_tensor)
  model = hf_weights.from_pretrained(folder, mesh=sharding.make_mesh(mesh_config), compute_dtype=compute_dtype,
                                     param_dtype=param_dtype)
  tokenizer = cls_data.load_checkpoint_tokenizer(os.path.join(folder, TOKENIZER_FILE))
  if tokenizer.get_vocab_size(with_added_tokens=True) > model.config.vocab_size:
    raise ValueError(f"{folder}/{TOKENIZER_FILE} has {tokenizer.get_vocab_size(with_added_tokens=True)} tokens but "
                     f"the model's vocabulary holds {model.config.vocab_size}; it is not this model's tokenizer")
  graphdef, params = nnx.split(model)
  return config_lib.Config(model=model.config, mesh=mesh_config), graphdef, params, tokenizer, None


def stop_ids(folder: str, tokenizer) -> list[int]:
  """The tokens that end a sample of the folder's decoder: the tokenizer's end-of-document token and, for an HF
  folder, the eos_token_id(s) of its generation_config.json or config.json (where transformers' generate stops)."""
  ids = [data_lib.eos_id(tokenizer)]
  for name in () if is_jaxlm_run(folder) else ("generation_config.json", "config.json"):
    path = os.path.join(folder, name)
    if os.path.isfile(path):
      with open(path) as f:
        eos = json.load(f).get("eos_token_id")
      if eos is not None:
        ids += [eos] if isinstance(eos, int) else list(eos)
        break
  return sorted(set(ids))


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
  tokenizer: Any = None  # LM runs: the decoder's tokenizer (optimize.py's --lm_eval_tasks)


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
  _, graphdef, params, tokenizer, step = load_decoder_run(workdir, mesh_config=config.mesh)
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
              steps_lib.make_loss_fn, orders, config.train, tokenizer)


TEXT_KINDS = ("txt", "jsonl", "json", "parquet")  # text_lm_task's files (jaxlm/data/files.py reads them)
MAX_TEXT_WINDOW = 2048  # text_lm_task's default window: the model's positions, at most this many tokens


def read_text_files(paths, text_column: str = "text", flag: str = "--eval_text") -> list[str]:
  """The documents of text files for held-out perplexity: a .txt file is one document (its lines, joined), a
  .jsonl/.json/.parquet row one document (its `text_column`), read through jaxlm/data/files.py. `flag` names the
  setting in the one-line errors."""
  documents = []
  for path in paths:
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{flag}: {path!r} does not exist")
    if files_lib.file_kind(path) not in TEXT_KINDS:
      raise ValueError(f"{flag}: {path!r} is not a text file; give .txt, .jsonl, .json or .parquet files (the text "
                       f"ones may be compressed)")
    try:
      texts = list(files_lib.iter_files([path], text_column))
    except files_lib.MissingColumn as e:
      raise ValueError(f"{flag}: column {e.column!r} not found in {e.where!r}; columns are {e.found}; set "
                       "--text_column") from None
    if files_lib.file_kind(path) == "txt":
      texts = ["\n".join(texts)]
    documents += [t for t in texts if isinstance(t, str) and t.strip()]
  if not documents:
    raise ValueError(f"{flag}={','.join(paths)} holds no text")
  return documents


def text_lm_task(folder: str, eval_files, *, calibration_files=(), text_column: str = "text", seq_len: int = 0,
                 batch_size: int = 8, calibration_batches: int, finetune_steps: int, finetune_orders: int = 1,
                 max_eval_batches: int = 64, mesh_tensor: int = 1) -> TrainedRun:
  """The decoder of `folder` (an HF checkpoint folder or a jaxlm run, `load_decoder`) with no training data of its
  own: held-out perplexity on the documents of `eval_files` (read_text_files), tokenized with the folder's tokenizer
  and packed as pretraining packs them (EOS after each document, jaxlm/data/packing.py) into windows of `seq_len`
  tokens (0: the model's positions, at most MAX_TEXT_WINDOW), every window once in up to `max_eval_batches` batches
  of `batch_size`; `calibration_batches` and `finetune_orders` orders of `finetune_steps` shuffled batches from the
  windows of `calibration_files` (default: the eval windows, for calibration only; a fine-tune on them would train
  on the text it is scored on)."""
  if finetune_steps and not calibration_files:
    raise ValueError("the masked fine-tunes would train on the evaluation text: give them other text "
                     "(--calibration_text)")
  documents = read_text_files(eval_files, text_column)  # before the weights load: a wrong file fails at once
  calibration_documents = read_text_files(calibration_files, text_column, "--calibration_text") if (
      calibration_files) else None
  config, graphdef, params, tokenizer, step = load_decoder(folder, mesh_tensor)
  limit = config.model.max_seq_len
  seq_len = seq_len or min(limit, MAX_TEXT_WINDOW)
  if not 1 <= seq_len <= limit:
    raise ValueError(f"--seq_len={seq_len} is outside the model's 1..{limit} positions")
  if batch_size < 1:
    raise ValueError(f"--batch_size={batch_size} must be at least 1")
  mesh = sharding.make_mesh(config.mesh)
  model = nnx.merge(graphdef, params)
  eos = data_lib.eos_id(tokenizer)
  windows = packing.pack(tokenizer, documents, seq_len, eos)
  count = max(1, min(max_eval_batches, -(-len(windows) // batch_size)))
  eval_batches = data_lib.eval_batches(windows, batch_size, count)
  # eval_batches wraps around to the first windows to fill the last batch: those repeats score nothing.
  slots = np.arange(count * batch_size).reshape(count, batch_size) * jax.process_count() + jax.process_index()
  for batch, rows in zip(eval_batches, slots):
    batch["loss_mask"][rows >= len(windows)] = 0.0
  eval_tokens = int(sum(b["loss_mask"].sum() for b in eval_batches))
  source = windows if calibration_documents is None else packing.pack(tokenizer, calibration_documents, seq_len, eos)

  def shuffled(seed, number):  # `number` batches of windows in a seeded order (each window once per pass)
    rng = np.random.default_rng(seed)
    need = number * batch_size
    order = np.concatenate([rng.permutation(len(source)) for _ in range(-(-need // len(source)))])
    return [source.batch(order[i * batch_size:(i + 1) * batch_size]) for i in range(number)]

  seed = config.train.seed
  first = shuffled(seed, max(calibration_batches, finetune_steps))
  orders = [first[:finetune_steps]] + [shuffled(seed + k, finetune_steps) for k in range(1, finetune_orders)]

  def evaluate(m):
    g, p = nnx.split(m)
    result = steps_lib.evaluate(jax.jit(steps_lib.make_eval_step(g)), p, eval_batches, mesh)
    return {"perplexity": result["eval_perplexity"], "loss": result["eval_loss"],
            "token_accuracy": result["eval_token_accuracy"], "eval_tokens": eval_tokens}

  print(f"decoder {folder}{'' if step is None else f' (step {step})'}: {eval_tokens} held-out tokens of "
        f"{','.join(eval_files)} in {len(windows)} windows of {seq_len}, {count} batches of {batch_size}"
        + (f"; calibration: {len(source)} windows of {','.join(calibration_files)}" if calibration_files else
           "; calibration on the same windows"))
  return TrainedRun("lm", config.model, lambda c: GPT(c, rngs=nnx.Rngs(0)), model, mesh, evaluate,
                    lambda m, b: m(b["inputs"], b["positions"], b["segment_ids"]), eval_batches[0],
                    batch_size * seq_len, "tokens", first[:calibration_batches], steps_lib.make_loss_fn, orders,
                    config.train, tokenizer)


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
