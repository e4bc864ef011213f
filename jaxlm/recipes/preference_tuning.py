"""Preference tuning a decoder (DPO, IPO, SimPO) on (prompt, chosen, rejected) pairs, through the one training loop.

  init_from   an HF decoder folder or a jaxlm run workdir, loaded as instruction tuning loads it
              (jaxlm/recipes/instruction_tuning.py `load_decoder`): shape, weights, tokenizer, chat template.
  data        jaxlm/data/tuning/preferences.py: TRL's standard and conversational formats, the loss on response
              tokens only; with `preference.padding_free` (the default) whole pairs packed into rows of
              preference.row_pairs padded pairs' slots (jaxlm/data/tuning/pair_packing.py), train.batch_size /
              row_pairs rows a step; without it each pair one [2, T] slot (chosen and rejected in one forward).
  loss        jaxlm/training/preference_loss.py, chosen by `preference.loss`; full or LoRA (`lora.rank`).
  reference   dpo and ipo compare with a reference model: `preference.reference` = "" for init_from's weights before
              the first step (with LoRA: the base, the adapters starting at zero), or a folder. Its summed
              response log-probabilities are computed once, before the first step, for every training and held-out
              pair, and kept in <workdir>/reference_logps.npz (a resumed run reads them): the reference weights are
              never in memory beside the policy's, and the train step runs the policy alone.
  eval        before tuning (start_eval.json) and every train.eval_every_steps and at the end, on every held-out
              pair: eval_preference_loss, eval_reward_accuracy, eval_reward_margin, eval_chosen_logp,
              eval_rejected_logp (means over pairs).
  report      greedy answers to the first held-out prompts before and after tuning (answers.json; report.md shows
              the first beside the chosen and rejected responses); hf_model/ (and adapter/ with LoRA) as
              instruction tuning writes them.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxlm.config import Config
from jaxlm.adapters import lora
from jaxlm.data import make_train_iterator
from jaxlm.data.tuning import instructions as instr_data
from jaxlm.data.tuning import pair_packing
from jaxlm.data.tuning import preferences as pref_data
from jaxlm.inference import generate
from jaxlm.interop import streaming
from jaxlm.kernels import Kernels
from jaxlm.models.gpt import GPT
from jaxlm.parallel import sharding
from jaxlm.recipes import data_defaults
from jaxlm.recipes import features as features_lib
from jaxlm.recipes import instruction_tuning, trained_runs
from jaxlm.training import atomic_files, loop, optim, preference_loss, reliability, telemetry
from jaxlm.training import steps as steps_lib

REFERENCE_LOGPS = "reference_logps.npz"  # the reference's summed response log-probs of every pair (train, eval)
ANSWERS = "answers.json"  # greedy answers to the first held-out prompts: {"prompts", "before", "after"}
ANSWERED, REPORTED = 32, 4  # held-out prompts answered (answers.json), and shown in report.md


def preference_tune(config: Config, workdir: str, stop_at_step: int | None = None) -> dict:
  """Preference-tunes (or resumes) a decoder into `workdir`; returns the final evaluation (also in eval.json)."""
  with reliability.StopSignals() as stop:
    started = time.time()
    config, mesh, kernels = loop.prepare_run(instruction_tuning.with_source_model(config), workdir, causal=True)
    config, task = preference_task(config, workdir, mesh, kernels)
    return loop.run_loop(config, workdir, mesh, task, stop, stop_at_step, started)


def eval_batches(pairs: pref_data.PreferencePairs, global_batch: int) -> list[dict[str, np.ndarray]]:
  """Every pair once, as this process's slices of global batches; filler pairs weigh 0."""
  return instr_data.eval_batches(pairs, global_batch, jax.process_index(), jax.process_count(), weight="pair_weight")


def log_probs_of(graphdef, params, param_shardings, splits: dict[str, pref_data.PreferencePairs],
                 global_batch: int, mesh: Mesh, overrides) -> dict[str, np.ndarray]:
  """{split: [N, 2] summed response log-probabilities of every pair} under (graphdef, params), forward only."""
  log_probs = jax.jit(sharding.traced_on(mesh, preference_loss.make_log_probs_fn(graphdef), overrides),
                      in_shardings=(param_shardings, sharding.batch_sharding(mesh, 1)),
                      out_shardings=sharding.replicated(mesh))
  result = {}
  for split, pairs in splits.items():
    out = [np.asarray(jax.device_get(log_probs(params, steps_lib.to_global_batch(b, mesh))))
           for b in eval_batches(pairs, global_batch)]
    result[split] = np.concatenate(out)[:len(pairs)]
  return result


def _reference_model(config: Config, mesh: Mesh):
  """(graphdef, params, shardings) of preference.reference, a decoder folder (HF or jaxlm run), on the run's mesh."""
  source, m = config.preference.reference, config.model
  _, graphdef, params, _, _ = trained_runs.load_decoder(source, mesh_config=config.mesh, compute_dtype=m.compute_dtype,
                                                        param_dtype=m.param_dtype)
  vocab_size = nnx.merge(graphdef, params).config.vocab_size
  if vocab_size != m.vocab_size:
    raise ValueError(f"preference.reference={source!r} has a vocabulary of {vocab_size} tokens, init_from's "
                     f"{m.vocab_size}; give a reference with the tokenizer the pairs were tokenized with")
  return graphdef, params, jax.tree.map(lambda x: x.sharding, params)


def preference_task(config: Config, workdir: str, mesh: Mesh, kernels: Kernels) -> tuple[Config, loop.Task]:
  """The run's config (its model from init_from, steps and seq_len fitted to the data) and its `loop.Task`."""
  t, d, p = config.train, config.data, config.preference
  layout = padding_free_layout(config, mesh) if p.padding_free else None
  decoder = instruction_tuning.load_decoder(config, mesh)
  model_config = decoder.model_config
  data = pref_data.build_preference_data(d, decoder.tokenizer, t.seed, model_config.max_seq_len, decoder.chat_folder,
                                         layout)
  row_pairs = data.train.rows["inputs"][0].size // (2 * data.seq_len)  # padded pairs' slots per row (padded: 1)
  rows_per_step = t.batch_size // row_pairs
  derived_steps, chosen_seq_len = t.steps == 0, d.seq_len == 0
  pair_slots = len(data.train) * row_pairs
  t = data_defaults.resolve_steps(data_defaults.resolve_learning_rate(t, config.lora.rank), pair_slots)
  d = dataclasses.replace(d, seq_len=data.seq_len)
  config = dataclasses.replace(config, model=model_config, train=t, data=d)
  stats = data.stats
  if p.padding_free:
    stats.update(row_pairs=row_pairs, rows_per_step=rows_per_step,
                 pairs_per_row=stats["train_pairs"] / max(1, len(data.train)))
  instruction_tuning.announce_data(config, workdir, decoder, stats, pair_slots, derived_steps, chosen_seq_len,
                                   "padded-pair slots" if p.padding_free else "pairs")

  optimizer = optim.make_optimizer(t)
  make_model = lambda rngs: GPT(model_config, kernels=kernels, rngs=rngs)
  graphdef, state, state_shardings, features = features_lib.train_state_from_config(
      config, mesh, optimizer, make_model, language_model_loss=False)
  train_step, eval_step = steps_lib.jit_steps(
      graphdef, optimizer, config, mesh, state_shardings, features,
      loss_fn=preference_loss.make_preference_loss_fn(graphdef, p), eval_fn=preference_loss.make_eval_fn(graphdef, p))
  overrides = sharding.rule_overrides(config.mesh)
  # The step's FLOPs (a LoRA step's without the frozen weights' gradients; attention over the whole row) and the
  # forward-only pass over the output table that sums the response log-probabilities (preference_loss).
  flops_per_token = (telemetry.flops_per_token(model_config, data.train.rows["inputs"].shape[-1], lora=config.lora)
                     + 2 * model_config.d_model * model_config.vocab_size)
  latest: dict[str, float] = {}

  def evaluate(params) -> dict[str, float]:
    totals = None
    for batch in eval_batches(data.eval, rows_per_step):
      out = eval_step(params, steps_lib.to_global_batch(batch, mesh))
      totals = out if totals is None else jax.tree.map(lambda a, b: a + b, totals, out)
    return preference_loss.eval_metrics(jax.device_get(totals))

  def set_reference(values: dict[str, np.ndarray]) -> None:
    for split, pairs in (("train", data.train), ("eval", data.eval)):
      if values[split].shape != pairs.rows["ref_logp"].shape:
        raise ValueError(f"{os.path.join(workdir, REFERENCE_LOGPS)} holds {split} rows of shape "
                         f"{values[split].shape} but the data's are {pairs.rows['ref_logp'].shape}; the data or its "
                         "layout (preference.padding_free, row_pairs) changed since the run started: use a new workdir")
      pairs.rows["ref_logp"][...] = values[split]

  def start(state, start_step: int):
    path = os.path.join(workdir, REFERENCE_LOGPS)
    if start_step == 0:
      if "frozen" in state:  # LoRA: the checkpoint becomes the frozen base, one leaf at a time
        state, _ = streaming.load_base(state, state_shardings, config.lora, make_model, mesh, decoder.params,
                                       config.init_from, t.seed)
      else:
        state["params"] = instruction_tuning.place_params(decoder.params, state["params"], state_shardings["params"],
                                                          config.init_from)
      policy = features.model_params(state)
      if p.loss != "simpo":
        if p.reference:
          ref_graphdef, ref_params, ref_shardings = _reference_model(config, mesh)
        else:  # the policy before its first step (LoRA: the base; the adapters start at zero)
          ref_graphdef, ref_params, ref_shardings = graphdef, policy, features.model_params(state_shardings)
        values = log_probs_of(ref_graphdef, ref_params, ref_shardings, {"train": data.train, "eval": data.eval},
                              rows_per_step, mesh, overrides)
        del ref_params
        if jax.process_index() == 0:
          atomic_files.write_arrays(path, **values)
        set_reference(values)
      before = evaluate(policy)
      atomic_files.write_json_on_process_0(os.path.join(workdir, instruction_tuning.START_EVAL), before)
      answers = held_out_answers(graphdef, policy, decoder.tokenizer, data, config.log.sample_tokens, model_config,
                                 t.seed)
      atomic_files.write_json_on_process_0(os.path.join(workdir, ANSWERS), {
          "prompts": [x.text[0] for x in data.eval_pairs[:len(answers)]], "before": answers})
      data_defaults.print_on_process_0(f"init_from {config.init_from}: loaded; before tuning eval_preference_loss "
                                       f"{before['eval_preference_loss']:.4f}, eval_reward_accuracy "
                                       f"{before['eval_reward_accuracy']:.3f}")
    elif p.loss != "simpo":
      if not os.path.isfile(path):
        raise FileNotFoundError(f"{path} is missing: the reference log-probabilities of this run are gone; start "
                                f"again in a new workdir")
      with np.load(path, allow_pickle=False) as saved:
        set_reference({split: saved[split] for split in ("train", "eval")})
    decoder.params = None  # a resumed run never needs them
    return state

  def count(local: dict) -> dict[str, float]:
    """Every token slot of the global batch, the slots holding a token, its response tokens and its FLOPs."""
    processes = jax.process_count()
    return {"tokens": float(local["inputs"].size) * processes,
            "real_tokens": float((local["segment_ids"] > 0).sum()) * processes,
            "response_tokens": float(local["loss_mask"].sum()) * processes,
            "pairs": float(local["pair_weight"].sum()) * processes,
            "flops": local["inputs"].size * processes * flops_per_token}

  def evaluate_step(step: int, params) -> dict[str, float]:
    latest.clear()
    latest.update(evaluate(params))
    return dict(latest)

  def finish(end: loop.RunEnd) -> loop.Report:
    params = features.model_params(end.state)
    answers = held_out_answers(graphdef, params, decoder.tokenizer, data, config.log.sample_tokens, model_config,
                               t.seed)
    saved = instruction_tuning.save_tuned_decoder(graphdef, params, decoder, workdir, config)
    start_eval = instruction_tuning.read_json(os.path.join(workdir, instruction_tuning.START_EVAL))
    result: dict[str, Any] = {f"start_{k}": v for k, v in start_eval.items()}
    result.update({**latest, "step": t.steps, "preference_loss": p.loss, "beta": p.beta, "seq_len": d.seq_len,
                   "train_pairs": stats["train_pairs"], "eval_pairs": stats["eval_pairs"],
                   "final_train_loss": end.last.get("loss"), "init_from": config.init_from,
                   "reference": p.reference or ("" if p.loss == "simpo" else "init_from"),
                   "wall_time_sec": end.facts["wall_time_sec"], "devices": jax.device_count()})
    result.update({k: v for k, v in end.rates.items() if k.endswith("_per_sec") or k == "mfu"})
    result.update(lora.state_bytes(end.state))
    result.update(saved)
    atomic_files.write_json_on_process_0(os.path.join(workdir, "eval.json"), result)
    recorded = instruction_tuning.read_json(os.path.join(workdir, ANSWERS))
    before = recorded.get("before", [])
    atomic_files.write_json_on_process_0(os.path.join(workdir, ANSWERS), {
        "prompts": [x.text[0] for x in data.eval_pairs[:len(answers)]], "before": before, "after": answers})
    summary = {**result, **{k: end.facts[k] for k in ("mesh", "device_kind", "peak_flops_per_device")}}
    return loop.Report(summary, result=result, data_stats=stats,
                       sections=[("Held-out prompts (greedy, before and after tuning)",
                                  answers_markdown(data, before, answers))])

  return config, loop.Task(
      title="Preference-tuning run", state=state, state_shardings=state_shardings, train_step=train_step,
      batches=make_train_iterator(data.train, rows_per_step // jax.process_count(), t.seed, d.shuffle), count=count,
      evaluate=evaluate_step, finish=finish, start=start, features=features,
      renames={"token_accuracy": "reward_accuracy", "tokens": "pairs_in_step"})


def padding_free_layout(config: Config, mesh: Mesh) -> pref_data.Layout:
  """pair_packing's layout for this run: rows of preference.row_pairs padded pairs' slots (0: chosen from the data)
  such that train.batch_size / row_pairs rows split evenly over the data shards, micro-batches and processes."""
  t, k = config.train, config.preference.row_pairs
  shards = mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape[sharding.EXPERT_AXIS]
  divisor = math.lcm(shards * t.grad_accum, jax.process_count())
  if k and (t.batch_size % k or (t.batch_size // k) % divisor):
    raise ValueError(f"preference.row_pairs={k} does not leave train.batch_size={t.batch_size} a whole number of rows "
                     f"a step divisible by {divisor} (the data shards x train.grad_accum, and the processes); use a "
                     f"divisor of {t.batch_size // divisor}, or 0 to choose")
  return pair_packing.packing_layout(k, pair_packing.allowed_row_pairs(t.batch_size, divisor))


def held_out_answers(graphdef, params, tokenizer, data: pref_data.PreferenceData, max_new_tokens: int, model_config,
                     seed: int) -> list[str]:
  """Greedy continuations of the first ANSWERED held-out prompts, each ended by a stop token."""
  pairs = data.eval_pairs[:ANSWERED]
  room = model_config.max_seq_len - max((len(x.prompt) for x in pairs), default=0)
  new_tokens = min(max_new_tokens, room)
  if not pairs or new_tokens < 1:
    return []
  outputs = generate.generate(graphdef, params, [x.prompt for x in pairs], new_tokens, stop_tokens=data.stop_ids,
                              seed=seed)
  return [tokenizer.decode([x for x in out if x not in data.stop_ids]) for out in outputs]


def answers_markdown(data: pref_data.PreferenceData, before: list[str], after: list[str]) -> str:
  if not after:
    return "No held-out prompt was answered (log.sample_tokens=0 or no room left in the position table)."
  fence = lambda text: "```\n" + text.replace("```", "`\u200b``") + "\n```"
  parts = []
  for i, (pair, answer) in enumerate(zip(data.eval_pairs, after[:REPORTED])):
    prompt, chosen, rejected = pair.text
    first = before[i] if i < len(before) else "(not recorded)"
    parts.append(f"**Prompt {i + 1}**\n\n{fence(prompt)}\n\nChosen:\n\n{fence(chosen)}\n\nRejected:\n\n"
                 f"{fence(rejected)}\n\nBefore tuning:\n\n{fence(first)}\n\nAfter tuning:\n\n{fence(answer)}")
  return "\n\n".join(parts)
