"""Measured counterparts of jaxlm.planner.plan's predictions: a real train step's time and memory, and this host's
rates.

`experiments/plan.py --measure` and `experiments/doctor.py` use these; the planner itself never runs a step.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxlm.config import Config
from jaxlm.parallel import sharding
from jaxlm.planner import estimates, plan
from jaxlm.planner import hardware as hardware_lib
from jaxlm.recipes import features as features_lib
from jaxlm.training import optim, telemetry
from jaxlm.training import steps as steps_lib


def synthetic_batch(batch_size: int, seq_len: int, vocab_size: int, mesh: Mesh, seed: int = 0) -> dict:
  """A random global batch laid out over the mesh, with the keys and dtypes of the data loader's batches."""
  tokens = np.random.default_rng(seed).integers(0, vocab_size, (batch_size, seq_len + 1)).astype(np.int32)
  return steps_lib.to_global_batch({
      "inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": np.ones((batch_size, seq_len), np.int32),
      "positions": np.tile(np.arange(seq_len, dtype=np.int32), (batch_size, 1)),
      "loss_mask": np.ones((batch_size, seq_len), np.float32)}, mesh)


def compiled_train_step(config: Config, devices: Sequence[jax.Device] | None = None,
                        compiler_options: dict[str, Any] | None = None):
  """The real train step of `config` (steps_lib.jit_steps), compiled once for a random global batch on `devices`
  (`compiler_options`: XLA debug options for this compile alone, e.g. {"xla_gpu_enable_triton_gemm": False}):
  returns (compiled step, initial train state, that batch, mesh)."""
  mesh = sharding.make_mesh(config.mesh, devices)
  optimizer = optim.make_optimizer(config.train)
  graphdef, state, shardings, features = features_lib.train_state_from_config(
      config, mesh, optimizer, features_lib.decoder_factory(config, mesh))
  train_step, _ = steps_lib.jit_steps(graphdef, optimizer, config, mesh, shardings, features)
  batch = synthetic_batch(config.train.batch_size, config.data.seq_len, config.model.vocab_size, mesh)
  return train_step.lower(state, batch).compile(compiler_options), state, batch, mesh


def check_step_prediction(config: Config, devices: Sequence[jax.Device] | None = None,
                          hardware: hardware_lib.Hardware | None = None, rounds: int = 3, steps_per_round: int = 3
                          ) -> dict[str, Any]:
  """Runs the real train step on `devices` and sets it beside the planner's prediction.

  `hardware` is the profile to predict with (e.g. the h200 entry of hardware.json on an H200); without it, a
  profile of this host is measured in the same rounds as the step (the best matmul and softmax-stream rates), so
  that a shared, busy machine slows the rates and the step alike. The compiled program's memory and collective
  bytes come from the same executable that runs.
  """
  devices = list(devices if devices is not None else jax.devices())
  compiled, state, batch, mesh = compiled_train_step(config, devices)  # analysed below; the same one is timed
  sizes = tuple(mesh.shape[a] for a in sharding.MESH_AXES)
  state, metrics = compiled(state, batch)
  jax.block_until_ready(metrics)
  step_times, flops, bandwidths = [], [], []
  for _ in range(rounds):
    if hardware is None:
      flops.append(telemetry.measure_matmul_flops(1024, jnp.float32, device=devices[0]))
      bandwidths.append(measure_stream_bandwidth(device=devices[0]))
    for _ in range(steps_per_round):
      started = time.perf_counter()
      state, metrics = compiled(state, batch)
      jax.block_until_ready(metrics)
      step_times.append(time.perf_counter() - started)
  num = len(devices)
  hardware = hardware or host_hardware(max(flops) / num, max(bandwidths) / num, num)
  collective = plan.compiled_collective_bytes(compiled, num)["total"]
  predicted = estimates.predict_step_time(config, sizes, config.train.grad_accum, hardware,
                                     estimates.activation_model(config, sizes, devices[0].platform),
                                     estimates.state_bytes(config, sizes).params_f32, collective)
  return {"mesh": "x".join(map(str, sizes)), "grad_accum": config.train.grad_accum,
          "measured_step_time_sec": min(step_times), "median_step_time_sec": float(np.median(step_times)),
          "predicted_step_time_sec": predicted["step_time_sec"], "predicted": predicted,
          "step_time_error": predicted["step_time_sec"] / min(step_times) - 1,
          "compiled_memory_bytes": plan.compiled_memory_bytes(compiled),
          "predicted_memory_bytes": estimates.predict_memory(
              estimates.as_compiled_on(config, devices[0].platform, sizes), sizes, config.train.grad_accum,
              devices[0].platform)["total"],
          "collective_bytes": collective, "hardware": dataclasses.asdict(hardware)}


def measure_stream_bandwidth(num_elements: int = 2**24, repeats: int = 5, device=None) -> float:
  """Bytes/s a softmax over rows streams (read + write, f32) on the first device: the memory term's rate.

  On a GPU or TPU this is close to the HBM bandwidth; on a CPU the exponentials, not DRAM, limit elementwise work,
  and this measures that limit, which is what the step's non-matmul work runs at."""
  x = jax.device_put(np.random.default_rng(0).standard_normal((num_elements // 1024, 1024), dtype=np.float32),
                     device or jax.devices()[0])
  return 2 * x.nbytes / telemetry.best_seconds(jax.jit(lambda x: jax.nn.softmax(x, axis=-1)), x, repeats=repeats)


def host_hardware(matmul_flops: float, bandwidth: float, num_devices: int) -> hardware_lib.Hardware:
  """A profile of this host from measured per-device rates (a CPU's rates split over its simulated devices)."""
  return hardware_lib.Hardware(
      name=f"{jax.devices()[0].platform}_measured", memory_gib=0.0, bf16_flops=matmul_flops, matmul_efficiency=1.0,
      hbm_bytes_per_sec=bandwidth, interconnect_bytes_per_sec=bandwidth, usd_per_hour_on_demand=0.0,
      usd_per_hour_spot=0.0, description=f"this host, measured: {matmul_flops * num_devices / 1e9:.0f} GFLOP/s "
      f"1024^3 f32 matmul, {bandwidth * num_devices / 1e9:.1f} GB/s softmax stream, over {num_devices} device(s)")


def median_interval(values: Sequence[float], level: float = 0.95) -> tuple[float, float, float]:
  """(low, high, coverage): a distribution-free confidence interval for the median of what `values` sample, from
  their order statistics: [x_(k), x_(n+1-k)] covers the median with probability 1 - 2 P(Binomial(n, 1/2) < k), the
  narrowest such interval with at least `level` (with fewer than 6 values none reaches 95%: then the full range
  and its coverage). For speed ratios measured round by round on a noisy machine: an interval that contains 1.0
  does not say which side is faster."""
  x, n = sorted(values), len(values)
  if n == 0:
    raise ValueError("median_interval needs at least one value")
  coverage = lambda k: 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n
  k = 1
  while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
    k += 1
  return x[k - 1], x[n - k], coverage(k)


# Kinds (jaxlm.planner.hlo_traffic.instruction_kinds, hlo.library_kernel_kind) of the ops that are one library call
# each.
LIBRARY_KINDS = ("matmul", "custom-call", "attention (cuDNN)")


def wall_time_shares(intervals: list[tuple]) -> dict[str, float]:
  """How the wall time from the first op's start to the last op's end splits by what runs at once, given the
  (start, end, kind) of one device's ops (or of the host threads' on a CPU): library calls (matmuls, custom calls,
  cuDNN; one or several) with no XLA op beside them, library calls beside XLA ops, one XLA op alone (a fusion, a
  copy, a collective...), several XLA ops, or nothing. On the CPU this says what thread time cannot: which kind
  of op holds the step's wall time. It does not say how many cores are busy: XLA:CPU splits a large fusion over
  its threads without a trace event per thread."""
  edges = sorted([(start, +1, kind in LIBRARY_KINDS) for start, _, kind in intervals]
                 + [(end, -1, kind in LIBRARY_KINDS) for _, end, kind in intervals])
  running = {True: 0, False: 0}
  shares: collections.Counter = collections.Counter()
  previous = edges[0][0] if edges else 0
  for time_ns, change, library in edges:
    if running[True]:
      state = "library beside XLA ops" if running[False] else "library alone"
    else:
      state = {0: "nothing", 1: "one XLA op"}.get(running[False], "several XLA ops")
    shares[state] += time_ns - previous
    running[library] += change
    previous = time_ns
  total = sum(shares.values()) or 1
  return {state: ns / total for state, ns in shares.most_common() if ns}
