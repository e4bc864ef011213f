"""Train state, the pure train and eval steps, and the training loop.

The model is split once into a static graph definition and a pure-dict parameter tree; the steps are plain
`jax.jit` functions of (state, batch) with explicit shardings and a donated state, so nothing walks the module graph
in the hot loop. Metrics stay on the device and are read one step late, so the host never waits for the device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from jaxlm import data as data_lib
from jaxlm import cross_entropy, files, generate, optim, reliability, sharding, telemetry
from jaxlm.evaluate import lm_metrics
from jaxlm.checkpoint import Checkpointer, abstract_with_shardings
from jaxlm.config import Config, ModelConfig
from jaxlm.models.gpt import GPT

TrainState = dict  # {"step": int32 [], "params": pure dict of f32 arrays, "opt_state": optax state}
ModelFactory = Any  # Callable[[nnx.Rngs], nnx.Module]: builds the model to train (default: the GPT of the config)


# ----------------------------------------------------------------------------------------------- model and state


def abstract_model(config: ModelConfig, make_model: ModelFactory | None = None) -> tuple[nnx.GraphDef, nnx.State]:
  """Graph definition and parameter shapes, without allocating any parameter."""
  make_model = make_model or (lambda rngs: GPT(config, rngs=rngs))
  return nnx.split(nnx.eval_shape(lambda: make_model(nnx.Rngs(0))))


def check_mesh_fits_model(config: ModelConfig, mesh: Mesh) -> None:
  hint = "choose a mesh.tensor that divides it"
  sharding.check_divisible("model.num_heads", config.num_heads, mesh, "tensor", hint)
  sharding.check_divisible("model MLP width", config.mlp_width, mesh, "tensor", hint)


def init_train_state(config: Config, mesh: Mesh, optimizer: optax.GradientTransformation,
                     make_model: ModelFactory | None = None) -> tuple[nnx.GraphDef, TrainState, Any]:
  """Initialises parameters and optimizer state directly in their shardings (never whole on one device).

  `make_model(rngs)` builds another model than the config's GPT (fine-tuning passes a BERT classifier)."""
  check_mesh_fits_model(config.model, mesh)
  make_model = make_model or (lambda rngs: GPT(config.model, rngs=rngs))
  graphdef, abstract_params = abstract_model(config.model, make_model)
  param_shardings = sharding.param_shardings(abstract_params, mesh)

  def init():
    params = nnx.split(make_model(nnx.Rngs(config.train.seed)))[1].to_pure_dict()
    return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": optimizer.init(params)}

  abstract_state = jax.eval_shape(init)
  state_shardings = {
      "step": sharding.replicated(mesh),
      "params": param_shardings,
      # Optimizer moments mirror the parameters' shardings; counters and other scalars are replicated.
      "opt_state": optax.tree_map_params(
          optimizer, lambda _, s: s, abstract_state["opt_state"], param_shardings,
          transform_non_params=lambda _: sharding.replicated(mesh)),
  }
  state = jax.jit(init, out_shardings=state_shardings)()
  return graphdef, state, state_shardings


# ----------------------------------------------------------------------------------------------- steps


def make_loss_fn(graphdef: nnx.GraphDef) -> optim.SumLossFn:
  """Sum of token cross-entropies over valid tokens, the valid-token count, and summed aux metrics."""

  def loss_fn(params, batch):
    model = nnx.merge(graphdef, params)
    if getattr(getattr(model, "config", None), "cross_entropy_chunk", 0):  # fused: no [B, T, V] logits
      return fused_loss(model, batch)
    logits_BTV = model(batch["inputs"], batch["positions"], batch["segment_ids"])
    losses_BT = optax.softmax_cross_entropy_with_integer_labels(logits_BTV, batch["targets"])
    mask_BT = batch["loss_mask"].astype(jnp.float32)
    correct_BT = (jnp.argmax(logits_BTV, axis=-1) == batch["targets"]).astype(jnp.float32)
    count = mask_BT.sum()
    return (losses_BT * mask_BT).sum(), (count, {"correct": (correct_BT * mask_BT).sum()})

  return loss_fn


def fused_loss(model: GPT, batch: dict):
  """make_loss_fn's (loss sum, (count, {"correct"})) through jaxlm.cross_entropy, model.cross_entropy_chunk tokens
  at a time (tested equal to the logits path in tests/test_perf_options.py)."""
  features_BTD = model.features(batch["inputs"], batch["positions"], batch["segment_ids"])
  b, t, d = features_BTD.shape
  mask_BT = batch["loss_mask"].astype(jnp.float32)
  loss_sum, correct = cross_entropy.fused_cross_entropy(
      features_BTD.reshape(b * t, d), model.output_table(), batch["targets"].reshape(b * t), mask_BT.reshape(b * t),
      model.config.cross_entropy_chunk, model.policy)
  return loss_sum, (mask_BT.sum(), {"correct": correct})


def resolve_gradient_sync(gradient_sync: str, mesh_shape: dict[str, int], grad_accum: int) -> str:
  """`auto` -> `shard_map` for pure data parallelism with accumulation, else `gspmd`.

  Under GSPMD every micro-batch's gradient is all-reduced inside the accumulation loop (the replicated accumulator
  needs a replicated addend): grad_accum times the bytes on the CPU (XLA:CPU has no pass that hoists the
  reduction out of the loop; XLA:GPU/TPU may). The shard_map path accumulates each device's own sums and reduces
  once. With FSDP or TP the parameters are sharded and GSPMD's per-micro-batch reduce-scatter is what keeps the
  gradient memory sharded, so `auto` keeps GSPMD there."""
  if gradient_sync != "auto":
    return gradient_sync
  pure_data = mesh_shape.get("fsdp", 1) == 1 and mesh_shape.get("tensor", 1) == 1 and mesh_shape.get("data", 1) > 1
  return "shard_map" if pure_data and grad_accum > 1 else "gspmd"


def make_gradient_fn(loss_fn: optim.SumLossFn, grad_accum: int, mesh: Mesh | None = None,
                     gradient_sync: str = "auto"):
  """(params, batch) -> (mean loss, token count, gradients, aux).

  `gspmd` leaves the collectives to GSPMD. `shard_map` writes the data-parallel reduction by hand: each device
  computes its shard's loss and gradient sums, one `psum` over the batch axes adds them up, then every device
  divides by the global token count. Parameters enter replicated (FSDP/TP shards are all-gathered at the boundary),
  so this path is data parallelism with an explicit collective, tested equal to `gspmd`. `auto`: see
  `resolve_gradient_sync`.
  """
  if resolve_gradient_sync(gradient_sync, dict(mesh.shape) if mesh is not None else {}, grad_accum) == "gspmd":
    return lambda params, batch: optim.accumulate_gradients(loss_fn, params, batch, grad_accum)
  batch_axes = sharding.RULES["act_batch"]

  def per_shard(params, batch):
    return optim.accumulate_gradients(loss_fn, params, batch, grad_accum,
                                      reduce_sums=lambda sums: jax.lax.psum(sums, batch_axes))

  # check_vma=False: with it on, autodiff already sums the gradient of a replicated input over devices (the
  # transpose of its implicit broadcast), and the psum above would count every shard once per device.
  return jax.shard_map(per_shard, mesh=mesh, in_specs=(P(), P(batch_axes)), out_specs=P(), check_vma=False)


def make_train_step(graphdef: nnx.GraphDef, optimizer: optax.GradientTransformation, grad_accum: int,
                    schedule: optax.Schedule, mesh: Mesh | None = None, gradient_sync: str = "auto",
                    loss_fn: optim.SumLossFn | None = None):
  """`loss_fn` (default: the LM's token cross-entropy) returns (loss sum, (count, {"correct": ...})); the metric
  `token_accuracy` is correct / count, i.e. example accuracy for a classification loss."""
  gradient_fn = make_gradient_fn(loss_fn or make_loss_fn(graphdef), grad_accum, mesh, gradient_sync)

  def train_step(state: TrainState, batch: dict) -> tuple[TrainState, dict]:
    loss, count, grads, aux = gradient_fn(state["params"], batch)
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    params = optax.apply_updates(state["params"], updates)
    grad_norm, update_norm = global_norm(grads), global_norm(updates)
    # A NaN/inf loss, gradient or update skips the update on the device (no host sync): params and optimizer
    # state keep their old values bit for bit (so Adam's count only counts applied updates); `step` still
    # advances, as it counts batches consumed. The loop counts skips and stops after too many in a row.
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm) & jnp.isfinite(update_norm)
    params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                     (params, opt_state), (state["params"], state["opt_state"]))
    metrics = {
        "loss": loss,
        "token_accuracy": aux["correct"] / jnp.maximum(count, 1.0),
        "tokens": count,
        "grad_norm": grad_norm,
        "update_norm": update_norm,
        "param_norm": global_norm(params),
        "learning_rate": schedule(state["step"]),
        "skipped_steps": 1.0 - finite.astype(jnp.float32),  # 1 when this step's update was skipped
    }
    return {"step": state["step"] + 1, "params": params, "opt_state": opt_state}, metrics

  return train_step


def global_norm(tree: Any) -> jax.Array:
  return jnp.sqrt(sum(jnp.sum(jnp.square(x.astype(jnp.float32))) for x in jax.tree.leaves(tree)))


def make_eval_step(graphdef: nnx.GraphDef):
  loss_fn = make_loss_fn(graphdef)

  def eval_step(params, batch):
    loss_sum, (count, aux) = loss_fn(params, batch)
    return {"loss_sum": loss_sum, "tokens": count, "correct": aux["correct"]}

  return eval_step


def jit_steps(graphdef, optimizer, config: Config, mesh: Mesh, state_shardings):
  """The train and eval steps, each compiled once, with explicit shardings and the train state donated."""
  batch_sharding = sharding.batch_sharding(mesh)
  schedule = optim.learning_rate_schedule(config.train)
  overrides = sharding.rule_overrides(config.mesh)
  train_step = jax.jit(sharding.traced_on(mesh, make_train_step(graphdef, optimizer, config.train.grad_accum,
                                                                  schedule, mesh, config.mesh.gradient_sync),
                                          overrides),
                       in_shardings=(state_shardings, batch_sharding),
                       out_shardings=(state_shardings, sharding.replicated(mesh)), donate_argnums=0)
  eval_step = jax.jit(sharding.traced_on(mesh, make_eval_step(graphdef), overrides),
                      in_shardings=(state_shardings["params"], batch_sharding), out_shardings=sharding.replicated(mesh))
  return train_step, eval_step


def to_global_batch(local_batch: dict, mesh: Mesh) -> dict:
  """Assembles each process's rows into one global array sharded over the batch axes."""
  return {k: jax.make_array_from_process_local_data(sharding.batch_sharding(mesh, v.ndim), v)
          for k, v in local_batch.items()}


def evaluate(eval_step, params, batches: list[dict], mesh: Mesh) -> dict:
  totals = None
  for batch in batches:
    out = eval_step(params, to_global_batch(batch, mesh))
    totals = out if totals is None else jax.tree.map(jnp.add, totals, out)
  totals = jax.device_get(totals)
  return lm_metrics(totals["loss_sum"], totals["tokens"], totals["correct"])


# ----------------------------------------------------------------------------------------------- the loop


def train(config: Config, workdir: str, stop_at_step: int | None = None) -> dict:
  """Trains (or resumes) a GPT into `workdir`; returns the summary written into report.md.

  `stop_at_step` ends this run early after checkpointing that step (as a preemption would); re-running resumes.
  SIGTERM or SIGINT does the same at the end of the current step: it returns the last logged metrics with
  `preempted_at_step`, and the next run with this workdir resumes exactly there (jaxlm/reliability.py).
  Raises reliability.NonFiniteError after train.max_consecutive_nonfinite skipped (non-finite) steps in a row.
  """
  with reliability.StopSignals() as stop:  # handlers restored on return and on errors
    return _train(config, workdir, stop_at_step, stop)


def prepare_run(config: Config, workdir: str) -> Mesh:
  """What every training loop checks before building anything: the workdir is a folder (created), the mesh fits
  the devices, and the batch splits over the data axes, the micro-batches and the processes. Returns the mesh."""
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"--workdir={workdir!r} is a file, not a folder; give a folder path (it is created)")
  os.makedirs(workdir, exist_ok=True)
  mesh = sharding.make_mesh(config.mesh)
  num_data_shards = mesh.shape["data"] * mesh.shape["fsdp"]
  t = config.train
  if t.batch_size % (num_data_shards * t.grad_accum):
    raise ValueError(
        f"train.batch_size={t.batch_size} must be divisible by mesh.data*mesh.fsdp*train.grad_accum="
        f"{num_data_shards * t.grad_accum}")
  if t.batch_size % jax.process_count():
    raise ValueError(f"train.batch_size={t.batch_size} is not divisible by the {jax.process_count()} processes")
  return mesh


def _train(config: Config, workdir: str, stop_at_step: int | None, stop: reliability.StopSignals) -> dict:
  started = time.time()
  mesh = prepare_run(config, workdir)
  t = config.train

  datasets = data_lib.build_datasets(config.data, config.model.vocab_size, workdir, t.seed)
  optimizer = optim.make_optimizer(t)
  graphdef, state, state_shardings = init_train_state(config, mesh, optimizer)
  train_step, eval_step = jit_steps(graphdef, optimizer, config, mesh, state_shardings)

  local_batch_size = t.batch_size // jax.process_count()
  iterator = data_lib.make_train_iterator(datasets.train, local_batch_size, t.seed, config.data.shuffle)
  eval_batches = data_lib.eval_batches(datasets.eval, local_batch_size, t.eval_batches)

  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), config.checkpoint.every_steps,
                              config.checkpoint.keep)
  # The newest readable checkpoint that fits this run; unreadable ones are moved aside, mismatched ones raise.
  restored = checkpointer.restore_latest(abstract_with_shardings(state, state_shardings), config.model)
  start_step = 0
  if restored is not None:
    start_step, state, data_state = restored
    data_lib.set_loader_state(iterator, data_state)
  _write_json(os.path.join(workdir, "config.json"), dataclasses.asdict(config))

  peak_per_device, peak_source = telemetry.peak_flops_per_device(dtype=config.model.compute_dtype)
  throughput = telemetry.Throughput(t.batch_size * config.data.seq_len,
                                    telemetry.flops_per_token(config.model, config.data.seq_len),
                                    peak_per_device, jax.device_count())
  writer = telemetry.MetricsWriter(workdir, start_step=start_step)
  bar = telemetry.ProgressBar(t.steps, initial_step=start_step, enable=config.log.progress_bar)
  last: dict[str, Any] = {}
  nonfinite = reliability.NonFiniteCounter(t.max_consecutive_nonfinite)
  failure: str | None = None  # set when too many non-finite steps in a row end the run

  window: list[dict] = []  # device metrics of the steps since the last logged step

  def finish_step(step: int, device_metrics: dict, eval_metrics: dict | None) -> None:
    """Called one step late; logs the mean of each metric over the steps since the last log (state-like metrics,
    learning_rate and param_norm, at this step)."""
    nonlocal last, failure
    # Waiting for step s while step s + 1 runs keeps one step in flight: the host still prepares the next batch in
    # parallel, and on simulated CPU devices two multi-device steps in flight can starve each other's collectives.
    jax.block_until_ready(device_metrics)
    failure = failure or nonfinite.update(step, bool(device_metrics["skipped_steps"]))
    window.append(device_metrics)
    if step == start_step + 1 or step % config.log.every_steps == 0 or eval_metrics or step == t.steps:
      rates = throughput.update(step)
      fetched = jax.device_get(window)
      applied = [m for m in fetched if not m["skipped_steps"]] or fetched  # a skipped step's NaN stays out
      last = {k: float(np.mean([m[k] for m in applied])) for k in fetched[-1]}
      last["skipped_steps"] = float(sum(m["skipped_steps"] for m in fetched))  # a count, not a mean
      last["skipped_steps_total"] = nonfinite.total
      last.update({k: float(fetched[-1][k]) for k in ("learning_rate", "param_norm")})
      last.update({k: v for k, v in rates.items() if v is not None})
      last.update(eval_metrics or {})
      writer.write(step, last)
      window.clear()
      bar.update(step, loss=last["loss"], tokens_per_sec=last.get("tokens_per_sec"), mfu=last.get("mfu"))
    else:
      bar.update(step)

  # A stop signal during set-up ends the run before its first step: the latest checkpoint is still the one to use.
  stopped_at = start_step if reliability.should_stop(stop.requested, start_step) else None
  pending = None  # (step, device metrics, eval metrics) of the previous step
  for step in range(start_step + 1, t.steps + 1):
    if stopped_at is not None:
      break
    batch = to_global_batch(next(iterator), mesh)
    state, metrics = train_step(state, batch)
    if pending is not None:
      finish_step(*pending)
      pending = None
    if failure:  # stop before evaluating or saving again; checkpoints so far hold finite (pre-skip) states
      break
    eval_metrics = None
    if step == t.steps or (t.eval_every_steps and step % t.eval_every_steps == 0):
      eval_metrics = evaluate(eval_step, state["params"], eval_batches, mesh)
    pending = (step, metrics, eval_metrics)
    if reliability.should_stop(stop.requested, step) or step == stop_at_step:
      stopped_at = step
    if step == t.steps or stopped_at is not None or checkpointer.should_save(step):
      checkpointer.save(step, state, data_lib.get_loader_state(iterator), config.model)
  if pending is not None:
    finish_step(*pending)
  bar.close()
  checkpointer.close()  # waits for the last save: a preempted run exits only once its checkpoint is complete
  writer.close()
  if failure:
    raise reliability.NonFiniteError(failure)
  if stopped_at is not None and stopped_at < t.steps:
    if stop.requested:
      last["preempted_at_step"] = stopped_at
    return last

  summary: dict[str, Any] = dict(last)
  summary.update({
      "steps": t.steps, "resumed_from_step": start_step, "devices": jax.device_count(),
      "mesh": "x".join(str(mesh.shape[a]) for a in sharding.MESH_AXES), "device_kind": jax.devices()[0].device_kind,
      "peak_flops_per_device": peak_per_device, "peak_flops_source": peak_source,
      "wall_time_sec": round(time.time() - started, 1),
  })
  summary.update({f"average_{k}": v for k, v in throughput.summary().items() if v is not None})
  sample = None
  if config.log.sample_tokens:  # every process joins the jitted sampler; only process 0 writes the report
    sample = sample_text(graphdef, state["params"], datasets.tokenizer, config.log.sample_prompt,
                         config.log.sample_tokens, config.model.max_seq_len, t.seed, datasets.eos_id)
  telemetry.write_report(workdir, title=f"Training run {os.path.basename(os.path.abspath(workdir))}",
                         summary=summary, config_text=json.dumps(dataclasses.asdict(config), indent=2),
                         sample_text=sample, data_stats=datasets.stats)
  return summary


def sample_text(graphdef, params, tokenizer, prompt: str, num_tokens: int, max_len: int, seed: int,
                eos_id: int | None) -> str:
  prompt_ids = tokenizer.encode(prompt).ids or [eos_id or 0]
  ids = generate.sample_tokens(graphdef, params, prompt_ids, num_tokens, max_len, seed=seed,
                               eos_id=eos_id)
  return tokenizer.decode(ids)


def _write_json(path: str, obj: Any) -> None:
  if jax.process_index() == 0:
    files.write_json(path, obj)
