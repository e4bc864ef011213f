"""The RL recipe's rollouts: completions sampled on the train state's own parameters on the training mesh, the
train rows built from them (with the sampling-time and reference log-probs the loss needs), the prompt order, and
the greedy held-out evaluation (jaxlm/recipes/policy_optimization.py runs them).

Rows of a rollout batch are [left-padded prompt (P slots), completion (C = rl.max_completion_length slots)];
completion i is generation i % G of prompt i // G (TRL's order). The prompt width P is rounded up to a multiple of
jaxlm.inference.generate.PROMPT_BUCKET, so the sampler and the train step compile once per bucket (`compiles`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxlm.config import RLConfig
from jaxlm.inference import generate
from jaxlm.parallel import sharding
from jaxlm.recipes import rewards as rewards_lib
from jaxlm.training import policy_loss
from jaxlm.training import steps as steps_lib


class PromptBatches:
  """Endless global batches of prompt indices: each epoch a permutation seeded by (seed, epoch), cut into steps of
  `per_step` prompts (the epoch's remainder is skipped); the batch of a step is a pure function of (seed, step).
  Every process holds the same indices: the rollout samples the global batch. get_state()/set_state(dict)."""

  def __init__(self, num_prompts: int, per_step: int, seed: int, shuffle: bool = True):
    self.num_prompts, self.per_step, self.seed, self.shuffle, self.step = num_prompts, per_step, seed, shuffle, 0

  def indices(self, step: int) -> np.ndarray:
    epoch, k = divmod(step, self.num_prompts // self.per_step)
    order = (np.random.default_rng([self.seed, epoch]).permutation(self.num_prompts) if self.shuffle
             else np.arange(self.num_prompts))
    return order[k * self.per_step:(k + 1) * self.per_step]

  def __iter__(self):
    return self

  def __next__(self) -> np.ndarray:
    self.step += 1
    return self.indices(self.step - 1)

  def get_state(self) -> dict[str, int]:
    return {"prompt_batches": self.step}

  def set_state(self, state: dict[str, int]) -> None:
    self.step = int(state["prompt_batches"])


@dataclasses.dataclass
class Rollout:
  prompt_tokens: np.ndarray  # [Np, P] int32, left-padded
  pads: np.ndarray  # [Np] left padding of each prompt
  completions: np.ndarray  # [N, C] int32, pad_id after the stop token
  lengths: np.ndarray  # [N] completion tokens up to and including the stop token (C when truncated)
  truncated: np.ndarray  # [N] bool: no stop token within C tokens
  completion_texts_ids: list[list[int]]  # each completion without its stop token (what the rewards read)
  metrics: dict[str, float]  # TRL's completion-length names, sampling seconds and sampled tokens/s


class RolloutSampler:
  """Jitted sampling and log-prob programs on the run's mesh, one per (prompt bucket, generations)."""

  def __init__(self, graphdef: nnx.GraphDef, features, state_shardings, mesh: Mesh, rl: RLConfig,
               stop_ids: Sequence[int], pad_id: int = 0, overrides: dict | None = None):
    self.graphdef, self.features, self.mesh, self.rl, self.pad_id = graphdef, features, mesh, rl, pad_id
    self.overrides = overrides
    self.param_shardings = features.model_params(state_shardings)
    self.stop_ids = np.full(-(-max(len(stop_ids), 1) // generate.STOP_BUCKET) * generate.STOP_BUCKET, -1, np.int32)
    self.stop_ids[:len(stop_ids)] = list(stop_ids)
    self.stop_set = set(stop_ids)
    self._programs: dict[tuple, Any] = {}
    self._log_probs = jax.jit(sharding.traced_on(mesh, policy_loss.make_log_probs_fn(graphdef), overrides),
                              in_shardings=(self.param_shardings, sharding.batch_sharding(mesh, 1)),
                              out_shardings=sharding.replicated(mesh))
    self.last_seconds = 0.0  # the latest rollout's sampling time

  @property
  def compiles(self) -> int:
    """Sampling programs compiled so far (one per prompt bucket and number of generations)."""
    return len(self._programs)

  def _program(self, width: int, num_prompts: int, generations: int):
    key = (width, num_prompts, generations)
    if key not in self._programs:
      graphdef, rl, pad_id = self.graphdef, self.rl, self.pad_id

      def sample(params, tokens_BP, pads_B, key, temperature, top_k, top_p, stop_ids):
        return generate.sample_groups(nnx.merge(graphdef, params), tokens_BP, pads_B, key,
                                      num_generations=generations, max_new_tokens=rl.max_completion_length,
                                      temperature=temperature, top_k=top_k, top_p=top_p, stop_ids=stop_ids,
                                      pad_id=pad_id)

      rows = sharding.batch_sharding(self.mesh, 1) if num_prompts % _data_shards(self.mesh) == 0 else \
          sharding.replicated(self.mesh)
      self._programs[key] = jax.jit(sharding.traced_on(self.mesh, sample, self.overrides),
                                    in_shardings=(self.param_shardings, rows, rows, None, None, None, None, None),
                                    out_shardings=sharding.replicated(self.mesh))
    return self._programs[key]

  def sample(self, params, prompt_ids: list[list[int]], key, generations: int, greedy: bool = False
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(prompt tokens [Np, P], pads [Np], completions [Np * generations, C]) sampled with rl's settings."""
    c = self.rl.max_completion_length
    config = nnx.merge(self.graphdef, params).config
    longest = max(len(p) for p in prompt_ids)
    width = generate.prompt_width(config, longest, c)
    if width + c > config.max_seq_len:
      raise ValueError(f"a prompt of {longest} tokens + rl.max_completion_length={c} exceeds the model's "
                       f"{config.max_seq_len} positions; lower rl.max_prompt_length or rl.max_completion_length")
    tokens = np.full((len(prompt_ids), width), self.pad_id, np.int32)
    for row, ids in enumerate(prompt_ids):
      tokens[row, width - len(ids):] = ids
    pads = np.array([width - len(ids) for ids in prompt_ids], np.int32)
    rl = self.rl
    temperature = 0.0 if greedy else rl.temperature
    program = self._program(width, len(prompt_ids), generations)
    out = program(params, tokens, pads, key, np.float32(temperature), np.int32(rl.top_k), np.float32(rl.top_p),
                  self.stop_ids)
    return tokens, pads, np.asarray(jax.device_get(out))

  def rollout(self, state, prompt_ids: list[list[int]], key) -> Rollout:
    """rl.num_generations completions of every prompt, sampled on the state's parameters (timed)."""
    params = self.features.model_params(state)
    jax.block_until_ready(params)  # the previous update's time is not sampling time
    started = time.perf_counter()
    tokens, pads, completions = self.sample(params, prompt_ids, key, self.rl.num_generations)
    seconds = time.perf_counter() - started
    self.last_seconds = seconds
    lengths, stopped = completion_lengths(completions, self.stop_set)
    texts_ids = [row[:n - 1].tolist() if s else row[:n].tolist() for row, n, s in zip(completions, lengths, stopped)]
    terminated = lengths[stopped]
    metrics = {"completions/mean_length": float(lengths.mean()), "completions/min_length": float(lengths.min()),
               "completions/max_length": float(lengths.max()),
               "completions/clipped_ratio": float(1.0 - stopped.mean()),
               "completions/mean_terminated_length": float(terminated.mean()) if terminated.size else 0.0,
               "sampling_sec": seconds, "sampled_tokens_per_sec": float(lengths.sum()) / max(seconds, 1e-9)}
    return Rollout(tokens, pads, completions, lengths, ~stopped, texts_ids, metrics)

  def train_rows(self, state, reference_params, rollout: Rollout, advantages: np.ndarray) -> dict[str, np.ndarray]:
    """This process's rows of the rollout batch as the train step takes them: inputs, positions, segment_ids
    [n, P + C - 1]; targets, loss_mask [n, C]; advantages, completion_tokens [n]; old_logp [n, C] with
    rl.num_iterations > 1 and ref_logp [n, C] with rl.beta > 0. `reference_params`: full tuning's frozen copy (None
    with LoRA, whose reference is the same weights with zero adapters)."""
    rl, g = self.rl, self.rl.num_generations
    n, c = rollout.completions.shape
    full = np.concatenate([np.repeat(rollout.prompt_tokens, g, axis=0), rollout.completions], axis=1)
    slots = np.arange(full.shape[1] - 1)[None, :]
    pads = np.repeat(rollout.pads, g)[:, None]
    mask = np.arange(c)[None, :] < rollout.lengths[:, None]
    if rl.mask_truncated_completions:
      mask &= ~rollout.truncated[:, None]
    rows = {"inputs": full[:, :-1], "positions": np.maximum(slots - pads, 0).astype(np.int32),
            "segment_ids": (slots >= pads).astype(np.int32), "targets": rollout.completions,
            "loss_mask": mask.astype(np.float32), "advantages": np.asarray(advantages, np.float32),
            "completion_tokens": np.full((n,), mask.sum(), np.float32)}
    if rl.num_iterations > 1:
      rows["old_logp"] = self.log_probs(self.features.model_params(state), rows)
    if rl.beta:
      if reference_params is None:  # LoRA: the adapters off
        zeros = jax.tree.map(jnp.zeros_like, state["params"])
        reference_params = self.features.split.combine(zeros, state.get("frozen"))
      rows["ref_logp"] = self.log_probs(reference_params, rows)
    return local_rows(rows)

  def log_probs(self, params, rows: dict[str, np.ndarray]) -> np.ndarray:
    """Per-token log-probs [N, C] of the completion tokens of global `rows` under `params`, forward only."""
    keys = ("inputs", "positions", "segment_ids", "targets")
    batch = steps_lib.to_global_batch(local_rows({k: rows[k] for k in keys}), self.mesh)
    return np.asarray(jax.device_get(self._log_probs(params, batch)))

  def evaluate(self, params, rows, conversational: bool, functions, tokenizer, count: int, batch: int
               ) -> tuple[dict[str, float], list[str]]:
    """Greedy answers to the first `count` held-out prompts (`rows`: PromptRows), scored by the reward functions:
    eval_reward (mean weighted total), eval_reward/<name>, eval_accuracy (the share that every function scores
    above 0), eval_completion_length; and the answers' texts."""
    texts, ids_out, lengths = [], [], []
    for begin in range(0, count, batch):
      chunk = [rows.ids[i] for i in range(begin, min(begin + batch, count))]
      filled = chunk + [chunk[0]] * (batch - len(chunk))  # one program for every chunk
      _, _, out = self.sample(params, filled, jax.random.key(0), 1, greedy=True)
      for row in out[:len(chunk)]:
        hits = [i for i, t in enumerate(row.tolist()) if t in self.stop_set]
        kept = row[:hits[0]].tolist() if hits else row.tolist()
        ids_out.append(kept)
        lengths.append(hits[0] + 1 if hits else len(row))
        texts.append(tokenizer.decode(kept))
    if not texts:
      return {}, []
    completions = [[{"role": "assistant", "content": x}] for x in texts] if conversational else texts
    columns = {k: list(v[:count]) for k, v in rows.columns.items()}
    scores = rewards_lib.score(functions, list(rows.prompts[:count]), completions, ids_out, columns)
    total = rewards_lib.weighted_total(scores, [f.weight for f in functions])
    metrics = {"eval_reward": float(np.nanmean(total)) if np.isfinite(total).any() else 0.0,
               "eval_accuracy": float(np.mean(np.all(np.nan_to_num(scores, nan=0.0) > 0, axis=1))),
               "eval_completion_length": float(np.mean(lengths))}
    for j, fn in enumerate(functions):
      column = scores[:, j]
      metrics[f"eval_reward/{fn.name}"] = float(np.nanmean(column)) if np.isfinite(column).any() else 0.0
    return metrics, texts


def completion_lengths(completions_NC: np.ndarray, stop_ids: set[int]) -> tuple[np.ndarray, np.ndarray]:
  """(each completion's tokens up to and including its first stop token, C when it has none [N]; whether it has one
  [N])."""
  is_stop = np.isin(completions_NC, list(stop_ids)) if stop_ids else np.zeros_like(completions_NC, bool)
  stopped = is_stop.any(axis=1)
  return np.where(stopped, is_stop.argmax(axis=1) + 1, completions_NC.shape[1]), stopped


def _data_shards(mesh: Mesh) -> int:
  return mesh.shape["data"] * mesh.shape["fsdp"] * mesh.shape[sharding.EXPERT_AXIS]


def local_rows(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
  """This process's contiguous slice of global rows (what `steps.to_global_batch` assembles)."""
  processes, index = jax.process_count(), jax.process_index()
  n = next(iter(rows.values())).shape[0] // processes
  return {k: v[index * n:(index + 1) * n] for k, v in rows.items()}
