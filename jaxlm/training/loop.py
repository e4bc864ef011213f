"""THE training loop. The steps it runs (jitted, sharded, state donated) are in jaxlm/training/steps.py. Metrics stay on
the device and are read one step late, so the host never waits for the device.

Every kind of run goes through one loop, `run_loop`: pretraining, classifier fine-tuning and instruction tuning
(jaxlm/recipes/) each describe themselves as a `Task` (their steps, data, per-step counts, evaluation and report),
and the loop does the rest: resume, stop signals, non-finite steps, metric windows, eval cadence, checkpoints and
report.md.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import Mesh

from jaxlm import data as data_lib
from jaxlm import kernels as kernels_lib
from jaxlm.config import Config
from jaxlm.kernels import Kernels
from jaxlm.parallel import sharding
from jaxlm.training import atomic_files, reliability, report, telemetry
from jaxlm.training import steps as steps_lib
from jaxlm.training.checkpoint import Checkpointer, abstract_with_shardings
from jaxlm.training.state import Features, TrainState

# ----------------------------------------------------------------------------------------------- the loop


@dataclasses.dataclass
class Task:
  """One kind of run, as `run_loop` sees it: the parts that differ between kinds. Each recipe in jaxlm/recipes/
  (pretraining, classifier fine-tuning, instruction tuning) builds one."""
  title: str  # report.md's heading: "Training run", "Fine-tuning run"
  state: TrainState  # freshly initialised (jaxlm.training.state.init_train_state); the loop takes it over or restores
  state_shardings: Any
  train_step: Callable  # jitted (state, global batch) -> (state, metrics on the device), from `steps_lib.jit_steps`
  batches: Any  # endless iterator over this process's rows of each global batch; get_state() / set_state(dict)
  count: Callable[[dict], dict[str, float]]  # (this process's rows) -> host-side counts of the global batch:
  # each count becomes `<name>_per_sec` in the metrics, except "flops", which becomes `mfu`
  evaluate: Callable[[int, Any], dict[str, float]]  # (step, params) -> the eval entries of that step's metrics
  finish: Callable[[RunEnd], Report]  # the report of a completed run
  # The state the first step takes, from the restored (start_step > 0) or fresh one: fine-tuning loads init_from.
  start: Callable[[TrainState, int], TrainState] = lambda state, start_step: state
  # (the state before the step, the step, this process's rows of its batch) -> the rows the step takes: an on-policy
  # task (jaxlm/recipes/policy_optimization.py) samples its rollouts here from the current parameters
  prepare: Callable[[TrainState, int, Any], Any] = lambda state, step, rows: rows
  # step -> host-side metrics of that step (an on-policy task's rollout statistics), averaged into its line
  host_metrics: Callable[[int], dict[str, float]] = lambda step: {}
  renames: dict[str, str] = dataclasses.field(default_factory=dict)  # metric -> name in metrics.jsonl
  features: Features = Features()  # the run's optional features: its model params, metrics and facts come from them


@dataclasses.dataclass
class RunEnd:
  """What the loop hands `Task.finish` when a run has reached train.steps."""
  state: TrainState
  last: dict[str, Any]  # the last line written to metrics.jsonl (empty when this run took no step)
  eval: dict[str, Any]  # the final evaluation, as `Task.evaluate` returned it
  facts: dict[str, Any]  # steps, resumed_from_step, devices, mesh, device kind, peak FLOP/s, wall time
  rates: dict[str, float]  # tokens_per_sec, mfu, ... over this run's steps after its first; empty when none


@dataclasses.dataclass
class Report:
  """What a task puts into report.md at the end of a completed run, and what the run returns."""
  summary: dict[str, Any]  # the summary table, after the loss figures read from metrics.jsonl
  result: dict[str, Any] | None = None  # what the run returns; None: `summary`
  sections: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (heading, markdown) before the config
  sample_text: str | None = None
  data_stats: dict[str, Any] | None = None


def prepare_run(config: Config, workdir: str, causal: bool = True) -> tuple[Config, Mesh, Kernels]:
  """What every run checks and settles before building anything: the workdir is a folder (created), the mesh fits
  the devices, the batch splits over the data axes, the micro-batches and the processes, and config.kernels resolves
  for this platform, compute dtype and mesh (`causal`: a decoder's attention; printed once). Returns the config with
  the resolved kernels in place of `auto` (what config.json and report.md record), the mesh and the kernels."""
  kernels_lib.validate_kernels(config.kernels)  # names the registry lists, before anything is written
  if os.path.exists(workdir) and not os.path.isdir(workdir):
    raise ValueError(f"--workdir={workdir!r} is a file, not a folder; give a folder path (it is created)")
  os.makedirs(workdir, exist_ok=True)
  mesh = sharding.make_mesh(config.mesh)
  num_data_shards = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape[sharding.EXPERT_AXIS]
  t = config.train
  if t.batch_size % (num_data_shards * t.grad_accum):
    raise ValueError(
        f"train.batch_size={t.batch_size} must be divisible by mesh.data*mesh.fsdp*mesh.expert*train.grad_accum="
        f"{num_data_shards * t.grad_accum}")
  if t.batch_size % jax.process_count():
    raise ValueError(f"train.batch_size={t.batch_size} is not divisible by the {jax.process_count()} processes")
  kernels = kernels_lib.resolve(config.kernels, compute_dtype=config.model.compute_dtype, causal=causal,
                                mesh=mesh, **config.model.kernel_needs)
  if jax.process_index() == 0:
    print(f"kernels: {kernels.describe()}", flush=True)
  return dataclasses.replace(config, kernels=kernels.as_config()), mesh, kernels


def run_loop(config: Config, workdir: str, mesh: Mesh, task: Task, stop: reliability.StopSignals,
             stop_at_step: int | None = None, started: float | None = None) -> dict:
  """Runs `task` to step train.steps, from the latest checkpoint in `workdir` if there is one.

  Each step: the next batch; the jitted train step (which skips a non-finite update on the device); the metrics of
  the previous step (read one step late, so the host never waits for the device); the task's evaluation on eval
  steps (every train.eval_every_steps and at the end); a checkpoint of the state and the data position (every
  checkpoint.every_steps, at the end, and when stopping). metrics.jsonl gets one line at the run's first step,
  every log.every_steps, at eval steps and at the end: the means over the steps since the previous line.

  Returns `task.finish`'s result, with report.md written, when the run reaches train.steps. A stop signal
  (SIGTERM/SIGINT, reliability.StopSignals) or `stop_at_step` ends the run early after checkpointing the current
  step: it returns the last logged metrics (with `preempted_at_step` after a signal or at stop_at_step), and running again resumes
  there bit for bit. Raises reliability.NonFiniteError after train.max_consecutive_nonfinite skipped steps in a row,
  without saving again (the checkpoints so far hold finite, pre-skip states).
  """
  t = config.train
  started = time.time() if started is None else started
  state, task.state = task.state, None  # the loop owns the state from here (each step donates it)

  # Resume: the newest readable checkpoint that fits this run, with the data position it was saved at (unreadable
  # ones are moved aside, mismatched ones raise).
  checkpointer = Checkpointer(os.path.join(workdir, "checkpoints"), config.checkpoint.every_steps,
                              config.checkpoint.keep)
  restored = checkpointer.restore_latest(abstract_with_shardings(state, task.state_shardings), config.model)
  start_step = 0
  if restored is not None:
    start_step, state, data_state = restored
    data_lib.set_loader_state(task.batches, data_state)
  state = task.start(state, start_step)
  last: dict[str, Any] = {}  # the last line written
  if start_step >= t.steps:  # nothing left to run: the summary starts from the run's last logged line
    logged = report.read_metrics(workdir)
    last = {k: v for k, v in logged[-1].items() if k != "step"} if logged else {}
  atomic_files.write_json_on_process_0(os.path.join(workdir, "config.json"), dataclasses.asdict(config))

  peak_per_device, peak_source = telemetry.peak_flops_per_device(dtype=config.model.compute_dtype)
  peak_flops = peak_per_device * jax.device_count()
  writer = telemetry.MetricsWriter(workdir, start_step=start_step)
  bar = telemetry.ProgressBar(t.steps, initial_step=start_step, enable=config.log.progress_bar)
  nonfinite = reliability.NonFiniteCounter(t.max_consecutive_nonfinite)
  entries = task.features.entries
  expected_skip_metrics = [e.expected_skip_metric for e in entries if e.expected_skip_metric]
  summed_metrics = tuple(k for e in entries for k in e.summed_metrics)
  last_metrics = tuple(k for e in entries for k in e.last_metrics)
  failure: str | None = None  # set when too many non-finite steps in a row end the run
  window: list[dict] = []  # device metrics of the steps since the last line
  window_times = telemetry.StepTimes()  # host counts and seconds of the timed steps since the last line
  run_times = telemetry.StepTimes()  # ... and of this run
  final_eval: dict[str, Any] | None = None
  clock = time.perf_counter()

  def finish_step(step: int, device_metrics: dict, counts: dict, eval_metrics: dict | None) -> None:
    """Step `step`'s bookkeeping, one step late: its time, the non-finite count, and on a log step the line."""
    nonlocal last, failure, clock
    # Waiting for step s while step s + 1 runs keeps one step in flight: the host still prepares the next batch in
    # parallel, and on simulated CPU devices two multi-device steps in flight can starve each other's collectives.
    jax.block_until_ready(device_metrics)
    now = time.perf_counter()
    if step > start_step + 1:  # the first step of a run holds the compile: it is not timed
      window_times.add(counts, now - clock)
      run_times.add(counts, now - clock)
    clock = now
    # A feature may mark a skip as expected, not a divergence (docs/reliability.md).
    expected = any(bool(device_metrics[k]) for k in expected_skip_metrics)
    failure = failure or nonfinite.update(step, bool(device_metrics["skipped_steps"]), expected=expected)
    window.append({**device_metrics, **task.host_metrics(step)})
    if not (step == start_step + 1 or step % config.log.every_steps == 0 or eval_metrics or step == t.steps):
      bar.update(step)
      return
    last = window_metrics(jax.device_get(window), task.renames, summed_metrics, last_metrics)
    last["skipped_steps_total"] = nonfinite.total
    last.update({task.renames.get(k, k): v for k, v in window_times.rates(peak_flops).items()})
    last.update(eval_metrics or {})
    writer.write(step, last)
    window.clear()
    window_times.clear()
    accuracy = {"acc": last[k] for k in ("train_accuracy", "eval_accuracy") if k in last}  # the eval's, if any
    bar.update(step, loss=last["loss"], **accuracy, tokens_per_sec=last.get("tokens_per_sec"), mfu=last.get("mfu"))

  # A stop signal during set-up ends the run before its first step: the latest checkpoint is still the one to use.
  stopped_at = start_step if reliability.should_stop(stop.requested, start_step) else None
  pending = None  # (step, device metrics, host counts, eval entries) of the previous step
  for step in range(start_step + 1, t.steps + 1):
    if stopped_at is not None:
      break
    local_batch = task.prepare(state, step, next(task.batches))
    counts = task.count(local_batch)
    state, metrics = task.train_step(state, steps_lib.to_global_batch(local_batch, mesh))
    if pending is not None:
      finish_step(*pending)
      pending = None
    if failure:  # stop before evaluating or saving again; checkpoints so far hold finite (pre-skip) states
      break
    eval_metrics = None
    if step == t.steps or (t.eval_every_steps and step % t.eval_every_steps == 0):
      # Eval time is not train time, but the step's own time is: the step ends before the evaluation starts (a clock
      # reset after it would time the step as ~0 s, and its line's MFU far above 100%).
      jax.block_until_ready(metrics)
      eval_started = time.perf_counter()
      eval_metrics = final_eval = task.evaluate(step, task.features.model_params(state))
      clock += time.perf_counter() - eval_started
    pending = (step, metrics, counts, eval_metrics)
    if reliability.should_stop(stop.requested, step) or step == stop_at_step:
      stopped_at = step
    if step == t.steps or stopped_at is not None or checkpointer.should_save(step):
      checkpointer.save(step, state, data_lib.get_loader_state(task.batches), config.model)
  if pending is not None:
    finish_step(*pending)
  bar.close()
  checkpointer.close()  # waits for the last save: a preempted run exits only once its checkpoint is complete
  writer.close()
  if failure:
    raise reliability.NonFiniteError(failure)
  if stopped_at is not None and stopped_at < t.steps:  # a signal or stop_at_step: the same checkpointed stop
    last["preempted_at_step"] = stopped_at
    return last

  if final_eval is None:  # resumed at the last step: evaluate the restored state
    final_eval = task.evaluate(t.steps, task.features.model_params(state))
  facts = {
      "steps": t.steps, "resumed_from_step": start_step, "devices": jax.device_count(),
      "mesh": "x".join(str(mesh.shape[a]) for a in sharding.MESH_AXES), "device_kind": jax.devices()[0].device_kind,
      "peak_flops_per_device": peak_per_device, "peak_flops_source": peak_source,
      "wall_time_sec": round(time.time() - started, 1),
      **task.features.report_facts(config, mesh, state),
  }
  rates = {task.renames.get(k, k): v for k, v in run_times.rates(peak_flops).items()}
  rates = {**rates, "timed_steps": run_times.steps} if run_times.steps else {}
  finished = task.finish(RunEnd(state, last, final_eval, facts, rates))
  report.write_report(workdir, title=f"{task.title} {os.path.basename(os.path.abspath(workdir))}",
                      summary=finished.summary, config_text=json.dumps(dataclasses.asdict(config), indent=2),
                      sample_text=finished.sample_text, data_stats=finished.data_stats,
                      extra_sections=finished.sections)
  return finished.summary if finished.result is None else finished.result


def window_metrics(fetched: list[dict], renames: dict[str, str] | None = None, summed: tuple[str, ...] = (),
                   last: tuple[str, ...] = ()) -> dict[str, float]:
  """One metrics line from the train-step metrics of the steps since the previous line: each metric's mean over
  the steps whose update was applied (a skipped step's NaN stays out), learning_rate and param_norm at the last
  step, and skipped_steps as a count; the features' `summed` metrics as counts and their `last` ones at the last
  step (e.g. overflow_steps; the scale and its running total); `renames` maps train-step names to the
  line's."""
  applied = [m for m in fetched if not m["skipped_steps"]] or fetched
  line = {k: float(np.mean([m[k] for m in applied])) for k in fetched[-1]}
  line.update({k: float(sum(m[k] for m in fetched)) for k in ("skipped_steps", *summed)})
  line.update({k: float(fetched[-1][k]) for k in ("learning_rate", "param_norm", *last)})
  return {(renames or {}).get(k, k): v for k, v in line.items()}
