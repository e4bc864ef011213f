"""Language-model pretraining: a GPT on packed token sequences, next-token loss, held-out perplexity and a sample
in the report, run through THE loop (jaxlm/training/loop.py's `run_loop`)."""

from __future__ import annotations

import os
import time

import jax
from jax.sharding import Mesh

from jaxlm import data as data_lib
from jaxlm.config import Config
from jaxlm.inference import generate
from jaxlm.kernels import Kernels
from jaxlm.recipes import data_defaults, distillation
from jaxlm.recipes import features as features_lib
from jaxlm.training import atomic_files, loop, optim, reliability, telemetry
from jaxlm.training import steps as steps_lib


def train(config: Config, workdir: str, stop_at_step: int | None = None) -> dict:
  """Trains (or resumes) a GPT into `workdir`; returns the summary written into report.md.

  `stop_at_step` ends this run early after checkpointing that step (as a preemption would); re-running resumes.
  SIGTERM or SIGINT does the same at the end of the current step: it returns the last logged metrics with
  `preempted_at_step`, and the next run with this workdir resumes exactly there (jaxlm/training/reliability.py).
  Raises reliability.NonFiniteError after train.max_consecutive_nonfinite skipped (non-finite) steps in a row.
  """
  with reliability.StopSignals() as stop:  # handlers restored on return and on errors
    started = time.time()
    config, mesh, kernels = loop.prepare_run(config, workdir, causal=True)
    task = language_model_task(config, workdir, mesh, kernels)
    return loop.run_loop(config, workdir, mesh, task, stop, stop_at_step, started)


def language_model_task(config: Config, workdir: str, mesh: Mesh, kernels: Kernels) -> loop.Task:
  """Pretraining a GPT on packed token sequences: next-token loss, held-out perplexity, a sample in the report."""
  data_defaults.require_fixed(config, "pretraining (packed token rows)")
  t = config.train
  datasets = data_lib.build_datasets(config.data, config.model.vocab_size, workdir, t.seed)
  optimizer = optim.make_optimizer(t)
  graphdef, state, state_shardings, features = features_lib.train_state_from_config(
      config, mesh, optimizer, features_lib.decoder_factory(config, mesh, kernels))
  tokens = t.batch_size * config.data.seq_len  # every position of the packed rows
  counts = {"tokens": tokens, "flops": tokens * telemetry.flops_per_token(config.model, config.data.seq_len)}
  inputs = None
  if config.distill.teacher:  # the loss becomes the distillation objective; the teacher is a frozen step input
    if config.distill.on_policy:
      raise ValueError("distill.on_policy samples answers to prompts, which pretraining's text has none of; use "
                       "experiments/finetune.py with prompt/response pairs, or set distill.on_policy=0")
    teacher = distillation.load_teacher(config, config.data.seq_len, datasets.tokenizer, "the training data",
                                        "prepare the data with the teacher's tokenizer (data.tokenizer=<teacher "
                                        "folder>/tokenizer.json) and set model.vocab_size to its output rows")
    inputs = distillation.frozen_inputs(config, graphdef, teacher)
    counts["flops"] += tokens * distillation.teacher_flops_per_token(teacher, config.data.seq_len)
  train_step, eval_step = steps_lib.jit_steps(graphdef, optimizer, config, mesh, state_shardings, features,
                                              inputs=inputs)
  local_batch_size = t.batch_size // jax.process_count()
  eval_batches = data_lib.eval_batches(datasets.eval, local_batch_size, t.eval_batches)

  def finish(end: loop.RunEnd) -> loop.Report:
    summary = {**end.last, **end.eval, **end.facts, **{f"average_{k}": v for k, v in end.rates.items()}}
    # The final evaluation as flat numbers, as every recipe writes it (experiments/sweep.py ranks runs by it).
    atomic_files.write_json_on_process_0(os.path.join(workdir, "eval.json"), {
        **end.eval, "step": t.steps, "final_train_loss": end.last.get("loss"),
        "wall_time_sec": end.facts["wall_time_sec"]})
    sample = None
    if config.log.sample_tokens and datasets.tokenizer is not None:  # every process joins the jitted sampler; only process 0 writes the report
      sample = sample_text(graphdef, features.model_params(end.state), datasets.tokenizer,
                           config.log.sample_prompt, config.log.sample_tokens, config.model.max_seq_len, t.seed,
                           datasets.eos_id)
    return loop.Report(summary, sample_text=sample, data_stats=datasets.stats)

  return loop.Task(
      title="Training run", state=state, state_shardings=state_shardings, train_step=train_step,
      batches=data_lib.make_pretraining_batches(datasets, local_batch_size, t.seed, config.data.shuffle),
      count=lambda local_batch: counts,
      evaluate=lambda step, params: steps_lib.evaluate(eval_step, params, eval_batches, mesh),
      finish=finish, features=features)


def sample_text(graphdef, params, tokenizer, prompt: str, num_tokens: int, max_len: int, seed: int,
                eos_id: int | None) -> str:
  prompt_ids = tokenizer.encode(prompt).ids or [eos_id or 0]
  ids = generate.sample_tokens(graphdef, params, prompt_ids, num_tokens, max_len, seed=seed,
                               eos_id=eos_id)
  return tokenizer.decode(ids)
