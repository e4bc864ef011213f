"""Ring attention for context parallelism (`mesh.context > 1`, kernels.attention=ring): every row's sequence is split
over the `context` devices for the whole model, and attention passes the key/value chunks round the ring with
`ppermute`, C steps for C devices, combining the blocks with an online softmax (flash attention's running maximum
and sum). Queries go in blocks of QUERY_BLOCK rows, so a device holds one [QUERY_BLOCK, T/C] block of scores per
head at a time, never [T, T]. The backward pass is written by hand (flash attention's, round the ring once more): it
keeps only the local q, k, v, output and log-sum-exp, where autodiff through the ring would keep every chunk that
passed by.

Causal load balance: a causal row's later tokens see more keys, so device c holds chunks c and 2C-1-c of the 2C
equal chunks of the row (`balanced_order`); the model permutes its inputs into that order once, and the mask comes
from each token's place in the original row and its document, never from its place in the permuted one.
"""

from __future__ import annotations

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
  return jax.shard_map(_ring_attention, mesh=mesh, in_specs=(tokens, tokens, tokens, rows, rows), out_specs=tokens)(
      q_BTHK, k_BTGK, v_BTGK, time_BT, segment_ids_BT)


QUERY_BLOCK = 128  # query rows per block: a device holds one [QUERY_BLOCK, T/C] block of scores per head at a time


def _blocks(t: int) -> int:
  """How many query blocks of at most QUERY_BLOCK rows split T (their size divides T)."""
  return t // math.gcd(t, QUERY_BLOCK)


def _split(x: jax.Array, blocks: int) -> jax.Array:
  """[B, T, ...] -> [N, B, T/N, ...]: the queries' blocks along a leading axis."""
  return jnp.moveaxis(x.reshape(x.shape[0], blocks, x.shape[1] // blocks, *x.shape[2:]), 1, 0)


def _visible(time_BQ, segment_BQ, time_BS, segment_BS) -> jax.Array:
  """[B, 1, 1, Q, S]: query q sees key s (causal in the original order, same document)."""
  mask = (time_BQ[:, :, None] >= time_BS[:, None, :]) & (segment_BQ[:, :, None] == segment_BS[:, None, :])
  return mask[:, None, None]


def _pass_on(tree):
  """Every device's chunk to the next device round the ring."""
  devices = jax.lax.axis_size(CONTEXT_AXIS)
  return jax.tree.map(lambda x: jax.lax.ppermute(x, CONTEXT_AXIS, [(i, (i + 1) % devices) for i in range(devices)]),
                      tree)


def _forward(q_BTHK, k_BTGK, v_BTGK, time_BT, segment_BT):
  """(output [B, T, H, K], log-sum-exp of each query's scores [N, B, G, R, Q] f32)."""
  b, t, h, k = q_BTHK.shape
  g = k_BTGK.shape[2]
  blocks = _blocks(t)
  q_NBQGRK = _split((q_BTHK * (1 / math.sqrt(k))).reshape(b, t, g, h // g, k), blocks)
  time_NBQ, segment_NBQ = _split(time_BT, blocks), _split(segment_BT, blocks)

  def fold(kv, stats):
    """Every query block against the key/value chunk `kv`: the running maximum, sum and unnormalised output."""
    k_BSGK, v_BSGK, time_BS, segment_BS = kv

    def one(_, xs):
      q_BQGRK, time_BQ, segment_BQ, max_BGRQ, sum_BGRQ, out_BGRQK = xs
      visible = _visible(time_BQ, segment_BQ, time_BS, segment_BS)
      scores = jnp.einsum("bqgrk,bsgk->bgrqs", q_BQGRK, k_BSGK, preferred_element_type=jnp.float32)
      new_max = jnp.maximum(max_BGRQ, jnp.max(jnp.where(visible, scores, MASK_VALUE), axis=-1))
      probs = jnp.where(visible, jnp.exp(scores - new_max[..., None]), 0.0)
      rescale = jnp.exp(max_BGRQ - new_max)
      out = out_BGRQK * rescale[..., None] + jnp.einsum("bgrqs,bsgk->bgrqk", probs.astype(v_BSGK.dtype), v_BSGK,
                                                         preferred_element_type=jnp.float32)
      return None, (new_max, sum_BGRQ * rescale + jnp.sum(probs, axis=-1), out)

    return jax.lax.scan(one, None, (q_NBQGRK, time_NBQ, segment_NBQ, *stats))[1]

  def step(carry, _):
    kv, stats = carry
    return (_pass_on(kv), fold(kv, stats)), None

  # Zeros made from q, so that they vary over the devices as the loop's results do (shard_map's type check).
  zeros_NBGRQK = jnp.moveaxis(jnp.zeros_like(q_NBQGRK, jnp.float32) * q_NBQGRK, 2, 4)
  stats = (zeros_NBGRQK[..., 0] + MASK_VALUE, zeros_NBGRQK[..., 0], zeros_NBGRQK)
  devices = jax.lax.axis_size(CONTEXT_AXIS)
  (kv, stats), _ = jax.lax.scan(step, ((k_BTGK, v_BTGK, time_BT, segment_BT), stats), None, length=devices - 1)
  maxes, sums, out = fold(kv, stats)  # the last chunk: nothing left to pass on
  out_NBGRQK = out / sums[..., None]  # every query sees at least its own key: no empty row
  # [N, B, G, R, Q, K] -> [B, N, Q, G, R, K] -> [B, T, H, K]
  out_BTHK = out_NBGRQK.transpose(1, 0, 4, 2, 3, 5).reshape(b, t, h, k).astype(q_BTHK.dtype)
  return out_BTHK, maxes + jnp.log(sums)


@jax.custom_vjp
def _ring_attention(q_BTHK, k_BTGK, v_BTGK, time_BT, segment_BT):
  return _forward(q_BTHK, k_BTGK, v_BTGK, time_BT, segment_BT)[0]


def _ring_fwd(q_BTHK, k_BTGK, v_BTGK, time_BT, segment_BT):
  out_BTHK, lse_NBGRQ = _forward(q_BTHK, k_BTGK, v_BTGK, time_BT, segment_BT)
  return out_BTHK, (q_BTHK, k_BTGK, v_BTGK, time_BT, segment_BT, out_BTHK, lse_NBGRQ)


def _ring_bwd(residuals, dout_BTHK):
  """Flash attention's backward round the ring: the key/value chunks travel again, each with the gradients of its
  keys and values, which every device adds its queries' share to; after C steps they are home. Only the local q, k,
  v, output and log-sum-exp were kept from the forward pass."""
  q_BTHK, k_BTGK, v_BTGK, time_BT, segment_BT, out_BTHK, lse_NBGRQ = residuals
  b, t, h, k = q_BTHK.shape
  g = k_BTGK.shape[2]
  blocks = _blocks(t)
  scale = 1 / math.sqrt(k)
  grouped = lambda x: _split(x.reshape(b, t, g, h // g, k), blocks)  # noqa: E731  [N, B, Q, G, R, K]
  q_N, dout_N = grouped(q_BTHK * scale), grouped(dout_BTHK)
  # D = rowsum(dout * out): the softmax's backward term per query, [N, B, G, R, Q].
  delta_N = jnp.moveaxis(jnp.sum(dout_N.astype(jnp.float32) * grouped(out_BTHK), axis=-1), 2, 4)
  time_N, segment_N = _split(time_BT, blocks), _split(segment_BT, blocks)

  def step(carry, _):
    (k_BSGK, v_BSGK, time_BS, segment_BS, dk_BSGK, dv_BSGK), dq_N = carry

    def one(grads, xs):
      dk, dv = grads
      q, dout, time_BQ, segment_BQ, lse, delta, dq = xs
      visible = _visible(time_BQ, segment_BQ, time_BS, segment_BS)
      scores = jnp.einsum("bqgrk,bsgk->bgrqs", q, k_BSGK, preferred_element_type=jnp.float32)
      probs = jnp.where(visible, jnp.exp(scores - lse[..., None]), 0.0)
      dv = dv + jnp.einsum("bgrqs,bqgrk->bsgk", probs, dout.astype(jnp.float32))
      dprobs = jnp.einsum("bqgrk,bsgk->bgrqs", dout, v_BSGK, preferred_element_type=jnp.float32)
      dscores = probs * (dprobs - delta[..., None])
      dq = dq + jnp.einsum("bgrqs,bsgk->bqgrk", dscores, k_BSGK.astype(jnp.float32)) * scale
      dk = dk + jnp.einsum("bgrqs,bqgrk->bsgk", dscores, q.astype(jnp.float32))
      return (dk, dv), dq

    (dk_BSGK, dv_BSGK), dq_N = jax.lax.scan(one, (dk_BSGK, dv_BSGK),
                                            (q_N, dout_N, time_N, segment_N, lse_NBGRQ, delta_N, dq_N))
    return (_pass_on((k_BSGK, v_BSGK, time_BS, segment_BS, dk_BSGK, dv_BSGK)), dq_N), None

  zeros_kv = jnp.zeros_like(k_BTGK, jnp.float32) * k_BTGK  # varying over the devices, like the loop's results
  dq_N = jnp.zeros_like(q_N, jnp.float32) * q_N
  chunk = (k_BTGK, v_BTGK, time_BT, segment_BT, zeros_kv, zeros_kv)
  # C steps: after the last one each chunk, with its gradients, is back on its own device.
  ((*_, dk_BSGK, dv_BSGK), dq_N), _ = jax.lax.scan(step, (chunk, dq_N), None, length=jax.lax.axis_size(CONTEXT_AXIS))
  dq_BTHK = jnp.moveaxis(dq_N, 0, 1).reshape(b, t, h, k)
  return dq_BTHK.astype(q_BTHK.dtype), dk_BSGK.astype(k_BTGK.dtype), dv_BSGK.astype(v_BTGK.dtype), None, None


_ring_attention.defvjp(_ring_fwd, _ring_bwd)
