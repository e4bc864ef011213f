"""The mixture-of-experts MLP of the decoder (`model.num_experts > 0`): a float32 router picks
`model.experts_per_token` experts per token, and every token reaches all of them (dropless: no capacity, nothing
dropped). Tokens are sorted by expert and each expert's MLP runs on its own rows through the kernel registry's
grouped matmul (`Kernels.expert_matmul`; `jax.lax.ragged_dot` is the reference).

Extra dimension letters: N tokens (B * T), E experts, k experts per token (in names: `_NK`), M = N * k routed rows,
F each expert's MLP width.

Besides its output, the layer returns its router statistics, each a scalar over the valid tokens:
  router_balance_loss        E * sum_e f_e * P_e, f_e the share of tokens that chose expert e (summing to k) and
                             P_e its mean router probability: k when the load is even (Switch Transformer; HF's
                             Mixtral pools all layers before multiplying, we take it per layer and average)
  router_z_loss              the mean squared log-sum-exp of the router logits (ST-MoE), which keeps them small
  expert_load_max_over_mean  the busiest expert's rows over the mean per expert (1 = perfectly even)
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxlm.kernels import Kernels
from jaxlm.models.layers import MLP, GatedMLP, _normal
from jaxlm.models.precision import Policy
from jaxlm.parallel.sharding import EXPERT_AXIS, batch_axes, constrain


class MoE(nnx.Module):
  """`num_experts` MLPs of width `d_ff` (SwiGLU when `gated`, else a tanh-GELU MLP; no biases), a router, and an
  optional shared MLP of width `shared_d_ff` that every token takes (0: none)."""

  def __init__(self, d_model: int, num_experts: int, experts_per_token: int, d_ff: int, policy: Policy,
               kernels: Kernels, std: float, out_std: float, *, gated: bool, normalize_topk: bool = True,
               shared_d_ff: int = 0, rngs: nnx.Rngs):
    if not 1 <= experts_per_token <= num_experts:
      raise ValueError(f"model.experts_per_token={experts_per_token} must be in [1, model.num_experts={num_experts}]")
    self.policy = policy
    self.kernels = kernels
    self.num_experts = num_experts
    self.experts_per_token = experts_per_token
    self.gated = gated
    self.normalize_topk = normalize_topk
    dt = policy.param_dtype
    e, d, f = num_experts, d_model, d_ff
    # The router stays in float32 whatever the compute dtype: rounding its logits changes which experts win.
    self.w_router = nnx.Param(_normal(rngs, (d, e), std, jnp.float32), axes=("embed", None))
    if gated:
      self.w_gate = nnx.Param(_normal(rngs, (e, d, f), std, dt), axes=("experts", "embed", "expert_mlp"))
      self.w_up = nnx.Param(_normal(rngs, (e, d, f), std, dt), axes=("experts", "embed", "expert_mlp"))
      self.w_down = nnx.Param(_normal(rngs, (e, f, d), out_std, dt), axes=("experts", "expert_mlp", "embed"))
    else:
      self.w_in = nnx.Param(_normal(rngs, (e, d, f), std, dt), axes=("experts", "embed", "expert_mlp"))
      self.w_out = nnx.Param(_normal(rngs, (e, f, d), out_std, dt), axes=("experts", "expert_mlp", "embed"))
    mlp = GatedMLP if gated else MLP
    self.shared = mlp(d_model, shared_d_ff, policy, kernels, std, out_std, rngs=rngs) if shared_d_ff else None

  def route(self, x_ND: jax.Array, w_router_DE: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(router logits [N, E] f32, the chosen experts [N, k], their weights [N, k] f32)."""
    logits_NE = jnp.einsum("nd,de->ne", x_ND.astype(jnp.float32), w_router_DE.astype(jnp.float32))
    probs_NE = jax.nn.softmax(logits_NE, axis=-1)
    weights_NK, experts_NK = jax.lax.top_k(probs_NE, self.experts_per_token)
    if self.normalize_topk:
      weights_NK = weights_NK / jnp.sum(weights_NK, axis=-1, keepdims=True)
    return logits_NE, experts_NK, weights_NK

  def expert_weights(self) -> dict:
    """The experts' weights [E, ...] in the compute dtype (gate and up joined: [E, D, 2F], one grouped matmul)."""
    c = self.policy.cast_to_compute
    if self.gated:
      return {"in": jnp.concatenate([c(self.w_gate[...]), c(self.w_up[...])], axis=2), "out": c(self.w_down[...])}
    return {"in": c(self.w_in[...]), "out": c(self.w_out[...])}

  def experts(self, x_MD: jax.Array, group_sizes_G: jax.Array, weights: dict) -> jax.Array:
    """Each expert's MLP on its rows of x (sorted by expert; rows past the groups give zeros) [M, D]."""
    matmul = self.kernels.expert_matmul
    h_MF = matmul(x_MD, weights["in"], group_sizes_G)
    if self.gated:
      f = h_MF.shape[-1] // 2
      h_MF = jax.nn.silu(h_MF[:, :f]) * h_MF[:, f:]
    else:
      h_MF = jax.nn.gelu(h_MF, approximate=True)
    return matmul(h_MF, weights["out"], group_sizes_G)

  def __call__(self, x_BTD: jax.Array, valid_BT: jax.Array | None = None) -> tuple[jax.Array, dict]:
    """(output [B, T, D], router statistics over the tokens where `valid_BT`; default: all). On a mesh with an
    `expert` axis the experts are split over it and each token's rows travel to their experts' devices and back."""
    if valid_BT is None:
      valid_BT = jnp.ones(x_BTD.shape[:2], bool)
    x_BTD = self.policy.cast_to_compute(x_BTD)
    args = (x_BTD, valid_BT, self.w_router[...], self.expert_weights())
    mesh = jax.sharding.get_abstract_mesh()
    batch_devices = 1 if mesh.empty else math.prod(mesh.shape[a] for a in batch_axes(mesh))
    # A batch the batch devices do not divide (a generated sample's row) runs whole, with the experts gathered.
    if not mesh.empty and jax.sharding.AxisType.Manual not in mesh.axis_types and not x_BTD.shape[0] % batch_devices:
      # On a mesh the layer runs per device in shard_map (so a per-device grouped matmul such as the CPU's BLAS one
      # serves any mesh): each device routes its own tokens; an expert axis exchanges the rows.
      batch = P(batch_axes(mesh))
      y_BTD, sums = jax.shard_map(functools.partial(self._local, exchange=mesh.shape.get(EXPERT_AXIS, 1) > 1),
                                  mesh=mesh, in_specs=(batch, batch, P(), P(EXPERT_AXIS)),
                                  out_specs=(batch, P()))(*args)
    else:
      y_BTD, sums = self._local(*args, exchange=False)
    y_BTD = constrain(y_BTD, ("act_batch", "act_seq", "act_embed"))
    if self.shared is not None:
      y_BTD = y_BTD + self.shared(x_BTD)
    return y_BTD, router_stats(sums)

  def _local(self, x_BTD, valid_BT, w_router_DE, weights, *, exchange: bool) -> tuple[jax.Array, dict]:
    """The layer on this device's tokens (all of them, or its shard inside shard_map; with `exchange` its rows go
    to the devices of their experts along the expert axis and come back), with the router's sums."""
    b, t, d = x_BTD.shape
    n, k = b * t, self.experts_per_token
    x_ND = x_BTD.reshape(n, d)
    logits_NE, experts_NK, gates_NK = self.route(x_ND, w_router_DE)
    # Sort the N * k (token, expert) rows by expert; `order[i]` is the flat (token * k + slot) of sorted row i.
    experts_M = experts_NK.reshape(n * k)
    order_M = jnp.argsort(experts_M, stable=True)
    rows_MD = x_ND[order_M // k]
    if exchange:
      y_MD = self._exchange(rows_MD, experts_M[order_M], weights)
    else:
      y_MD = self.experts(rows_MD, jnp.bincount(experts_M, length=self.num_experts).astype(jnp.int32), weights)
    y_NKD = y_MD[jnp.argsort(order_M)].reshape(n, k, d)  # back to token order
    y_ND = jnp.einsum("nkd,nk->nd", y_NKD, gates_NK.astype(y_NKD.dtype))
    sums = router_sums(logits_NE, experts_NK, valid_BT.reshape(n).astype(jnp.float32))
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.empty and jax.sharding.AxisType.Manual in mesh.axis_types:  # in shard_map: every device's tokens
      sums = jax.lax.psum(sums, batch_axes(mesh))
    return y_ND.reshape(b, t, d), sums

  def _exchange(self, rows_MD: jax.Array, experts_M: jax.Array, weights: dict) -> jax.Array:
    """Expert parallelism inside shard_map: rows sorted by expert go to the device holding their expert (an
    all-to-all over the expert axis), run through its experts, and come back in the same order.

    Dropless with static shapes: each device can send all its M rows to one device, so every (sender, receiver)
    pair gets a buffer of M rows, filled as far as it needs. (XLA:CPU has no ragged all-to-all.)"""
    m, d = rows_MD.shape
    devices = jax.lax.axis_size(EXPERT_AXIS)
    local = self.num_experts // devices
    dest_M = experts_M // local
    sent_P = jnp.bincount(dest_M, length=devices)
    slot_M = jnp.arange(m) - (jnp.cumsum(sent_P) - sent_P)[dest_M]  # a row's place in its receiver's buffer
    send_PMD = jnp.zeros((devices, m, d), rows_MD.dtype).at[dest_M, slot_M].set(rows_MD)
    # Each row's expert on its receiver; `local` marks the unused tail of a buffer.
    send_PM = jnp.full((devices, m), local, jnp.int32).at[dest_M, slot_M].set(experts_M % local)
    recv_PMD = jax.lax.all_to_all(send_PMD, EXPERT_AXIS, 0, 0)
    recv_R = jax.lax.all_to_all(send_PM, EXPERT_AXIS, 0, 0).reshape(devices * m)
    order_R = jnp.argsort(recv_R, stable=True)
    sizes_G = jnp.bincount(recv_R, length=local + 1)[:local].astype(jnp.int32)
    out_RD = self.experts(recv_PMD.reshape(devices * m, d)[order_R], sizes_G, weights)
    back_PMD = out_RD[jnp.argsort(order_R)].reshape(devices, m, d)
    return jax.lax.all_to_all(back_PMD, EXPERT_AXIS, 0, 0)[dest_M, slot_M]


def router_sums(logits_NE: jax.Array, experts_NK: jax.Array, valid_N: jax.Array) -> dict:
  """Sums over the valid tokens that the router statistics are made of (summed over devices before `router_stats`)."""
  e = logits_NE.shape[-1]
  return {
      "tokens": jnp.sum(valid_N),
      "rows_E": jnp.sum(jax.nn.one_hot(experts_NK, e, dtype=jnp.float32) * valid_N[:, None, None], axis=(0, 1)),
      "probs_E": jnp.sum(jax.nn.softmax(logits_NE, axis=-1) * valid_N[:, None], axis=0),
      "z": jnp.sum(jnp.square(jax.nn.logsumexp(logits_NE, axis=-1)) * valid_N),
  }


def router_stats(sums: dict) -> dict:
  """The module docstring's statistics from `router_sums`."""
  tokens = jnp.maximum(sums["tokens"], 1.0)
  rows_E = sums["rows_E"]
  e = rows_E.shape[0]
  return {
      "router_balance_loss": e * jnp.sum(rows_E / tokens * sums["probs_E"] / tokens),
      "router_z_loss": sums["z"] / tokens,
      "expert_load_max_over_mean": jnp.max(rows_E) / jnp.maximum(jnp.mean(rows_E), 1e-9),
  }
