"""The planner's view of mixture-of-experts models and of the expert and context axes: total against active
parameters, the bytes the expert all-to-alls and the ring attention send, per-device memory, and which expert
layout to take on N devices.

These are analytic corrections to jaxlm/planner/estimates.py's model, which plans an expert or context device as a
data-parallel one:
  expert axis of P   the experts' parameters, gradients and optimizer moments are split P ways; each device's experts
                     run on buffers of P x M rows (M = its tokens x k: the exchange is dropless with static shapes,
                     jaxlm/models/moe.py), so the experts' saved activations grow P-fold; per layer and micro-batch
                     rows of D go out and back in the forward pass and again in the backward pass, (P - 1) x M each
                     time, with each row's expert id once
  context axis of C  each device holds T / C tokens of every row: its activations are those of a T / C sequence
                     (the ring's residuals are local q, k, v, output and log-sum-exp, as a flash kernel's are); per
                     layer and micro-batch the forward passes C - 1 key/value chunks round the ring and the backward
                     C chunks with their f32 gradients
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
from flax import nnx

from jaxlm.config import Config, ModelConfig
from jaxlm.kernels import Kernels
from jaxlm.planner import estimates
from jaxlm.planner.hardware import Hardware


def parameter_counts(model: ModelConfig) -> dict[str, int]:
  """{"total": every parameter, "active": those one token computes with (its k experts of each layer's E)}."""
  _, params = estimates.abstract_model(model, Kernels())
  total = sum(int(v.get_value().size) for _, v in nnx.to_flat_state(params))
  if not model.num_experts:
    return {"total": total, "active": total}
  idle = model.num_layers * (model.num_experts - model.experts_per_token) * model.expert_params
  return {"total": total, "active": total - idle}


def expert_param_bytes_f32(model: ModelConfig) -> float:
  """The experts' weights of every layer in f32 (what the expert axis splits)."""
  return 4.0 * model.num_layers * model.num_experts * model.expert_params


def expert_exchange_bytes(config: Config, expert: int, local_batch: int, grad_accum: int) -> float:
  """Bytes one device sends per step in the experts' all-to-alls (`local_batch` sequences per micro-batch)."""
  if expert == 1 or not config.model.num_experts:
    return 0.0
  m = config.model
  rows = local_batch * config.data.seq_len * m.experts_per_token  # M
  itemsize = jnp.dtype(m.compute_dtype).itemsize
  # Rows of D go out and back in the forward pass and in the backward pass; each row's expert id (int32) once.
  per_layer = (expert - 1) * rows * (4 * m.d_model * itemsize + 4)
  return float(grad_accum * m.num_layers * per_layer)


def ring_bytes(config: Config, context: int, local_batch: int, grad_accum: int) -> float:
  """Bytes one device sends per step passing key/value chunks round the context ring."""
  if context == 1:
    return 0.0
  m = config.model
  tokens = local_batch * config.data.seq_len // context  # one chunk
  kv = 2 * tokens * (m.num_kv_heads or m.num_heads) * m.head_dim
  itemsize = jnp.dtype(m.compute_dtype).itemsize
  ids = 2 * tokens * 4  # each token's original place and document
  forward = (context - 1) * (kv * itemsize + ids)
  backward = context * (kv * itemsize + kv * 4 + ids)  # the chunk and its f32 gradients
  return float(grad_accum * m.num_layers * (forward + backward))


def _context_as_data(config: Config, context: int) -> Config:
  """Context devices each hold a T / C slice of every row: planned as data replicas of C times as many rows of
  T / C tokens."""
  return dataclasses.replace(config, data=dataclasses.replace(config.data, seq_len=config.data.seq_len // context),
                             train=dataclasses.replace(config.train, batch_size=config.train.batch_size * context))


def predict_memory(config: Config, devices: int, expert: int = 1, context: int = 1, grad_accum: int = 1,
                   platform: str | None = None) -> dict[str, float]:
  """Peak bytes per device, by part, of `devices` = data x expert x context devices (no FSDP or tensor axis):
  estimates.predict_memory with the expert and context devices planned as data replicas, then corrected."""
  data = devices // (expert * context)
  as_data = _context_as_data(config, context)
  parts = dict(estimates.predict_memory(as_data, (data * expert * context, 1, 1), grad_accum, platform))
  m = config.model
  if expert > 1:
    elsewhere = expert_param_bytes_f32(m) * (1 - 1 / expert)  # the experts on the other expert devices
    # The params and their moments, f32: AdamW keeps two, Muon (train.optimizer=muon: expert weights are w_*) one.
    parts["state"] -= (2 if config.train.optimizer == "muon" else 3) * elsewhere
    parts["gradients"] -= elsewhere * (2 if grad_accum > 1 else 1)
    local_batch = config.train.batch_size // grad_accum // (data * expert)
    rows = local_batch * config.data.seq_len * m.experts_per_token
    itemsize = jnp.dtype(m.compute_dtype).itemsize
    widths = m.d_model + (3 if m.flavour == "llama" else 2) * m.expert_width  # rows in, hidden, gated hidden
    parts["activations"] += m.num_layers * (expert - 1) * rows * widths * itemsize
    # One layer's backward meets the same P-fold rows, and its four exchange buffers of P x M rows of D.
    parts["working"] += (expert - 1) * rows * widths * itemsize + 4 * expert * rows * m.d_model * itemsize
    held = estimates.state_bytes(as_data, (devices, 1, 1), platform).params_f32 - elsewhere
    backward = parts["gradients"] + parts["activations"] + parts["working"]
    parts["optimizer_extra"] = max(0.0, estimates.OPTIMIZER_PHASE_TREES * held - backward)
  parts["total"] = sum(v for k, v in parts.items() if k != "total")
  return parts


def predict_step_time(config: Config, devices: int, expert: int, context: int, grad_accum: int,
                      hardware: Hardware) -> dict[str, float]:
  """estimates.predict_step_time with the expert and context devices as data replicas, the gradient all-reduce of
  parameters each device holds whole, and the exchange or ring bytes added to the network time."""
  data = devices // (expert * context)
  local_batch = config.train.batch_size // grad_accum // (data * expert)
  as_data = _context_as_data(config, context)
  sizes = (devices, 1, 1)
  platform = hardware.platform or None
  static = estimates.state_bytes(as_data, sizes, platform)
  experts = expert_param_bytes_f32(config.model)
  held = static.params_f32 - experts * (1 - 1 / expert)  # f32 parameter bytes on one device
  # Gradient all-reduces: the dense parameters over every device, a device's experts over its data replicas.
  collective = 2 * (devices - 1) / devices * (static.params_f32 - experts)
  collective += 2 * (data - 1) / data * experts / expert if data > 1 else 0.0
  collective += expert_exchange_bytes(config, expert, local_batch, grad_accum)
  collective += ring_bytes(config, context, local_batch, grad_accum)
  return estimates.predict_step_time(as_data, sizes, grad_accum, hardware,
                                     estimates.activation_model(as_data, sizes, platform), held, collective)


def expert_layouts(config: Config, devices: int, hardware: Hardware, usable_bytes: float) -> list[dict[str, Any]]:
  """One row per expert axis that divides both the devices and the experts: memory per device, network bytes and
  step time at the fewest micro-batches that fit; sorted fastest first, rows that do not fit last."""
  rows = []
  for expert in [p for p in range(1, devices + 1) if devices % p == 0 and config.model.num_experts % p == 0]:
    data = devices // expert
    splits = [k for k in range(1, config.train.batch_size + 1) if config.train.batch_size % k == 0
              and (config.train.batch_size // k) % devices == 0]
    if not splits:  # the batch does not split over these devices
      continue
    for grad_accum in splits:
      memory = predict_memory(config, devices, expert, 1, grad_accum, hardware.platform or None)
      if memory["total"] <= usable_bytes:
        break
    time = predict_step_time(config, devices, expert, 1, grad_accum, hardware)
    local_batch = config.train.batch_size // grad_accum // devices
    rows.append({"mesh": f"data={data} expert={expert}", "expert": expert, "grad_accum": grad_accum,
                 "fits": memory["total"] <= usable_bytes, "memory_gib": memory["total"] / 2**30,
                 "memory_parts_gib": {k: v / 2**30 for k, v in memory.items() if k != "total"},
                 "exchange_gb": expert_exchange_bytes(config, expert, local_batch, grad_accum) / 1e9,
                 "step_time_sec": time["step_time_sec"], "tokens_per_sec": time["tokens_per_sec"]})
  return sorted(rows, key=lambda r: (not r["fits"], r["step_time_sec"]))
