"""Sizing an online RL run (GRPO and its successors: jaxlm/recipes/policy_optimization.py) as the planner sizes an LM
run: each optimizer step is an LM step on train.batch_size completions of prompt + completion tokens, and once every
rl.num_iterations steps a rollout samples the next batch.

  sequences  `prompt_length` P: data.seq_len, or DEFAULT_PROMPT_LENGTH when it is 0 (chosen from the data), at most
             what the recipe keeps (rl.max_prompt_length, or the positions rl.max_completion_length C leaves);
             `as_sequence_run` is the LM run of sequences of P + C tokens, whose step the planner sizes as usual.
  memory     `predict_rl_memory`: the update step's parts (jaxlm/planner/estimates.py, or estimates_lora.py: the
             policy's params or frozen base and adapters, the optimizer state, gradients, activations), plus
               reference      a frozen copy of the policy's params (init_from's weights) with full tuning and
                              rl.beta > 0, resident the whole run; none with LoRA (the reference is the base with the
                              adapters off) and none at beta 0
               rollout_extra  what the rollout holds beyond the update step's transient parts, when more: the KV
                              cache of train.batch_size rows of P + C slots (`kv_cache_bytes`, the model's own
                              init_cache shapes) and the sampled step's f32 logits (the rollout and the update run one
                              after the other, so only the larger of the two transients counts)
  time       `predict_rl_step_time`, per rollout cycle (one rollout, rl.num_iterations updates):
               rollout_sec    prefill (one per prompt: train.batch_size / rl.num_generations prompts of P tokens, their
                              forward FLOPs) + C decode steps of train.batch_size rows, each reading the weights once
                              as stored plus the whole KV cache (static shapes: every slot, filled or not) at the HBM
                              bandwidth, or its forward FLOPs at the matmul rate when that is slower (a roofline);
                              under FSDP each step gathers the weights (an upper bound: XLA may hoist the gather out
                              of the loop), under tensor parallelism two all-reduces per layer. Every completion runs
                              to C tokens: an upper bound where the sampler stops early.
               update_sec     rl.num_iterations x (the LM step + the loss's forward-only log-prob pass over the output
                              table, 2 D V FLOPs per token)
               old_logprobs_sec, reference_logprobs_sec
                              one forward over the rollout batch each, when rl.num_iterations > 1 (the sampling-time
                              log-probs) and when rl.beta > 0: 2 of the step's 6 FLOPs per parameter and token (LoRA:
                              2 of 4), as jaxlm/planner/estimates_preference.py times its reference pass
             step_time_sec is the cycle over rl.num_iterations: train.steps counts optimizer steps.
Not counted: the rollout rows' extra per-token columns (a few bytes per token), the sampler's top-k/top-p sort, the
reward functions (host time).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxlm import kernels as kernels_lib
from jaxlm.config import Config, ModelConfig
from jaxlm.kernels import Kernels
from jaxlm.parallel import sharding
from jaxlm.planner import estimates_lora as lora_predict
from jaxlm.planner.estimates import _abstract_mesh, abstract_model, planned_kernels, sharded_bytes
from jaxlm.planner.hardware import Hardware
from jaxlm.training import telemetry

# Tokens per prompt when data.seq_len is 0 (the recipe then keeps any prompt that fits): a GSM8K question in a chat
# template is 100 to 250 tokens.
DEFAULT_PROMPT_LENGTH = 256
# The parts of an update step's memory that stay between steps (full: estimates.predict_memory; LoRA:
# estimates_lora.predict_lora_memory); the rest is the step's transient.
PERSISTENT_PARTS = ("state", "frozen_base", "adapters", "optimizer")


def prompt_length(config: Config) -> int:
  """The prompt tokens P the plan assumes for an RL config (not `as_sequence_run`'s): data.seq_len, or
  DEFAULT_PROMPT_LENGTH when 0, at most what the recipe keeps (longer prompts are dropped)."""
  rl, m = config.rl, config.model
  room = m.max_seq_len - rl.max_completion_length
  if room < 1:
    raise ValueError(f"rl.max_completion_length={rl.max_completion_length} leaves no room for a prompt in the "
                     f"model's {m.max_seq_len} positions; lower it")
  if rl.max_prompt_length:
    room = min(room, rl.max_prompt_length)
  return min(config.data.seq_len or DEFAULT_PROMPT_LENGTH, room)


def as_sequence_run(config: Config) -> Config:
  """The LM run whose steps match the RL run's updates: train.batch_size sequences of P + rl.max_completion_length
  tokens (data.seq_len). The rl section stays: the estimates below read it, and P = data.seq_len - C."""
  seq_len = prompt_length(config) + config.rl.max_completion_length
  return dataclasses.replace(config, data=dataclasses.replace(config.data, seq_len=seq_len))


def _prompt_and_completion(config: Config) -> tuple[int, int]:
  c = config.rl.max_completion_length
  return config.data.seq_len - c, c


# ----------------------------------------------------------------------------------------------- bytes


def _runnable(config: Config, sizes: tuple[int, int, int], platform: str | None) -> Kernels:
  return kernels_lib.runnable_on(planned_kernels(config, sizes, platform), jax.default_backend())


@functools.lru_cache(maxsize=None)
def _param_bytes(model: ModelConfig, kernels: Kernels, sizes: tuple[int, int, int]) -> int:
  """Bytes one device holds of the params, as stored (model.param_dtype), laid out on mesh `sizes`."""
  _, abstract_params = abstract_model(model, kernels)
  shardings = sharding.param_shardings(abstract_params, _abstract_mesh(sizes))
  return sharded_bytes(abstract_params.to_pure_dict(), shardings)


def reference_bytes(config: Config, sizes: tuple[int, int, int], platform: str | None = None) -> float:
  """Per device, the reference the run keeps beside the policy: a copy of the params in their layout with full
  tuning and rl.beta > 0; 0 with LoRA (the base with the adapters off) or at beta 0."""
  if not config.rl.beta or config.lora.rank:
    return 0.0
  return float(_param_bytes(config.model, _runnable(config, sizes, platform), tuple(sizes)))


@functools.lru_cache(maxsize=None)
def _kv_cache(model: ModelConfig, kernels: Kernels, batch: int, slots: int):
  graphdef, abstract_params = abstract_model(model, kernels)
  decoder = nnx.merge(graphdef, abstract_params)
  return jax.eval_shape(lambda: decoder.init_cache(batch, slots))


def kv_cache_bytes(config: Config, sizes: tuple[int, int, int], batch: int, slots: int,
                   platform: str | None = None) -> float:
  """Bytes one device holds of the KV cache of `batch` rows of `slots` positions (the model's own init_cache:
  keys and values [L, B, S, G, K] in the compute dtype, a rolling window's slots only, segment ids [B, S] int32, the
  fill counter), the rows split over data x fsdp and the KV heads over tensor (when it divides them)."""
  data, fsdp, tensor = sizes
  m = config.model
  cache = _kv_cache(m, _runnable(config, sizes, platform), batch, slots)
  kv_heads = m.num_kv_heads or m.num_heads
  heads_split = tensor if kv_heads % tensor == 0 else 1
  nbytes = lambda x: math.prod(x.shape) * jnp.dtype(x.dtype).itemsize
  total = (nbytes(cache.k_LBSGK) + nbytes(cache.v_LBSGK)) / (data * fsdp) / heads_split
  total += nbytes(cache.segment_ids_BS) / (data * fsdp) + nbytes(cache.end)
  return float(total)


def decode_weight_bytes(config: Config, sizes: tuple[int, int, int], platform: str | None = None) -> float:
  """Bytes of weights one device reads per decode step: its tensor shard of the whole model as stored (FSDP shards
  gathered); LoRA: the frozen base (int8 / NF4 for QLoRA, whose dequantized compute-dtype copy is written and read
  again) and the adapters."""
  tensor = sizes[2]
  if not config.lora.rank:
    return float(_param_bytes(config.model, _runnable(config, sizes, platform), (1, 1, tensor)))
  s = lora_predict.lora_state_bytes(config, (1, 1, tensor), platform)
  dequantized = (2 * s["target_params"] / tensor * jnp.dtype(config.model.compute_dtype).itemsize
                 if s["base"] != "float" else 0.0)
  return float(s["frozen_base_bytes"] + s["trainable_bytes"] + dequantized)


# ----------------------------------------------------------------------------------------------- memory


def predict_rl_memory(config: Config, sizes: tuple[int, int, int], grad_accum: int, platform: str | None,
                      step_memory: dict[str, float]) -> dict[str, float]:
  """The update step's memory parts (`step_memory`, of `as_sequence_run(config)` on mesh `sizes`) with the RL run's
  `reference` and `rollout_extra` added, and `total` (see the module docstring)."""
  data, fsdp, tensor = sizes
  del grad_accum  # the rollout's cache is the whole batch's; the split changes only the update's parts
  batch = config.train.batch_size
  parts = {k: v for k, v in step_memory.items() if k != "total"}
  update_transient = sum(v for k, v in parts.items() if k not in PERSISTENT_PARTS)
  local_rows = batch / (data * fsdp)
  # The sampled step's logits in f32 and their softmax, the vocabulary split over tensor.
  logits = 2 * local_rows * config.model.vocab_size / tensor * 4
  rollout_transient = kv_cache_bytes(config, sizes, batch, config.data.seq_len, platform) + logits
  parts["reference"] = reference_bytes(config, sizes, platform)
  parts["rollout_extra"] = max(0.0, rollout_transient - update_transient)
  parts["total"] = sum(parts.values())
  return parts


# ----------------------------------------------------------------------------------------------- time


def _tp_all_reduce_bytes(config: Config, tensor: int, rows: float, tokens: int) -> float:
  """Bytes each device sends for a forward's tensor-parallel all-reduces over `rows` x `tokens` activations: two
  per layer (attention and MLP outputs) and the vocabulary-sharded embedding lookup."""
  if tensor == 1:
    return 0.0
  m = config.model
  activation = rows * tokens * m.d_model * jnp.dtype(m.compute_dtype).itemsize
  return (2 * m.num_layers + 1) * 2 * (tensor - 1) / tensor * activation


def predict_rl_step_time(config: Config, sizes: tuple[int, int, int], grad_accum: int, hardware: Hardware,
                         step_timing: dict[str, Any]) -> dict[str, Any]:
  """`step_timing` (the update step of `as_sequence_run(config)` on mesh `sizes`) with the RL run's parts (seconds,
  see the module docstring): prefill_sec, decode_sec, rollout_sec, update_sec, old_logprobs_sec,
  reference_logprobs_sec, cycle_sec (one rollout and its rl.num_iterations updates), rollout_share; step_time_sec is
  the cycle per optimizer step, tokens_per_sec and mfu (the update's model FLOPs) follow it; update_step_sec keeps
  the LM step alone. Also kv_cache_bytes, reference_bytes, decode_weight_bytes (per device), rl_prompt_length,
  rl_sequence_length and decode_bound ("memory" or "compute")."""
  del grad_accum  # in step_timing already
  data, fsdp, tensor = sizes
  devices = data * fsdp * tensor
  m, rl, platform = config.model, config.rl, hardware.platform or None
  prompt, completion = _prompt_and_completion(config)
  slots = prompt + completion
  batch = config.train.batch_size
  rate, bandwidth, link = (hardware.matmul_rate(m.compute_dtype), hardware.hbm_bytes_per_sec,
                           hardware.interconnect_bytes_per_sec)
  weights = decode_weight_bytes(config, sizes, platform)
  kv = kv_cache_bytes(config, sizes, batch, slots, platform)
  # Each pass over the model under FSDP gathers every weight from the other fsdp devices.
  gather = (fsdp - 1) / fsdp * weights if fsdp > 1 else 0.0
  forward_per_token = lambda context: telemetry.flops_per_token(m, context) / 3  # training counts 3 passes

  prompts = batch / rl.num_generations
  prefill_compute = forward_per_token(prompt) * prompts * prompt / devices / rate
  prefill_memory = (weights + kv) / bandwidth  # the weights once; the cache written once
  prefill_network = (gather + _tp_all_reduce_bytes(config, tensor, prompts / (data * fsdp), prompt)) / link
  prefill = max(prefill_compute, prefill_memory) + prefill_network

  decode_compute = forward_per_token(slots) * batch / devices / rate  # every slot attended: static shapes
  decode_memory = (weights + kv) / bandwidth
  decode_network = (gather + _tp_all_reduce_bytes(config, tensor, batch / (data * fsdp), 1)) / link
  decode_step = max(decode_compute, decode_memory) + decode_network
  rollout = prefill + completion * decode_step

  lm_step = step_timing["step_time_sec"]
  tokens = batch * slots
  head_pass = 2 * m.d_model * m.vocab_size * tokens / devices / rate  # the loss's forward-only token log-probs
  update = rl.num_iterations * (lm_step + head_pass)
  forward_pass = lm_step * 2 / (4 if config.lora.rank else 6)
  old_logprobs = forward_pass if rl.num_iterations > 1 else 0.0
  reference_logprobs = forward_pass if rl.beta > 0 else 0.0
  cycle = rollout + update + old_logprobs + reference_logprobs
  step = cycle / rl.num_iterations
  return {**step_timing,
          "update_step_sec": lm_step, "prefill_sec": prefill, "decode_sec": completion * decode_step,
          "decode_step_sec": decode_step, "rollout_sec": rollout, "update_sec": update,
          "old_logprobs_sec": old_logprobs, "reference_logprobs_sec": reference_logprobs, "cycle_sec": cycle,
          "rollout_share": rollout / cycle, "step_time_sec": step, "tokens_per_sec": tokens / step,
          "mfu": step_timing["mfu"] * lm_step / step,
          "decode_bound": "memory" if decode_memory >= decode_compute else "compute",
          "kv_cache_bytes": kv, "reference_bytes": reference_bytes(config, sizes, platform),
          "decode_weight_bytes": weights, "rl_prompt_length": prompt, "rl_sequence_length": slots}
