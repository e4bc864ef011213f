"""Ring attention for context parallelism (`mesh.context > 1`, kernels.attention=ring): every row's sequence is split
over the `context` devices for the whole model, and attention passes the key/value chunks round the ring with
`ppermute`, C steps for C devices, combining the blocks with an online softmax (flash attention's running maximum
and sum). Each step's scores are recomputed in the backward pass (a checkpointed step), so a device holds one
[T/C, T/C] block of scores at a time and never the [T, T] matrix.

Causal load balance: a causal row's later tokens see more keys, so device c holds chunks c and 2C-1-c of the 2C
equal chunks of the row (`balanced_order`); the model permutes its inputs into that order once, and the mask comes
from each token's place in the original row and its document, never from its place in the permuted one.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxlm.kernels.attention import MASK_VALUE
from jaxlm.parallel.sharding import CONTEXT_AXIS, batch_axes


def balanced_order(length: int, devices: int) -> np.ndarray:
  """The row's token indices in the order the context devices hold them: device c gets chunks c and 2C-1-c."""
  if length % (2 * devices):
    raise ValueError(f"data.seq_len={length} is not divisible by 2 * mesh.context={2 * devices}")
  chunks = np.arange(length).reshape(2 * devices, length // (2 * devices))
  return np.concatenate([np.concatenate([chunks[c], chunks[2 * devices - 1 - c]]) for c in range(devices)])


def ring_attention(q_BTHK: jax.Array, k_BTGK: jax.Array, v_BTGK: jax.Array, time_BT: jax.Array,
                   segment_ids_BT: jax.Array) -> jax.Array:
  """Causal attention within documents: query i sees key j when time[j] <= time[i] and both belong to the same
  document (segment id), where `time` is each token's index in its original row. All arrays in the permuted order,
  sharded over the batch axes and `context` (the enclosing mesh's); returns [B, T, H, K] like them."""
  mesh = jax.sharding.get_abstract_mesh()
  batch = batch_axes(mesh)
  tokens, rows = P(batch, CONTEXT_AXIS, None, None), P(batch, CONTEXT_AXIS)
  return jax.shard_map(_ring, mesh=mesh, in_specs=(tokens, tokens, tokens, rows, rows), out_specs=tokens)(
      q_BTHK, k_BTGK, v_BTGK, time_BT, segment_ids_BT)


def _ring(q_BTHK, k_BTGK, v_BTGK, time_BT, segment_BT):
  b, t, h, k = q_BTHK.shape
  g = k_BTGK.shape[2]
  devices = jax.lax.axis_size(CONTEXT_AXIS)
  shift = [(i, (i + 1) % devices) for i in range(devices)]
  q_BTGRK = (q_BTHK * (1 / math.sqrt(k))).reshape(b, t, g, h // g, k)

  @functools.partial(jax.checkpoint, prevent_cse=False)
  def block(q_BTGRK, k_BSGK, v_BSGK, time_BS, segment_BS, max_BGRT, sum_BGRT, out_BGRTK):
    """One key/value chunk folded into the running maximum, sum and (unnormalised) output."""
    visible_BTS = (time_BT[:, :, None] >= time_BS[:, None, :]) & (segment_BT[:, :, None] == segment_BS[:, None, :])
    scores = jnp.einsum("btgrk,bsgk->bgrts", q_BTGRK, k_BSGK, preferred_element_type=jnp.float32)
    scores = jnp.where(visible_BTS[:, None, None], scores, MASK_VALUE)
    new_max = jnp.maximum(max_BGRT, jnp.max(scores, axis=-1))
    probs = jnp.where(visible_BTS[:, None, None], jnp.exp(scores - new_max[..., None]), 0.0)
    rescale = jnp.exp(max_BGRT - new_max)
    out = out_BGRTK * rescale[..., None] + jnp.einsum("bgrts,bsgk->bgrtk", probs.astype(v_BSGK.dtype), v_BSGK,
                                                       preferred_element_type=jnp.float32)
    return new_max, sum_BGRT * rescale + jnp.sum(probs, axis=-1), out

  def step(carry, _):
    kv, stats = carry
    stats = block(q_BTGRK, *kv, *stats)
    kv = jax.tree.map(lambda x: jax.lax.ppermute(x, CONTEXT_AXIS, shift), kv)
    return (kv, stats), None

  # Zeros made from q, so that they vary over the devices as the loop's results do (shard_map's type check).
  zeros_BGRTK = jnp.zeros_like(q_BTGRK, jnp.float32).transpose(0, 2, 3, 1, 4) * q_BTGRK.transpose(0, 2, 3, 1, 4)
  zeros_BGRT = zeros_BGRTK[..., 0]
  stats = (zeros_BGRT + MASK_VALUE, zeros_BGRT, zeros_BGRTK)
  (kv, stats), _ = jax.lax.scan(step, ((k_BTGK, v_BTGK, time_BT, segment_BT), stats), None, length=devices - 1)
  _, sums, out = block(q_BTGRK, *kv, *stats)  # the last chunk: nothing left to pass on
  out_BGRTK = out / sums[..., None]  # every query sees at least its own key: no empty row
  return out_BGRTK.transpose(0, 3, 1, 2, 4).reshape(b, t, h, k).astype(q_BTHK.dtype)
