"""Post-training optimization of a trained LM, a fine-tuned classifier or an HF decoder, measured side by side in one
run.

  python experiments/optimize.py --workdir=runs/demo                # a train_lm.py run: perplexity
  python experiments/optimize.py --workdir=runs/optimize_minilm     # a finetune.py run: accuracy, macro-F1
  python experiments/optimize.py --init_from=path/to/hf_folder --eval_text=held_out.txt --output_dir=runs/opt_hf

--init_from takes a decoder without its training data: an HF checkpoint folder (config.json + model.safetensors +
tokenizer.json; float32) or a jaxlm run workdir. Its perplexity is measured on --eval_text (.txt files, each one
document, or .jsonl/.json/.parquet rows, each row's --text_column one document), tokenized with the folder's
tokenizer and packed into windows of --seq_len tokens (default: the model's positions, at most 2048) in batches of
--batch_size; the calibration (and the masked fine-tunes of --prune_finetune_steps) read --calibration_text, by
default the eval windows (calibration only: a fine-tune must have its own text). The folder is only read: the
outputs go to --output_dir. Encoder (classifier) HF folders are refused; optimize their finetune.py run instead.

Variants: fp32, bf16 (params and compute), int8 weight-only, int8 W8A8 (static input scales calibrated on
--calibration_batches training batches), int8 W8A8 dynamic (per-token scales), both again after SmoothQuant smoothing
(strength --smoothing, measured on the same batches), --sparsity magnitude pruning (one global threshold, and per
layer: each matrix of each layer), Wanda pruning (|W| * input norm per output row, on the same batches), 2:4 pruning by
magnitude and by Wanda's score, SparseGPT (per-row masks chosen with a per-layer reconstruction of the kept weights,
on the same batches; 50% and 2:4), and int8 weight-only on top of each pruning (--prune_finetune_steps > 0 first
fine-tunes the pruned models with their masks kept; the rows then also give the metric before that fine-tune, and
"fp32 fine-tuned" is the same fine-tune of the dense model, the control; on a classifier run,
--prune_distill_files=unlabelled.csv makes that fine-tune distil the float model's outputs on unlabelled task text,
which recovers far more than the labelled rows do when those are few: see docs/optimization.md).
For each: the task metric on the run's held-out data (a classifier's rows also count the held-out predictions that
differ from fp32's and give a 95% paired-bootstrap interval of the change), latency of one forward on an eval
batch (best of --repeats after warm-up, on the run's mesh), throughput, parameter bytes and the orbax checkpoint's
size on disk (written under <out>/optimize/<variant>/). Writes <out>/optimize.json (flat numbers and strings),
optimize.png, and an "Optimization" section in <out>/report.md (replaced when re-run); <out> is --output_dir, by
default the --workdir.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

from absl import flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "a train_lm.py or finetune.py run folder")
_INIT_FROM = flags.DEFINE_string("init_from", None, "instead of --workdir, a decoder without its training data: an HF "
                                 "checkpoint folder (config.json + model.safetensors + tokenizer.json) or a jaxlm run "
                                 "workdir, scored on --eval_text; needs --output_dir (the folder is only read)")
_EVAL_TEXT = flags.DEFINE_list("eval_text", [], "with --init_from: held-out text files for the perplexity: .txt (one "
                               "document per file), .jsonl/.json/.parquet (one per row, column --text_column)")
_CALIBRATION_TEXT = flags.DEFINE_list("calibration_text", [], "with --init_from: text files (as --eval_text) for the "
                                      "calibration and --prune_finetune_steps; default: the --eval_text windows, "
                                      "for calibration only")
_TEXT_COLUMN = flags.DEFINE_string("text_column", "text", "with --init_from: the text column of .jsonl/.json/.parquet "
                                   "text files")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 0, "with --init_from: tokens per window (0 = the model's positions, at most "
                                "2048)")
_BATCH = flags.DEFINE_integer("batch_size", 8, "with --init_from: windows per batch")
_TENSOR = flags.DEFINE_integer("mesh_tensor", 1, "with --init_from: devices that split heads (the others split the "
                               "batch)")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "", "folder for optimize.json, optimize.png, report.md and the "
                                  "variant checkpoints (default: the --workdir; required with --init_from)")
_CALIBRATION = flags.DEFINE_integer("calibration_batches", 8, "training batches that calibrate W8A8 input scales")
_REPEATS = flags.DEFINE_integer("repeats", 10, "timed forwards per variant (after 2 warm-up calls)")
_MAX_EVAL = flags.DEFINE_integer("max_eval_batches", 64, "LM: cap on held-out batches (each sequence once)")
_PRUNE_STEPS = flags.DEFINE_integer("prune_finetune_steps", 0, "fine-tune steps after pruning (masks kept)")
_PRUNE_LR = flags.DEFINE_float("prune_finetune_lr", 1e-4, "constant AdamW learning rate of that fine-tune")
_PRUNE_LIKE_RUN = flags.DEFINE_bool("prune_finetune_like_run", False, "that fine-tune uses the run's own AdamW "
                                     "(betas, weight decay, clipping, train.layer_lr_decay) at the constant "
                                     "--prune_finetune_lr; default: a plain AdamW without weight decay")
_PRUNE_SCHEDULE = flags.DEFINE_enum("prune_finetune_schedule", "constant", ["constant", "run"],
                                    "with --prune_finetune_like_run: the rate constant, or the run's own warm-up share "
                                    "and cosine decay over the fine-tune's steps, peaking at --prune_finetune_lr")
_PRUNE_SEED = flags.DEFINE_integer("prune_finetune_seed", 0, "classifier runs: seed of that fine-tune's batch order "
                                   "(a second seed shows the noise of the comparison)")
_PRUNE_SOUP = flags.DEFINE_integer("prune_finetune_soup", 1, "masked fine-tunes per pruned model, each in its own "
                                   "batch order (seeds prune_finetune_seed + k), averaged into one (a sparse soup)")
_DISTILL = flags.DEFINE_list("prune_distill_files", [], "classifier runs: files of unlabelled task text (the run's "
                             "text column); the masked fine-tunes then distil the float model's outputs on them "
                             "instead of training on the labelled rows")
_DISTILL_T = flags.DEFINE_float("prune_distill_temperature", 2.0, "softmax temperature of that distillation")
_ATTENTION_RATIO = flags.DEFINE_float("prune_attention_ratio", 1.0, "unstructured per-matrix pruning (per-layer "
                                       "magnitude, Wanda, SparseGPT): the attention projections' sparsity over "
                                       "--sparsity; the MLP matrices take what keeps --sparsity overall")
_KEEP = flags.DEFINE_bool("keep_checkpoints", False, "keep <workdir>/optimize/<variant> checkpoints")
_SMOOTHING = flags.DEFINE_float("smoothing", 0.5, "SmoothQuant strength (alpha, in [0, 1]) of the smooth variants")
_SPARSITY = flags.DEFINE_float("sparsity", 0.5, "fraction of weights the unstructured pruning variants zero")
_LM_EVAL_TASKS = flags.DEFINE_list("lm_eval_tasks", [], "LM runs: lm-eval tasks scored for every variant "
                                   "(jaxlm.interop.lm_eval_model; columns lm_eval/<task>/<metric>)")
_LM_EVAL_INCLUDE = flags.DEFINE_multi_string("lm_eval_include_path", [], "folder of lm-eval task YAMLs")
_LM_EVAL_LIMIT = flags.DEFINE_integer("lm_eval_limit", 0, "documents per lm-eval task (0 = all)")
_VARIANTS = flags.DEFINE_list("variants", [], "variants to measure, as named in optimize.json (e.g. "
                              "int8_W8A8,2:4); empty = all; fp32, the baseline, always runs")
INIT_FROM_ONLY = ("eval_text", "calibration_text", "text_column", "seq_len", "batch_size", "mesh_tensor")

VARIANTS = ("fp32", "bf16", "int8 weight-only", "int8 W8A8", "int8 W8A8 dynamic", "int8 W8A8 smooth",
            "int8 W8A8 smooth dynamic", "fp32 fine-tuned", "50% magnitude", "50% magnitude per layer", "50% wanda",
            "50% sparsegpt", "2:4", "2:4 wanda", "2:4 sparsegpt", "50% magnitude + int8", "50% per layer + int8",
            "50% wanda + int8", "50% sparsegpt + int8", "2:4 + int8", "2:4 wanda + int8", "2:4 sparsegpt + int8")


def variant_names(sparsity: float) -> tuple[str, ...]:
  """VARIANTS with the unstructured pruning's percentage (--sparsity) in their names."""
  return tuple(n.replace("50%", f"{round(100 * sparsity)}%") for n in VARIANTS)


def check_flags() -> None:
  """One-line errors for flag values out of range, before anything loads."""
  if not 0.0 <= _SMOOTHING.value <= 1.0:
    raise ValueError(f"--smoothing={_SMOOTHING.value} is out of range: SmoothQuant's strength must be in [0, 1] "
                     "(0.5 is the paper's)")
  if not 0.0 < _SPARSITY.value < 1.0:
    raise ValueError(f"--sparsity={_SPARSITY.value} is out of range: give the fraction of weights to zero, in (0, 1)")
  if _PRUNE_SCHEDULE.value == "run" and not _PRUNE_LIKE_RUN.value:
    raise ValueError("--prune_finetune_schedule=run is the run's own schedule: it needs --prune_finetune_like_run")
  if _CALIBRATION.value < 1:
    raise ValueError(f"--calibration_batches={_CALIBRATION.value}: W8A8 and Wanda need at least one calibration batch")
  if not 0.0 < _ATTENTION_RATIO.value * _SPARSITY.value < 1.0:
    raise ValueError(f"--prune_attention_ratio={_ATTENTION_RATIO.value} at --sparsity={_SPARSITY.value} puts the "
                     "attention sparsity outside (0, 1); pick a ratio nearer 1")
  if _DISTILL_T.value <= 0:
    raise ValueError(f"--prune_distill_temperature={_DISTILL_T.value} must be > 0 (1 is the plain softmax, 2 usual)")
  if _DISTILL.value and not _PRUNE_STEPS.value:
    raise ValueError("--prune_distill_files feeds the masked fine-tune: give it --prune_finetune_steps > 0 too")
  for path in _DISTILL.value:
    if not os.path.isfile(path):
      raise FileNotFoundError(f"--prune_distill_files: {path!r} does not exist; give files of unlabelled task text")
  if _PRUNE_SOUP.value < 1:
    raise ValueError(f"--prune_finetune_soup={_PRUNE_SOUP.value}: give the number of masked fine-tunes to average, "
                     "at least 1")
  if _INIT_FROM.value:
    if not _EVAL_TEXT.value:
      raise ValueError("--init_from has no held-out data of its own: give --eval_text=<.txt/.jsonl/.parquet files>")
    if not _OUTPUT_DIR.value:
      raise ValueError("--init_from only reads its folder: give --output_dir for optimize.json and report.md")
    if _PRUNE_STEPS.value and not _CALIBRATION_TEXT.value:
      raise ValueError("--prune_finetune_steps with --init_from fine-tunes on --calibration_text: give it, or the "
                       "pruned models would train on the --eval_text they are scored on")
    if _DISTILL.value:
      raise ValueError("--prune_distill_files is for classifier runs; --init_from takes a decoder")
  elif given := [f"--{name}" for name in INIT_FROM_ONLY if flags.FLAGS[name].present]:
    raise ValueError(f"{given[0]} is for --init_from; a --workdir run is scored on its own held-out data")


def variants(task):
  """(name, build) pairs, in table order; each build returns a model (float, pruned or int8)."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from jaxlm.compress import checkpoint_files, prune, quantization
  from jaxlm.training import optim  # noqa: PLC0415

  def bf16():
    config = dataclasses.replace(task.model_config, param_dtype="bfloat16", compute_dtype="bfloat16")
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: task.make_model(config)))
    cast = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                        nnx.state(task.model).to_pure_dict())
    nnx.replace_by_pure_dict(abstract, cast)
    return nnx.merge(graphdef, abstract)

  def finetune_optimizer():
    if not _PRUNE_LIKE_RUN.value:
      return None
    return optim.make_optimizer(optim.follow_up_config(task.train_config, _PRUNE_LR.value, _PRUNE_STEPS.value,
                                                       _PRUNE_SCHEDULE.value))

  def pruned(make_masks, reconstructs=False):
    def build():
      if reconstructs:  # SparseGPT: the kept weights change too
        model, masks = make_masks(task.model)
      else:
        masks = make_masks(task.model)
        model = prune.apply_masks(task.model, masks)
      before = {}
      if _PRUNE_STEPS.value:
        before = {f"{k}_before_finetune": v for k, v in task.evaluate(checkpoint_files.place(model, task.mesh)).items()
                  if k in ("perplexity", "loss", "accuracy", "f1_macro")}
        graphdef, state = nnx.split(model)
        params = prune.finetune_soup(graphdef, state.to_pure_dict(), masks, task.loss_fn(graphdef),
                                     task.finetune_orders, learning_rate=_PRUNE_LR.value,
                                     optimizer=finetune_optimizer())
        nnx.replace_by_pure_dict(state, params)
        model = nnx.merge(graphdef, state)
      return model, before
    return build

  cache = {}

  def cached(name, build):
    def get():
      if name not in cache:
        cache[name] = build()
      return cache[name]
    return get

  sparsity, smoothing = _SPARSITY.value, _SMOOTHING.value
  calibrated = dict(calibration=task.calibration, forward=task.forward)
  # The unstructured per-matrix variants share one allocation over attention and MLP (--prune_attention_ratio).
  unstructured = lambda pattern: dict(sparsity=sparsity, attention_ratio=_ATTENTION_RATIO.value) if (  # noqa: E731
      pattern == "unstructured") else dict(sparsity=0.5)
  wanda = lambda pattern: lambda m: prune.wanda_masks(m, calibration=task.calibration,  # noqa: E731
                                                      forward=task.forward, pattern=pattern, **unstructured(pattern))
  magnitude = cached("magnitude", pruned(lambda m: prune.magnitude_masks(m, sparsity)))
  per_layer = cached("per layer", pruned(lambda m: prune.magnitude_masks(m, per_layer=True,
                                                                           **unstructured("unstructured"))))
  wanda_unstructured = cached("wanda", pruned(wanda("unstructured")))
  two_four = cached("2:4", pruned(prune.two_four_masks))
  wanda_two_four = cached("2:4 wanda", pruned(wanda("2:4")))
  sparsegpt = lambda pattern: pruned(lambda m: prune.sparsegpt(  # noqa: E731
      m, calibration=task.calibration, forward=task.forward, pattern=pattern, **unstructured(pattern)),
      reconstructs=True)
  sparsegpt_unstructured = cached("sparsegpt", sparsegpt("unstructured"))
  sparsegpt_two_four = cached("2:4 sparsegpt", sparsegpt("2:4"))
  int8_on = lambda build: lambda: (quantization.quantize(build()[0], "weight_only"), {})  # noqa: E731
  float_only = lambda build: lambda: (build(), {})  # noqa: E731
  builds = [
      ("fp32", float_only(lambda: task.model)),
      ("bf16", float_only(bf16)),
      ("int8 weight-only", float_only(lambda: quantization.quantize(task.model, "weight_only"))),
      ("int8 W8A8", float_only(lambda: quantization.quantize(task.model, "w8a8", **calibrated))),
      ("int8 W8A8 dynamic", float_only(lambda: quantization.quantize(task.model, "w8a8_dynamic"))),
      ("int8 W8A8 smooth",
       float_only(lambda: quantization.quantize(task.model, "w8a8", smoothing=smoothing, **calibrated))),
      ("int8 W8A8 smooth dynamic",
       float_only(lambda: quantization.quantize(task.model, "w8a8_dynamic", smoothing=smoothing, **calibrated))),
      # The control: the same fine-tune with nothing pruned, what the steps alone lift the model by.
      ("fp32 fine-tuned", cached("dense", pruned(lambda m: prune.magnitude_masks(m, 0.0, per_layer=True)))),
      ("50% magnitude", magnitude),
      ("50% magnitude per layer", per_layer),
      ("50% wanda", wanda_unstructured),
      ("50% sparsegpt", sparsegpt_unstructured),
      ("2:4", two_four),
      ("2:4 wanda", wanda_two_four),
      ("2:4 sparsegpt", sparsegpt_two_four),
      ("50% magnitude + int8", int8_on(magnitude)),
      ("50% per layer + int8", int8_on(per_layer)),
      ("50% wanda + int8", int8_on(wanda_unstructured)),
      ("50% sparsegpt + int8", int8_on(sparsegpt_unstructured)),
      ("2:4 + int8", int8_on(two_four)),
      ("2:4 wanda + int8", int8_on(wanda_two_four)),
      ("2:4 sparsegpt + int8", int8_on(sparsegpt_two_four)),
  ]
  assert tuple(name for name, _ in builds) == VARIANTS
  return [(shown, build) for shown, (_, build) in zip(variant_names(sparsity), builds)]


def selected_names(names: list[str], sparsity: float = 0.5) -> set[str]:
  """The fp32 baseline and the variants named (spaces or underscores); an unknown name is an error."""
  known = variant_names(sparsity)
  wanted = {n.replace("_", " ") for n in names} if names else set(known)
  unknown = sorted(wanted - set(known))
  if unknown:
    raise ValueError(f"--variants: {unknown[0].replace(' ', '_')!r} is not a variant; known: "
                     f"{', '.join(n.replace(' ', '_') for n in known)}")
  return wanted | {"fp32"}


def measure(task, name: str, model, out_dir: str, extra: dict | None = None, reference: dict | None = None
            ) -> dict:
  """One variant's row. A classifier's first row (fp32) leaves its predictions in `reference`; later rows get their
  prediction flips and the 95% interval of their change vs fp32 from them (jaxlm.training.metrics.paired_change)."""
  import jax  # noqa: PLC0415
  from flax import nnx  # noqa: PLC0415

  from jaxlm.compress import checkpoint_files, prune, quantization
  from jaxlm.recipes.trained_runs import PREDICTIONS  # noqa: PLC0415
  from jaxlm.training import metrics as metrics_lib  # noqa: PLC0415
  from jaxlm.training import telemetry

  model = checkpoint_files.place(model, task.mesh)
  row = dict(task.evaluate(model))
  if PREDICTIONS in row and reference is not None:
    labels, predictions, classes = row.pop(PREDICTIONS)
    if PREDICTIONS not in reference:
      reference[PREDICTIONS] = predictions
    else:
      change = metrics_lib.paired_change(labels, reference[PREDICTIONS], predictions, classes)
      row["flips_vs_fp32"] = change.pop("flips")
      row.update({k.replace("_change_", "_change_points_"): 100 * v for k, v in change.items()})
  row.pop(PREDICTIONS, None)
  row.update(extra or {})
  if task.kind == "lm" and _LM_EVAL_TASKS.value:
    row.update(lm_eval_metrics(model, task.tokenizer))
  graphdef, params = nnx.split(model)
  run = jax.jit(lambda p, b: task.forward(nnx.merge(graphdef, p), b))
  batch = {k: jax.device_put(v) for k, v in task.timing_batch.items()}
  latency = telemetry.best_seconds(run, params, batch, repeats=_REPEATS.value, warmup=2)
  row["latency_ms"] = latency * 1e3
  row[f"{task.unit}_per_sec"] = task.items_per_batch / latency
  row["param_bytes"] = quantization.param_bytes(params.to_pure_dict())
  folder = os.path.join(out_dir, name.replace(" ", "_").replace("%", "pct").replace(":", "of").replace("+", "plus"))
  if os.path.exists(folder):
    shutil.rmtree(folder)
  checkpoint_files.save(model, folder)
  row["checkpoint_bytes"] = checkpoint_files.directory_bytes(folder)
  row["mode"] = quantization.mode_of(model)
  if row["mode"] == "float":
    row["sparsity"] = prune.weight_sparsity(model)
  return row


def lm_eval_metrics(model, tokenizer) -> dict:
  """This variant's downstream metrics on --lm_eval_tasks (jaxlm.interop.lm_eval_model), keyed
  lm_eval/<task>/<metric>."""
  from jaxlm.interop import lm_eval_model

  metrics = lm_eval_model.task_metrics(model, tokenizer, _LM_EVAL_TASKS.value, include_path=_LM_EVAL_INCLUDE.value,
                                 limit=_LM_EVAL_LIMIT.value or None)
  return {f"lm_eval/{key}": value for key, value in metrics.items()}


def main(argv):
  del argv  # flags only: cli.run refuses positional arguments
  logging.set_verbosity(logging.WARNING)
  from jaxlm import config as config_lib  # noqa: PLC0415

  from jaxlm.recipes import trained_runs  # noqa: PLC0415

  trained_runs.chosen_folder(_WORKDIR.value, _INIT_FROM.value)  # exactly one of the two
  check_flags()  # before anything loads: a wrong value or a misspelt name fails at once
  wanted = selected_names(_VARIANTS.value, _SPARSITY.value)
  data = dict(calibration_batches=_CALIBRATION.value, finetune_steps=_PRUNE_STEPS.value,
              finetune_orders=_PRUNE_SOUP.value)
  if _INIT_FROM.value:
    kind = trained_runs.check_decoder_folder(_INIT_FROM.value)  # before the text is read or the weights load
    if _PRUNE_LIKE_RUN.value and kind == "hf":
      raise ValueError("--prune_finetune_like_run reuses the run's optimizer; an HF folder has none (use the default "
                       "AdamW at --prune_finetune_lr)")
    check_lm_eval_tasks()
    task = trained_runs.text_lm_task(_INIT_FROM.value, _EVAL_TEXT.value, calibration_files=_CALIBRATION_TEXT.value,
                                     text_column=_TEXT_COLUMN.value, seq_len=_SEQ_LEN.value, batch_size=_BATCH.value,
                                     max_eval_batches=_MAX_EVAL.value, mesh_tensor=_TENSOR.value, **data)
    optimize(task, wanted, _OUTPUT_DIR.value)
    return
  workdir = _WORKDIR.value
  config_path = os.path.join(workdir, "config.json")
  if not os.path.exists(config_path):
    raise FileNotFoundError(f"{config_path} does not exist; give a train_lm.py or finetune.py run folder")
  trained_runs.check_not_hf_folder(workdir)
  config = config_lib.from_run_file(config_path)
  if _LM_EVAL_TASKS.value and config.model.flavour == "bert":
    raise ValueError(f"--lm_eval_tasks scores decoders; {workdir} is a classifier run (model.flavour=bert)")
  check_lm_eval_tasks()
  if config.model.flavour == "bert":
    task = trained_runs.classifier_task(workdir, config, finetune_seed=_PRUNE_SEED.value,
                                        distill_files=tuple(_DISTILL.value), distill_temperature=_DISTILL_T.value,
                                        **data)
  elif _DISTILL.value:
    raise ValueError(f"--prune_distill_files is for classifier runs; {workdir} is an LM run, whose masked fine-tune "
                     "already trains on unlabelled text (its own)")
  else:
    task = trained_runs.lm_task(workdir, config, max_eval_batches=_MAX_EVAL.value, **data)
  optimize(task, wanted, _OUTPUT_DIR.value or workdir)


def check_lm_eval_tasks() -> None:
  """Before the variants run: an unknown --lm_eval_tasks task, or one needing a download, is a one-line error."""
  if _LM_EVAL_TASKS.value:
    from jaxlm.interop import lm_eval_model  # noqa: PLC0415 (the optional lm-eval)
    lm_eval_model.check_offline(lm_eval_model.task_manager(_LM_EVAL_TASKS.value, _LM_EVAL_INCLUDE.value),
                                _LM_EVAL_TASKS.value)


def optimize(task, wanted: set[str], out: str) -> None:
  """Measures the `wanted` variants of `task` (a trained_runs.TrainedRun) and writes the results to `out`."""
  os.makedirs(out, exist_ok=True)
  out_dir = os.path.join(out, "optimize")
  rows, reference = {}, {}
  for name, build in variants(task):
    if name not in wanted:
      continue
    started = time.time()
    model, extra = build()
    rows[name] = measure(task, name, model, out_dir, extra, reference)
    shown = {k: round(v, 5) if isinstance(v, float) else v for k, v in rows[name].items()}
    print(f"{name}: {shown} ({time.time() - started:.0f} s)", flush=True)
  if not _KEEP.value:
    shutil.rmtree(out_dir, ignore_errors=True)
  command = "python experiments/optimize.py " + " ".join(a for a in __import__("sys").argv[1:])
  from jaxlm.training import report  # noqa: PLC0415
  print(report.write_optimization(out, rows, kind=task.kind, unit=task.unit, items_per_batch=task.items_per_batch,
                                  repeats=_REPEATS.value, command=command))


if __name__ == "__main__":
  from jaxlm import cli  # noqa: PLC0415

  cli.run(main)
