"""Pipeline parallelism over the `pipeline` mesh axis: static schedules, their cost figures, and the step.

Stage s holds layers [s * L/S, (s + 1) * L/S) of the stacked blocks (the `layers` axis of every block parameter is
sharded over `pipeline`, so parameters keep their global shapes and checkpoints move between layouts). The batch's
`train.grad_accum` micro-batches flow through the stages; a schedule is a static table saying, for every tick and
stage, which micro-batch it runs forward and which backward. Schedules:

  gpipe  all forwards, then all backwards: every stage keeps the inputs of all M micro-batches until its backward
  1f1b   each micro-batch's backward starts as soon as its forward has left the last stage, so stage s keeps at most
         2 (S - 1 - s) + 1 micro-batch inputs (at most 2S - 1, whatever M); same bubble as gpipe

Both have the bubble (S - 1) / (M + S - 1): the backward cost does not change it, since every tick waits for the
slowest stage. The step (`make_gradient_fn`) is one `shard_map` over every mesh axis: `ppermute` carries
activations forward and their gradients back, and each backward recomputes its stage's forward from the kept input
(stage-level rematerialisation), so a stage keeps only [micro-batch, T, D] inputs between its forward and backward.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxlm.training import optim
from jaxlm.parallel import sharding
from jaxlm.config import validate_schedule


@dataclasses.dataclass(frozen=True)
class Schedule:
  """forward[t, s] / backward[t, s]: the micro-batch stage s runs forward / backward at tick t, or -1 for none.
  Within a tick the forward runs first, so the last stage can take a micro-batch's loss gradient in the tick of its
  forward. Activations sent at the end of tick t are used at tick t + 1."""
  name: str
  forward: np.ndarray  # int32 [ticks, stages]
  backward: np.ndarray  # int32 [ticks, stages]

  @property
  def num_ticks(self) -> int:
    return self.forward.shape[0]

  @property
  def num_stages(self) -> int:
    return self.forward.shape[1]


@functools.lru_cache(maxsize=None)
def make_schedule(num_stages: int, num_microbatches: int, schedule: str) -> Schedule:
  validate_schedule(num_stages, num_microbatches, schedule)
  s_, m_ = num_stages, num_microbatches
  if schedule == "gpipe":
    ticks = 2 * (m_ + s_ - 1)
    fwd_tick = lambda m, s: m + s
    # Backwards in reverse micro-batch order: the last forward's input is the first one freed.
    bwd_tick = lambda m, s: (m_ + s_ - 1) + (m_ - 1 - m) + (s_ - 1 - s)
  else:  # 1f1b
    ticks = m_ + 2 * s_ - 2
    fwd_tick = lambda m, s: m + s
    bwd_tick = lambda m, s: m + 2 * s_ - 2 - s
  forward = np.full((ticks, s_), -1, np.int32)
  backward = np.full((ticks, s_), -1, np.int32)
  for m in range(m_):
    for s in range(s_):
      forward[fwd_tick(m, s), s] = m
      backward[bwd_tick(m, s), s] = m
  return Schedule(schedule, forward, backward)


def stash_slots(num_stages: int, num_microbatches: int, schedule: str) -> int:
  """Micro-batch stage inputs ([micro-batch, T, D] each) a stage keeps at the peak: its activation footprint
  between forward and backward (the live activations of one stage's forward + backward come on top)."""
  table = make_schedule(num_stages, num_microbatches, schedule)
  return max(_in_flight(table, s) for s in range(num_stages))


def _in_flight(table: Schedule, stage: int) -> int:
  held, peak = 0, 0
  for t in range(table.num_ticks):
    held += int(table.forward[t, stage] >= 0)
    peak = max(peak, held)
    held -= int(table.backward[t, stage] >= 0)
  return peak


def bubble_fraction(num_stages: int, num_microbatches: int, schedule: str = "gpipe",
                    backward_cost: float = 2.0) -> float:
  """Fraction of a step the devices idle: 1 - useful work / (ticks' time x stages), where a tick lasts as long as
  its slowest stage (forward cost 1, backward `backward_cost`). 0 for one stage."""
  table = make_schedule(num_stages, num_microbatches, schedule)
  tick_costs = (table.forward >= 0) * 1.0 + (table.backward >= 0) * backward_cost  # [ticks, stages]
  elapsed = tick_costs.max(axis=1).sum()
  useful = num_microbatches * (1.0 + backward_cost)
  return float(1.0 - useful / elapsed)


def num_ticks(num_stages: int, num_microbatches: int, schedule: str) -> int:
  return make_schedule(num_stages, num_microbatches, schedule).num_ticks


def ppermute_bytes_per_device(num_stages: int, num_microbatches: int, schedule: str, micro_batch_rows: int,
                              seq_len: int, d_model: int, bytes_per_element: int) -> int:
  """Bytes one device sends per step over the pipeline axis: a [rows, T, D] activation in every tick in which any
  stage runs a forward, and a gradient of that size in every tick with a backward (`micro_batch_rows` is a device's
  share of a micro-batch, batch_size / (grad_accum * data * fsdp)). 0 for one stage."""
  if num_stages == 1:
    return 0
  table = make_schedule(num_stages, num_microbatches, schedule)
  sends = int((table.forward >= 0).any(axis=1).sum() + (table.backward >= 0).any(axis=1).sum())
  return sends * micro_batch_rows * seq_len * d_model * bytes_per_element


# ----------------------------------------------------------------------------------------------- the step


def _segments(table: Schedule) -> list[tuple[bool, bool, np.ndarray, np.ndarray]]:
  """Consecutive ticks with the same kinds of work (forward only, both, backward only): each becomes one scan whose
  body runs and sends only what those ticks need."""
  kinds = list(zip((table.forward >= 0).any(axis=1), (table.backward >= 0).any(axis=1)))
  segments, start = [], 0
  for t in range(1, len(kinds) + 1):
    if t == len(kinds) or kinds[t] != kinds[start]:
      do_forward, do_backward = kinds[start]
      segments.append((bool(do_forward), bool(do_backward), table.forward[start:t], table.backward[start:t]))
      start = t
  return segments


def num_stages(mesh) -> int:
  """The size of a mesh's `pipeline` axis (1 for no mesh or a mesh without one)."""
  return 1 if mesh is None else dict(mesh.shape).get(sharding.PIPELINE_AXIS, 1)


@dataclasses.dataclass(frozen=True)
class PipelineGradients:
  """The pipeline as a run's gradient function (steps.Gradients): the language model's own loss, computed stage by
  stage under `schedule`; it takes no other loss (fine-tuning) and no trainable/frozen split (LoRA)."""
  graphdef: nnx.GraphDef
  mesh: Any
  num_microbatches: int
  schedule: str

  def __call__(self, loss_fn, multiplier):
    del loss_fn  # the stages compute the language model's loss from the graph definition
    gradient_fn = make_gradient_fn(self.graphdef, self.mesh, self.num_microbatches, self.schedule)
    return lambda params, batch: gradient_fn(params, batch, loss_scale=multiplier)

  @property
  def metrics(self) -> dict:
    """The schedule's idle share of the step: a constant of the layout, reported beside its throughput."""
    return {"pipeline_bubble": jnp.float32(bubble_fraction(num_stages(self.mesh), self.num_microbatches,
                                                           self.schedule))}

  def report_facts(self, config, mesh, state) -> dict:
    return report_facts(config, mesh, state)


def make_gradient_fn(graphdef, mesh, num_microbatches: int, schedule: str):
  """(params, batch, loss_scale=None) -> (mean loss, token count, gradients, {"correct": ...}), as
  steps.make_gradient_fn: the same token-weighted mean over the whole batch, computed by the schedule over the
  `pipeline` axis. A `loss_scale` (float16) multiplies the loss and seeds the backward pass with it, as
  steps.scaled_loss_fn does, so the loss and gradients come back scaled.

  The embeddings and the output head are replicated over `pipeline` (only the first / last stage computes them)
  because a tied GPT-2 table is needed at both ends: replication costs its memory per stage, a sharded table would
  cost a transfer of it every step. Their gradient is one psum over the stages."""
  stages = num_stages(mesh)
  table = make_schedule(stages, num_microbatches, schedule)
  slots = stash_slots(stages, num_microbatches, schedule)
  pipe, batch_axes = sharding.PIPELINE_AXIS, sharding.batch_axes(mesh)
  send_forward = [(s, s + 1) for s in range(stages - 1)]
  send_backward = [(s + 1, s) for s in range(stages - 1)]

  def per_device(specs, params, batch, loss_scale):
    stage = jax.lax.axis_index(pipe)
    first, last = stage == 0, stage == stages - 1
    full = jax.tree.map(_gather_fsdp, params, specs)  # a stage's own layers, whole; once per step
    # Embeddings and head (`rest`) are replicated over the stages and run on the first / last: a tied table is
    # needed at both ends, and a copy per stage is cheaper than moving it every step.
    blocks, rest = full["blocks"], {k: v for k, v in full.items() if k != "blocks"}
    model = lambda rest, blocks: nnx.merge(graphdef, {**rest, "blocks": blocks})
    micro = optim.split_micro_batches(batch, num_microbatches)  # [M, rows, ...]

    def take(i):
      return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, jnp.maximum(i, 0), keepdims=False), micro)

    def embed(rest, mb):
      return model(rest, blocks).embed(mb["inputs"], mb["positions"])

    def run_stage(blocks, rest, x, mb):
      return model(rest, blocks).run_blocks(x, mb["positions"], mb["segment_ids"])[0]

    def stage_loss(blocks, rest, kept, mb):
      """The stage as a function of its parameters and kept input: (output, loss sum), correct predictions."""
      x = jax.lax.cond(first, lambda: embed(rest, mb).astype(kept.dtype), lambda: kept)
      y = run_stage(blocks, rest, x, mb)

      def head():
        loss_sum, correct = model(rest, blocks).hidden_loss_sums(y, mb["targets"], mb["loss_mask"].astype(jnp.float32))
        return loss_sum.astype(jnp.float32), correct.astype(jnp.float32)

      loss_sum, correct = jax.lax.cond(last, head, lambda: (jnp.zeros((), jnp.float32),) * 2)
      return (y, loss_sum), correct

    mb0 = take(jnp.zeros((), jnp.int32))
    x_shape = jax.eval_shape(lambda: embed(rest, mb0))
    zeros_x = jnp.zeros(x_shape.shape, x_shape.dtype)
    f32_zeros = lambda tree: jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), tree)
    carry = {"kept": jnp.zeros((slots,) + x_shape.shape, x_shape.dtype), "x_in": zeros_x, "grad_in": zeros_x,
             "d_blocks": f32_zeros(blocks), "d_rest": f32_zeros(rest),
             "loss_sum": jnp.zeros((), jnp.float32), "correct": jnp.zeros((), jnp.float32)}

    def forward(carry, f):
      """Runs micro-batch f (-1: none) forward; the last stage only keeps its input (its backward recomputes)."""
      mb = take(f)
      x = jax.lax.cond(first, lambda: embed(rest, mb).astype(zeros_x.dtype), lambda: carry["x_in"])
      y = jax.lax.cond((f >= 0) & ~last, lambda: run_stage(blocks, rest, x, mb), lambda: zeros_x)
      slot = jnp.maximum(f, 0) % slots
      kept_x = jnp.where(f >= 0, x, carry["kept"][slot])
      return {**carry, "kept": jax.lax.dynamic_update_index_in_dim(carry["kept"], kept_x, slot, 0)}, y

    def backward(carry, b):
      """Micro-batch b's (-1: none) backward: the stage's forward recomputed from its kept input, then its vjp."""
      mb, kept = take(b), carry["kept"][jnp.maximum(b, 0) % slots]

      def run():
        (_, loss_sum), vjp, correct = jax.vjp(lambda bl, re, x: stage_loss(bl, re, x, mb), blocks, rest, kept,
                                              has_aux=True)
        cotangent = (jnp.where(last, jnp.zeros_like(carry["grad_in"]), carry["grad_in"]),
                     jnp.where(last, loss_scale, 0.0).astype(jnp.float32))
        d_blocks, d_rest, d_x = vjp(cotangent)
        return _f32(d_blocks), _f32(d_rest), d_x, loss_sum, correct

      def idle():
        return f32_zeros(blocks), f32_zeros(rest), zeros_x, jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32)

      d_blocks, d_rest, d_x, loss_sum, correct = jax.lax.cond(b >= 0, run, idle)
      return {**carry, "d_blocks": jax.tree.map(jnp.add, carry["d_blocks"], d_blocks),
              "d_rest": jax.tree.map(jnp.add, carry["d_rest"], d_rest),
              "loss_sum": carry["loss_sum"] + loss_sum, "correct": carry["correct"] + correct}, d_x

    for do_forward, do_backward, forward_rows, backward_rows in _segments(table):

      def tick(carry, rows, do_forward=do_forward, do_backward=do_backward):
        f_row, b_row = rows
        if do_forward:
          carry, y = forward(carry, f_row[stage])
        if do_backward:
          carry, d_x = backward(carry, b_row[stage])
        # Sent after both: the last stage's backward in a 1f1b tick reads the input its forward just kept.
        if do_forward:
          carry = {**carry, "x_in": jax.lax.ppermute(y, pipe, send_forward)}
        if do_backward:
          carry = {**carry, "grad_in": jax.lax.ppermute(d_x, pipe, send_backward)}
        return carry, None

      carry, _ = jax.lax.scan(tick, carry, (jnp.asarray(forward_rows), jnp.asarray(backward_rows)))

    count = jax.lax.psum(batch["loss_mask"].astype(jnp.float32).sum(), batch_axes)
    loss_sum = jax.lax.psum(carry["loss_sum"], (pipe,) + tuple(batch_axes))
    correct = jax.lax.psum(carry["correct"], (pipe,) + tuple(batch_axes))
    d_rest = jax.lax.psum(carry["d_rest"], pipe)  # the first stage's embedding and the last stage's head
    grads = jax.tree.map(_reduce_over_batch, {**d_rest, "blocks": carry["d_blocks"]}, specs)
    denominator = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / denominator, grads)
    return loss_sum * loss_scale / denominator, count, grads, {"correct": correct}

  def gradient_fn(params, batch, loss_scale=None):
    abstract = nnx.split(nnx.merge(graphdef, params))[1]  # the parameters' logical axes, for their specs
    specs = jax.tree.map(lambda s: s.spec, sharding.param_shardings(abstract, mesh))
    batch_spec = P(batch_axes)
    # check_vma=False: the reductions are written out below (as in steps.make_gradient_fn's shard_map path).
    run = jax.shard_map(functools.partial(per_device, specs), mesh=mesh, in_specs=(specs, batch_spec, P()),
                        out_specs=(P(), P(), specs, P()), check_vma=False)
    return run(params, batch, jnp.asarray(1.0 if loss_scale is None else loss_scale, jnp.float32))

  return gradient_fn


def _f32(tree):
  return jax.tree.map(lambda g: g.astype(jnp.float32), tree)


def _fsdp_dims(spec) -> list[int]:
  """The dimension a parameter is sharded along over `fsdp` (RULES put `embed` there), as a list of 0 or 1."""
  dims = [i for i, entry in enumerate(spec)
          if "fsdp" in ((entry,) if isinstance(entry, str) else tuple(entry or ()))]
  if len(dims) > 1 or any(not isinstance(spec[i], str) for i in dims):
    raise ValueError(f"a parameter sharded as {spec} (fsdp on several axes) is not supported by mesh.pipeline")
  return dims


def _gather_fsdp(x, spec):
  for dim in _fsdp_dims(spec):
    x = jax.lax.all_gather(x, "fsdp", axis=dim, tiled=True)
  return x


def _reduce_over_batch(g, spec):
  """Sums a gradient over the batch axes; along an fsdp-sharded dimension as a reduce-scatter (each keeps its shard)."""
  g = jax.lax.psum(g, "data")
  dims = _fsdp_dims(spec)
  if not dims:
    return jax.lax.psum(g, "fsdp")
  for dim in dims:
    g = jax.lax.psum_scatter(g, "fsdp", scatter_dimension=dim, tiled=True)
  return g


# ----------------------------------------------------------------------------------------------- reporting


def report_facts(config, mesh, state) -> dict:
  """What report.md and the run's summary say about a pipeline layout: its schedule's bubble, the inputs a stage
  keeps, and the train state's bytes on each stage's first device (measured from the arrays' shards)."""
  stages = num_stages(mesh)
  if stages == 1:
    return {}
  m, t = config.model, config.train
  schedule = config.mesh.pipeline_schedule
  rows = t.batch_size // (t.grad_accum * mesh.shape["data"] * mesh.shape["fsdp"])
  kept = stash_slots(stages, t.grad_accum, schedule)
  first_devices = np.asarray(mesh.devices).reshape(stages, -1)[:, 0]
  state_bytes = [sum(shard.data.nbytes for leaf in jax.tree.leaves(state) for shard in leaf.addressable_shards
                     if shard.device == device) for device in first_devices]
  return {
      "pipeline_stages": stages,
      "pipeline_schedule": schedule,
      "pipeline_bubble": round(bubble_fraction(stages, t.grad_accum, schedule), 4),
      "pipeline_kept_inputs": kept,
      "pipeline_kept_input_mib": round(kept * rows * config.data.seq_len * m.d_model
                                       * jnp.dtype(m.compute_dtype).itemsize / 2**20, 3),
      "pipeline_state_mib_per_stage": "/".join(f"{b / 2**20:.2f}" for b in state_bytes),
  }
