"""Online RL of a decoder on its own sampled completions (GRPO, DAPO, Dr. GRPO, BNPO; GSPO's sequence ratios),
through the one training loop.

  init_from   an HF decoder folder or a jaxlm run workdir, loaded as instruction tuning loads it.
  data        prompts (jaxlm/data/tuning/prompts.py): TRL's `prompt` column, plain or conversational (rendered with
              the checkpoint's chat template); every other column goes to the reward functions.
  step        the loop hands each step's prompt batch to `Task.prepare` with the current train state: the rollout
              samples rl.num_generations completions per prompt with jaxlm's sampler (jaxlm/inference/generate.py)
              on the train state's own parameters, on the training mesh (with LoRA: base + adapters, no merged
              copy; one prefill per prompt), the reward functions (jaxlm/recipes/rewards.py) score them, the group
              advantages and the policy loss follow (jaxlm/training/policy_loss.py).
  reference   rl.beta > 0: the reference log-probs of each rollout, from the same weights with the adapters off
              (LoRA: zero adapters, no second copy) or from a frozen copy of init_from's weights (full tuning).
  exactness   a rollout is a pure function of (train.seed, step, params): a resumed run samples the same
              completions; with rl.num_iterations > 1 the rollout of the current cycle is kept in the workdir
              (rollout_batch.npz) so a run resumed mid-cycle trains on the same batch.
  eval        greedy answers to the held-out prompts, scored by the same rewards, before tuning (start_eval.json),
              every train.eval_every_steps and at the end (eval.json): eval_reward, eval_reward/<function>,
              eval_accuracy (the share that every reward function scores above 0), eval_completion_length.
  files       rollouts.jsonl (a few completions with their rewards at every logged step), answers.json and
              report.md (held-out answers before and after, the reward curve), hf_model/ (and adapter/ with LoRA).
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
from jax.sharding import Mesh

from jaxlm.adapters import lora
from jaxlm.config import Config
from jaxlm.data.tuning import prompts as prompt_data
from jaxlm.interop import streaming
from jaxlm.kernels import Kernels
from jaxlm.models.gpt import GPT
from jaxlm.parallel import sharding
from jaxlm.recipes import data_checks, data_defaults, instruction_tuning
from jaxlm.recipes import features as features_lib
from jaxlm.recipes import rewards as rewards_lib
from jaxlm.recipes.rollouts import Rollout, RolloutSampler, PromptBatches
from jaxlm.training import atomic_files, loop, optim, policy_loss, reliability, report, telemetry
from jaxlm.training import steps as steps_lib

ROLLOUTS = "rollouts.jsonl"  # a few completions of every logged step, with their rewards and advantages
ROLLOUT_BATCH = "rollout_batch.npz"  # rl.num_iterations > 1: the current cycle's rollout, for a resumed run
ANSWERS = "answers.json"  # greedy answers to the first held-out prompts: {"prompts", "before", "after"}
REPORTED = 4  # held-out answers shown in report.md


def policy_optimize(config: Config, workdir: str, stop_at_step: int | None = None) -> dict:
  """Tunes (or resumes) a decoder with online RL into `workdir`; returns the final evaluation (also in eval.json)."""
  with reliability.StopSignals() as stop:
    started = time.time()
    config, mesh, kernels = loop.prepare_run(instruction_tuning.with_source_model(config), workdir, causal=True)
    config, task = policy_task(config, workdir, mesh, kernels)
    return loop.run_loop(config, workdir, mesh, task, stop, stop_at_step, started)


def policy_task(config: Config, workdir: str, mesh: Mesh, kernels: Kernels) -> tuple[Config, loop.Task]:
  """The run's config (its model from init_from, its steps) and its `loop.Task`."""
  t, d, rl = config.train, config.data, config.rl
  decoder = instruction_tuning.load_decoder(config, mesh)
  model_config = decoder.model_config
  functions = rewards_lib.load_reward_functions(rl.rewards, rl.reward_weights)
  max_prompt = rl.max_prompt_length or model_config.max_seq_len - rl.max_completion_length
  if max_prompt < 1:
    raise ValueError(f"rl.max_completion_length={rl.max_completion_length} leaves no room for a prompt in the "
                     f"model's {model_config.max_seq_len} positions; lower it")
  data = prompt_data.build_prompt_data(d, decoder.tokenizer, t.seed, max_prompt, decoder.chat_folder)
  stop_ids = list(data.stop_ids)
  for token in rl.stop_tokens:
    token_id = decoder.tokenizer.token_to_id(token)
    if token_id is None:
      raise ValueError(f"rl.stop_tokens has {token!r}, which is not one token of init_from's tokenizer; give tokens "
                       "as the tokenizer spells them")
    stop_ids.append(token_id)
  prompts_per_step = data_checks.prompts_per_step(len(data.train), config)
  derived_steps = t.steps == 0
  t = data_defaults.resolve_steps(data_defaults.resolve_learning_rate(t, config.lora.rank),
                                  len(data.train) * rl.num_generations)
  config = dataclasses.replace(config, model=model_config, train=t)
  data_defaults.print_on_process_0(data_defaults.describe_steps(t, len(data.train) * rl.num_generations,
                                                                derived_steps, unit="completions"))
  data_defaults.print_on_process_0("data: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                        for k, v in data.stats.items()))
  if jax.process_index() == 0:
    atomic_files.write_text(os.path.join(workdir, "tokenizer.json"), decoder.tokenizer.to_str(pretty=True))

  optimizer = optim.make_optimizer(t)
  make_model = lambda rngs: GPT(model_config, kernels=kernels, rngs=rngs)
  graphdef, state, state_shardings, features = features_lib.train_state_from_config(
      config, mesh, optimizer, make_model, language_model_loss=False)
  train_step, _ = steps_lib.jit_steps(graphdef, optimizer, config, mesh, state_shardings, features,
                                      loss_fn=policy_loss.make_policy_loss_fn(graphdef, rl, t.batch_size))
  sampler = RolloutSampler(graphdef, features, state_shardings, mesh, rl, stop_ids,
                           pad_id=decoder.tokenizer.token_to_id("<pad>") or 0,
                           overrides=sharding.rule_overrides(config.mesh))
  eval_count = min(len(data.eval), rl.eval_prompts or len(data.eval))
  eval_texts = [p if isinstance(p, str) else decoder.tokenizer.decode(ids, skip_special_tokens=False)
                for p, ids in zip(data.eval.prompts[:eval_count], data.eval.ids[:eval_count])]
  # The update's FLOPs: the body on every slot, the output projection on the completion slots only (its
  # fused cross-entropy, frozen with LoRA, plus the forward-only log-prob pass); sampling is not counted.
  head_flops = (4 if config.lora.rank else 6) * model_config.d_model * model_config.vocab_size
  rollout_path, rollouts_log = os.path.join(workdir, ROLLOUT_BATCH), os.path.join(workdir, ROLLOUTS)
  reference: dict[str, Any] = {}  # full tuning with rl.beta > 0: {"params": a frozen copy of init_from's weights}
  per_step: dict[int, dict[str, float]] = {}  # host metrics of the steps not yet written
  cycle: dict[str, Any] = {}  # rl.num_iterations > 1: {"start": step, "rows": this process's rows}
  latest: dict[str, Any] = {}
  # The share of each step spent sampling: its rollout's seconds over the time from its prepare to the next one
  # (sampling, the update and the host's work), evaluation excluded; the loop's own step clock runs one step late.
  clock: dict[str, Any] = {"step": None, "started": 0.0, "eval": 0.0}
  log_every = config.log.every_steps

  def evaluate(params) -> tuple[dict[str, float], list[str]]:
    return sampler.evaluate(params, data.eval, data.conversational, functions, decoder.tokenizer, eval_count,
                            t.batch_size)

  def start(state, start_step: int):
    needs_weights = start_step == 0 or (rl.beta and "frozen" not in state)
    if start_step == 0:
      if "frozen" in state:  # LoRA: the checkpoint becomes the frozen base, one leaf at a time
        state, _ = streaming.load_base(state, state_shardings, config.lora, make_model, mesh, decoder.params,
                                       config.init_from, t.seed)
      else:
        state["params"] = instruction_tuning.place_params(decoder.params, state["params"], state_shardings["params"],
                                                          config.init_from)
    if needs_weights and rl.beta and "frozen" not in state:  # the reference: init_from's weights, frozen
      placed = instruction_tuning.place_params(decoder.params, state["params"], state_shardings["params"],
                                               config.init_from)
      # a copy: placing may hand back the very buffers the train state holds, which each step donates
      reference["params"] = jax.tree.map(lambda x: jnp.array(x, copy=True), placed)
    decoder.params = None
    if start_step == 0:
      before, answers = evaluate(features.model_params(state))
      atomic_files.write_json_on_process_0(os.path.join(workdir, instruction_tuning.START_EVAL), before)
      atomic_files.write_json_on_process_0(os.path.join(workdir, ANSWERS), {
          "prompts": eval_texts[:len(answers)], "before": answers})
      data_defaults.print_on_process_0(f"init_from {config.init_from}: loaded; before tuning eval_reward "
                                       f"{before['eval_reward']:.4f}, eval_accuracy {before['eval_accuracy']:.3f}")
      if jax.process_index() == 0 and os.path.exists(rollouts_log):
        os.remove(rollouts_log)
    elif jax.process_index() == 0:
      _truncate_log(rollouts_log, start_step)
    return state

  def close_step(now: float) -> None:
    if clock["step"] in per_step:
      seconds = now - clock["started"] - clock["eval"]
      per_step[clock["step"]]["sampling_share"] = per_step[clock["step"]]["sampling_sec"] / max(seconds, 1e-9)
    clock.update(step=None, eval=0.0)

  def prepare(state, step: int, indices: np.ndarray) -> dict[str, np.ndarray]:
    """The rows of `step`'s rollout batch this process trains on (sampled now, or kept from the cycle's start)."""
    now = time.perf_counter()
    close_step(now)
    clock.update(step=step, started=now)
    first = step - (step - 1) % rl.num_iterations  # the step that sampled this cycle's rollout
    if first != step:  # the cycle's rollout again (kept in the workdir for a run resumed inside the cycle)
      if cycle.get("start") != first:
        rows, metrics = _read_cycle(rollout_path, first)
        cycle.update(start=first, rows=rows, metrics=metrics)
      per_step[step] = {**cycle["metrics"], "sampling_sec": 0.0}  # the statistics of the batch it trains on
      return cycle["rows"]
    rollout: Rollout = sampler.rollout(state, [data.train.ids[i] for i in indices],
                                       jax.random.fold_in(jax.random.key(t.seed), step))
    texts = [decoder.tokenizer.decode(ids) for ids in rollout.completion_texts_ids]
    completions = [[{"role": "assistant", "content": x}] for x in texts] if data.conversational else texts
    g = rl.num_generations
    prompts = [data.train.prompts[i] for i in indices for _ in range(g)]
    columns = {k: [v[i] for i in indices for _ in range(g)] for k, v in data.train.columns.items()}
    scores = rewards_lib.score(functions, prompts, completions, rollout.completion_texts_ids, columns)
    total = rewards_lib.weighted_total(scores, [f.weight for f in functions])
    advantages = np.asarray(policy_loss.group_advantages(total, g, rl.scale_rewards))
    stds = np.asarray(policy_loss.reward_stds(total, g, rl.scale_rewards))
    rows = sampler.train_rows(state, reference.get("params"), rollout, advantages)
    metrics = {**rewards_lib.reward_metrics(scores, functions), **rollout.metrics,
               "frac_reward_zero_std": float(np.mean(np.isclose(np.nan_to_num(stds, nan=0.0), 0.0)))}
    per_step[step] = metrics
    if step == 1 or step % log_every == 0 or step == t.steps:
      _log_rollouts(rollouts_log, step, prompts, texts, scores, functions, advantages, rl.rollouts_logged)
    if rl.num_iterations > 1:
      cycle.update(start=step, rows=rows, metrics=metrics)
      _write_cycle(rollout_path, step, rows, metrics)
    return rows

  def host_metrics(step: int) -> dict[str, float]:
    if clock["step"] == step:  # the run's last step (its update is done: the loop has waited for it)
      close_step(time.perf_counter())
    return per_step.pop(step, {})

  def count(local: dict) -> dict[str, float]:
    processes = jax.process_count()
    (n, width), c = local["inputs"].shape, local["targets"].shape[1]
    body = telemetry.flops_per_token(model_config, width, lora=config.lora) - head_flops
    flops = n * (width * body + c * (head_flops + 2 * model_config.d_model * model_config.vocab_size))
    return {"tokens": float(local["inputs"].size) * processes,
            "completion_tokens": float(local["loss_mask"].sum()) * processes,
            "flops": flops * processes}

  def evaluate_step(step: int, params) -> dict[str, float]:
    started = time.perf_counter()
    metrics, answers = evaluate(params)
    clock["eval"] += time.perf_counter() - started
    latest.clear()
    latest.update(metrics)
    latest["answers"] = answers
    return metrics

  def finish(end: loop.RunEnd) -> loop.Report:
    params = features.model_params(end.state)
    answers = latest.pop("answers", None)
    if answers is None:
      metrics, answers = evaluate(params)
      latest.update(metrics)
    saved = instruction_tuning.save_tuned_decoder(graphdef, params, decoder, workdir, config)
    start_eval = instruction_tuning.read_json(os.path.join(workdir, instruction_tuning.START_EVAL))
    result: dict[str, Any] = {f"start_{k}": v for k, v in start_eval.items()}
    result.update({**latest, "step": t.steps, "rl_loss": rl.loss, "importance_sampling": rl.importance_sampling,
                   "num_generations": rl.num_generations, "beta": rl.beta, "train_prompts": len(data.train),
                   "eval_prompts": eval_count, "final_train_loss": end.last.get("loss"),
                   "init_from": config.init_from, "rollout_compiles": sampler.compiles,
                   "wall_time_sec": end.facts["wall_time_sec"], "devices": jax.device_count()})
    result.update({k: v for k, v in end.rates.items() if k.endswith("_per_sec") or k == "mfu"})
    shares = [x["sampling_share"] for x in report.read_metrics(workdir) if "sampling_share" in x]
    if shares:  # the mean over the logged lines (steps that reuse a rollout count as 0)
      result["sampling_share"] = float(np.mean(shares))
    result.update(lora.state_bytes(end.state))
    result.update(saved)
    atomic_files.write_json_on_process_0(os.path.join(workdir, "eval.json"), result)
    before = instruction_tuning.read_json(os.path.join(workdir, ANSWERS)).get("before", [])
    atomic_files.write_json_on_process_0(os.path.join(workdir, ANSWERS), {
        "prompts": eval_texts[:len(answers)], "before": before, "after": answers})
    sections = [("Rewards", reward_curve(workdir)),
                ("Held-out prompts (greedy, before and after tuning)",
                 answers_markdown(eval_texts, before, answers))]
    summary = {**result, **{k: end.facts[k] for k in ("mesh", "device_kind", "peak_flops_per_device")}}
    return loop.Report(summary, result=result, data_stats=data.stats, sections=sections)

  return config, loop.Task(
      title="RL tuning run", state=state, state_shardings=state_shardings, train_step=train_step,
      batches=PromptBatches(len(data.train), prompts_per_step, t.seed, d.shuffle), count=count,
      evaluate=evaluate_step, finish=finish, start=start, prepare=prepare, host_metrics=host_metrics,
      features=features,
      renames={"token_accuracy": "frac_positive_advantage", "tokens": "completions_in_step"})


def _write_cycle(path: str, step: int, rows: dict[str, np.ndarray], metrics: dict[str, float]) -> None:
  if jax.process_count() > 1:
    path = f"{path[:-4]}.process{jax.process_index()}.npz"
  atomic_files.write_arrays(path, cycle_start=np.asarray(step), cycle_metrics=np.asarray(json.dumps(metrics)), **rows)


def _read_cycle(path: str, step: int) -> tuple[dict[str, np.ndarray], dict[str, float]]:
  if jax.process_count() > 1:
    path = f"{path[:-4]}.process{jax.process_index()}.npz"
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} is missing: the run stopped inside a cycle of rl.num_iterations and its rollout "
                            f"is gone; start again in a new workdir")
  with np.load(path, allow_pickle=False) as saved:
    if int(saved["cycle_start"]) != step:
      raise ValueError(f"{path} holds the rollout of step {int(saved['cycle_start'])}, not of step {step}; the "
                       f"workdir was changed by hand: start again in a new workdir")
    rows = {k: saved[k] for k in saved.files if not k.startswith("cycle_")}
    return rows, json.loads(str(saved["cycle_metrics"]))


def _log_rollouts(path: str, step: int, prompts, texts, scores, functions, advantages, count: int) -> None:
  if jax.process_index() or not count:
    return
  with open(path, "a") as f:
    for i in range(min(count, len(texts))):
      rewards = {fn.name: (None if np.isnan(scores[i, j]) else float(scores[i, j])) for j, fn in enumerate(functions)}
      f.write(json.dumps({"step": step, "prompt": prompts[i], "completion": texts[i], "rewards": rewards,
                          "advantage": float(advantages[i])}) + "\n")


def _truncate_log(path: str, last_step: int) -> None:
  """Drops the lines of steps after `last_step` (a run killed after logging them, before its checkpoint)."""
  if not os.path.isfile(path):
    return
  with open(path) as f:
    kept = [line for line in f if line.strip() and json.loads(line)["step"] <= last_step]
  atomic_files.write_text(path, "".join(kept))


def reward_curve(workdir: str) -> str:
  """reward_curve.png (mean reward of the rollouts and of the held-out greedy answers by step) and its markdown."""
  records = report.read_metrics(workdir)
  train = [(r["step"], r["reward"]) for r in records if "reward" in r]
  held_out = [(r["step"], r["eval_reward"]) for r in records if "eval_reward" in r]
  if not train or jax.process_index():
    return "No rollout was logged." if not train else "![rewards](reward_curve.png)"
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  figure, axis = plt.subplots(figsize=(6, 3.5))
  axis.plot(*zip(*train), label="rollouts (sampled)")
  if held_out:
    axis.plot(*zip(*held_out), "o-", label="held-out (greedy)")
  axis.set_xlabel("step")
  axis.set_ylabel("mean reward")
  axis.legend()
  figure.tight_layout()
  figure.savefig(os.path.join(workdir, "reward_curve.png"))
  plt.close(figure)
  return "![rewards](reward_curve.png)"


def answers_markdown(prompts: list[str], before: list[str], after: list[str]) -> str:
  if not after:
    return "No held-out prompt was answered."
  fence = lambda text: "```\n" + text.replace("```", "`\u200b``") + "\n```"
  parts = []
  for i, answer in enumerate(after[:REPORTED]):
    first = before[i] if i < len(before) else "(not recorded)"
    parts.append(f"**Prompt {i + 1}**\n\n{fence(prompts[i])}\n\nBefore tuning:\n\n{fence(first)}\n\n"
                 f"After tuning:\n\n{fence(answer)}")
  return "\n\n".join(parts)
