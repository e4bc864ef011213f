"""Benchmark: jaxlm against HF transformers' PyTorch GPT-2 (eager and torch.compile) on the same shapes, in one run.

  python benchmarks/bench.py --config=benchmarks/configs/bench_cpu.py --workdir=runs/bench        # 2-core CPU
  python benchmarks/bench.py --config=benchmarks/configs/bench_gpu.py --workdir=runs/bench_gpu    # one GPU
  python benchmarks/bench.py --config=benchmarks/configs/shakespeare_char.py --workdir=runs/bench_char \
      --frameworks=jaxlm,torch_eager --sections=step                                             # a small recipe

Writes <workdir>/bench.json (a flat object of numbers and strings, keys below) and prints a table.

Sections (--sections, comma-separated):
  peak     FLOP/s of one n^3 matmul in JAX and in torch (n = 1024 on the CPU, 8192 on a GPU); `peak_flops` is the
           best of both, before the steps and after every round of them: the ceiling every `*_peak_ratio` divides
           by (on a GPU also the datasheet bf16 peak: `*_mfu`).
  step     one train step of the config's model: jaxlm's real jitted step (jaxlm.training.steps.jit_steps: loss,
           grads, clip, AdamW, non-finite skip, metrics) and torch's (forward, cross-entropy, backward, clip,
           AdamW). The frameworks take turns: --rounds rounds of --steps_per_round steps each, so a shared
           machine's load falls on all of them alike; each reports the median round. The tokens are fixed
           random ones (the step's time does not depend on them). `<fw>_tokens_per_sec`, `<fw>_step_sec`
           (median), `<fw>_flops_per_sec`, `<fw>_peak_ratio`, per-device memory; for each torch peer `jaxlm_vs_<peer>` (tokens/s ratio, > 1:
           jaxlm faster), the round-by-round ratios' min, max and median (`jaxlm_vs_<peer>_median_round`, with a
           distribution-free ~95% interval for it, `..._median_round_interval`), the CPU-seconds ratio
           (`jaxlm_vs_<peer>_cpu_sec`) and every round's step time. `kernels` is what `auto` resolved to.
  compile  trace + compile seconds of jaxlm's train step at --depths layers (abstract inputs, nothing allocated);
           `compile_ratio_<deepest>_vs_<shallowest>`.
  loader   tokens/s of jaxlm.data's train iterator over a pre-tokenised cache written to and read from the workdir.
  gpu      (accelerators only) cudnn attention against XLA attention on one batch: max |logit difference|.

Devices: on the CPU the bench uses ONE XLA device (unless XLA_FLAGS already sets a count) and both frameworks use
every core: XLA's intra-op thread pool and torch.set_num_threads(os.cpu_count()). FLOPs are
jaxlm.training.telemetry.flops_per_token (model FLOPs, the same formula for both frameworks).
"""

from __future__ import annotations

import os
import sys

# One CPU device for a single-process comparison (the tests simulate 4); must be set before jax is imported.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip()

# On a GPU torch shares the device with JAX in this process: JAX must not grab 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Huge pages for glibc's malloc, for every framework this process runs: cli.run re-executes with them (jaxlm.cli;
# JAXLM_NO_HUGE_PAGES=1 measures without).

import dataclasses  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from absl import flags, logging  # noqa: E402
from flax import nnx  # noqa: E402
from ml_collections import config_flags  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench_torch beside this file
import bench_torch  # noqa: E402

from jaxlm import cli  # noqa: E402
from jaxlm import config as config_lib  # noqa: E402
from jaxlm import data as data_lib  # noqa: E402
from jaxlm import kernels as kernels_lib  # noqa: E402
from jaxlm.models.gpt import GPT  # noqa: E402
from jaxlm.parallel import sharding
from jaxlm.planner import check_against_runs
from jaxlm.training import (
  atomic_files,  # noqa: E402
  optim,
  telemetry,
)
from jaxlm.training import steps as steps_lib  # noqa: E402
from jaxlm.recipes import features as features_lib

_CONFIG = config_flags.DEFINE_config_file("config", "benchmarks/configs/bench_cpu.py", "model and batch to time",
                                          lock_config=True)
_WORKDIR = flags.DEFINE_string("workdir", None, "where bench.json goes")
_SECTIONS = flags.DEFINE_list("sections", ["peak", "step", "compile", "loader", "gpu"], "sections to run")
# torch_eager / torch_compile: HF transformers' GPT-2; torch_nanogpt: nanoGPT's GPT with its train.py defaults, eager.
TORCH_FRAMEWORKS = ("torch_compile", "torch_eager", "torch_nanogpt")
_FRAMEWORKS = flags.DEFINE_list("frameworks", ["jaxlm", "torch_compile", "torch_eager"], "step section contenders: "
                                "jaxlm and any of " + ", ".join(TORCH_FRAMEWORKS))
_ROUNDS = flags.DEFINE_integer("rounds", 5, "rounds of the step section (each framework runs once per round)")
_STEPS_PER_ROUND = flags.DEFINE_integer("steps_per_round", 3, "steps per framework per round")
_WARMUP_STEPS = flags.DEFINE_integer(
    "warmup_steps_per_round", 1, "untimed steps before each framework's timed steps in every round: the first step "
    "after another framework ran is slower (cold caches), which would favour whoever runs later in a round")
_DEPTHS = flags.DEFINE_list("depths", ["2", "12", "24"], "layer counts of the compile section")
_LOADER_BATCHES = flags.DEFINE_integer("loader_batches", 2000, "batches the loader section reads")
flags.mark_flags_as_required(["workdir"])


def load_average() -> float:
  return os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")


def process_cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


def resolved_kernels(config, mesh=None) -> kernels_lib.Kernels:
  """What the config's `kernels` section (`auto` by default) resolves to for this model on this machine."""
  return kernels_lib.resolve(config.kernels, compute_dtype=config.model.compute_dtype,
                             causal=config.model.flavour != "bert", mesh=mesh, **config.model.kernel_needs)


def random_batch(config, seed: int = 0) -> tuple[np.ndarray, dict]:
  """Tokens [B, T+1] and jaxlm's example dict for them: one document per row, every target counted."""
  b, t = config.train.batch_size, config.data.seq_len
  tokens = np.random.default_rng(seed).integers(0, config.model.vocab_size, (b, t + 1)).astype(np.int32)
  return tokens, data_lib.packing.make_examples(tokens, np.ones_like(tokens))


# ----------------------------------------------------------------------------------------------- sections


def peak_section(platform: str, dtype: str) -> dict:
  n = 1024 if platform == "cpu" else 8192
  out = {"peak_matmul_n": n, "peak_jax_flops": telemetry.measure_matmul_flops(n=n, dtype=jnp.dtype(dtype))}
  if bench_torch.available(platform) is None:
    out["peak_torch_flops"] = bench_torch.matmul_flops(n, platform)
  out["peak_flops"] = max(v for k, v in out.items() if k.startswith("peak_") and k.endswith("_flops"))
  if platform != "cpu":
    out["peak_datasheet_flops"], out["peak_datasheet_source"] = telemetry.peak_flops_per_device()
  return out


class JaxlmStep:
  """jaxlm's real train step (features_lib.train_state_from_config + steps_lib.jit_steps) on one fixed batch."""

  def __init__(self, config, batch: dict):
    mesh = sharding.make_mesh(config.mesh)
    optimizer = optim.make_optimizer(config.train)
    graphdef, self.state, shardings, features = features_lib.train_state_from_config(
      config, mesh, optimizer, features_lib.decoder_factory(config, mesh))
    step, _ = steps_lib.jit_steps(graphdef, optimizer, config, mesh, shardings, features)
    self.batch = steps_lib.to_global_batch(batch, mesh)
    started = time.perf_counter()
    compiled = step.lower(self.state, self.batch).compile()
    self.compile_seconds = time.perf_counter() - started
    self.step = compiled
    memory = compiled.memory_analysis()
    self.memory_bytes = {
        "arguments": int(memory.argument_size_in_bytes), "outputs": int(memory.output_size_in_bytes),
        "temporaries": int(memory.temp_size_in_bytes), "aliased": int(memory.alias_size_in_bytes),
    }
    self.run(1)  # first execution: allocations, thread pools

  def run(self, steps: int) -> float:
    """Seconds per step; dispatches each step before waiting on the previous one, as the training loop does."""
    started = time.perf_counter()
    pending = None
    for _ in range(steps):
      self.state, metrics = self.step(self.state, self.batch)
      if pending is not None:
        jax.block_until_ready(pending)
      pending = metrics
    loss = float(jax.device_get(pending)["loss"])
    if not np.isfinite(loss):
      raise FloatingPointError(f"jaxlm loss is {loss}")
    return (time.perf_counter() - started) / steps


def step_section(config, platform: str, peak: float, datasheet_peak: float | None) -> dict:
  tokens, batch = random_batch(config)
  tokens_per_step = config.train.batch_size * config.data.seq_len
  flops_per_token = telemetry.flops_per_token(config.model, config.data.seq_len)
  out: dict = {"tokens_per_step": tokens_per_step, "flops_per_token": flops_per_token}
  contenders = {}
  for name in _FRAMEWORKS.value:
    logging.warning("bench: building %s (load %.1f)", name, load_average())
    if name == "jaxlm":
      contenders[name] = JaxlmStep(config, batch)
      out["jaxlm_compile_sec"] = contenders[name].compile_seconds
      m = contenders[name].memory_bytes
      out.update({f"jaxlm_memory_{k}_bytes": v for k, v in m.items()})
      out["jaxlm_memory_per_device_bytes"] = m["arguments"] + m["outputs"] + m["temporaries"] - m["aliased"]
    else:
      reason = bench_torch.available(platform)
      if config.model.flavour != "gpt2":
        reason = f"no torch reference for flavour {config.model.flavour}"
      if reason:
        out[f"{name}_skipped"] = reason
        continue
      mode, implementation = {"torch_eager": ("eager", "hf"), "torch_compile": ("compile", "hf"),
                              "torch_nanogpt": ("eager", "nanogpt")}[name]
      contenders[name] = bench_torch.TorchGPT2Step(config.model, tokens, mode, platform, implementation,
                                                   config.train.learning_rate, config.train.b2)
      if contenders[name].compile_seconds is not None:
        out[f"{name}_compile_sec"] = contenders[name].compile_seconds
      out["torch_attention"] = contenders[name].attention
  times: dict[str, list[float]] = {name: [] for name in contenders}
  cpu_times: dict[str, list[float]] = {name: [] for name in contenders}
  loads = []
  for _ in range(_ROUNDS.value):
    loads.append(load_average())
    for name, contender in contenders.items():
      if _WARMUP_STEPS.value:
        contender.run(_WARMUP_STEPS.value)
      cpu_before = process_cpu_seconds()
      times[name].append(contender.run(_STEPS_PER_ROUND.value))
      cpu_times[name].append((process_cpu_seconds() - cpu_before) / _STEPS_PER_ROUND.value)
    # The matmul peak again in every round, so the ceiling is the best the machine gave during the comparison.
    peak = max(peak, peak_section(platform, config.model.compute_dtype)["peak_flops"])
  out["peak_flops"] = peak
  out["step_load_average"] = statistics.mean(loads)
  for name, seconds in times.items():
    step_sec = statistics.median(seconds)
    # CPU-seconds (user + system, all threads) per step: what the step costs whatever else runs on the machine.
    out[f"{name}_cpu_sec_per_step"] = statistics.median(cpu_times[name])
    out[f"{name}_step_sec"] = step_sec
    out[f"{name}_step_sec_min"] = min(seconds)
    out[f"{name}_step_sec_rounds"] = [round(x, 4) for x in seconds]  # the raw data behind the medians
    out[f"{name}_tokens_per_sec"] = tokens_per_step / step_sec
    out[f"{name}_flops_per_sec"] = flops_per_token * tokens_per_step / step_sec
    out[f"{name}_peak_ratio"] = out[f"{name}_flops_per_sec"] / peak
    if datasheet_peak:
      out[f"{name}_mfu"] = out[f"{name}_flops_per_sec"] / datasheet_peak
  for name in contenders:
    if name.startswith("torch"):
      memory = contenders[name].memory()
      if memory:
        out[f"{name}_memory_peak_bytes"] = memory["peak_bytes"]
  for peer in TORCH_FRAMEWORKS:
    if "jaxlm" not in times or peer not in times:
      continue
    ratio = f"jaxlm_vs_{peer}"
    out[ratio] = out["jaxlm_tokens_per_sec"] / out[f"{peer}_tokens_per_sec"]
    # The same ratio round by round: how much of the verdict the load could have moved.
    per_round = [p / j for j, p in zip(times["jaxlm"], times[peer])]
    out[f"{ratio}_min_round"], out[f"{ratio}_max_round"] = min(per_round), max(per_round)
    # Paired: the two ran back to back in each round, so the median of the round ratios is less moved by a round
    # the whole machine was slow in than the ratio of the two medians.
    out[f"{ratio}_median_round"] = statistics.median(per_round)
    # Where that median could lie (order statistics, no assumption on the noise): [low, high] and its coverage.
    low, high, coverage = check_against_runs.median_interval(per_round)
    out[f"{ratio}_median_round_interval"] = [low, high]
    out[f"{ratio}_median_round_interval_coverage"] = round(coverage, 4)
    # The same in CPU-seconds per step, which other processes on the machine move less than wall time.
    out[f"{ratio}_cpu_sec"] = out[f"{peer}_cpu_sec_per_step"] / out["jaxlm_cpu_sec_per_step"]
  stats = telemetry.device_memory_stats()
  if "memory/peak_bytes_in_use/max" in stats:
    out["jaxlm_memory_peak_bytes_in_use"] = stats["memory/peak_bytes_in_use/max"]
  return out


def abstract_train_inputs(config):
  """The train step, its abstract state and batch (ShapeDtypeStructs): compiling allocates no parameter."""
  optimizer = optim.make_optimizer(config.train)
  kernels = resolved_kernels(config)
  graphdef, abstract_params = nnx.split(nnx.eval_shape(lambda: GPT(config.model, kernels=kernels, rngs=nnx.Rngs(0))))
  params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_params.to_pure_dict())
  state = {"step": jax.ShapeDtypeStruct((), jnp.int32), "params": params,
           "opt_state": jax.eval_shape(optimizer.init, params)}
  _, batch = random_batch(config)
  batch = {k: jax.ShapeDtypeStruct(v.shape, v.dtype) for k, v in batch.items()}
  step = steps_lib.make_train_step(graphdef, optimizer, optim.learning_rate_schedule(config.train),
                                   steps_lib.DataParallelGradients(config.train.grad_accum))
  return jax.jit(step, donate_argnums=0), state, batch


def compile_section(config) -> dict:
  out: dict = {}
  depths = [int(d) for d in _DEPTHS.value]
  jax.jit(lambda x: x + 1).lower(1.0).compile()  # one-time backend start-up is nobody's compile time
  for depth in depths:
    deeper = dataclasses.replace(config, model=dataclasses.replace(config.model, num_layers=depth))
    step, state, batch = abstract_train_inputs(deeper)
    started, cpu_started = time.perf_counter(), process_cpu_seconds()
    lowered = step.lower(state, batch)
    traced = time.perf_counter()
    lowered.compile()
    done = time.perf_counter()
    out[f"compile_trace_sec_{depth}_layers"] = traced - started
    out[f"compile_sec_{depth}_layers"] = done - traced
    out[f"compile_total_sec_{depth}_layers"] = done - started
    # CPU-seconds of tracing + compiling: the same on a loaded machine, where wall seconds are not.
    out[f"compile_cpu_sec_{depth}_layers"] = process_cpu_seconds() - cpu_started
    logging.warning("bench: %d layers trace %.1f s compile %.1f s", depth, traced - started, done - traced)
  lo, hi = min(depths), max(depths)
  out[f"compile_ratio_{hi}_vs_{lo}_layers"] = (out[f"compile_total_sec_{hi}_layers"] /
                                                out[f"compile_total_sec_{lo}_layers"])
  out[f"compile_cpu_ratio_{hi}_vs_{lo}_layers"] = (out[f"compile_cpu_sec_{hi}_layers"] /
                                                    out[f"compile_cpu_sec_{lo}_layers"])
  out["compile_load_average"] = load_average()
  return out


def loader_section(config, workdir: str) -> dict:
  """The train iterator over packed rows that were saved to and loaded back from a cache folder (as a run does)."""
  t, b = config.data.seq_len, config.train.batch_size
  rows = 4096
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, config.model.vocab_size, (rows, t + 1)).astype(np.int32)
  segments = np.cumsum(rng.random((rows, t + 1)) < 1 / 200, axis=1).astype(np.int32) + 1  # ~200-token documents
  with tempfile.TemporaryDirectory(dir=workdir, prefix="bench_cache_") as cache:
    data_lib.PackedSequences(tokens, segments).save(cache)
    packed = data_lib.PackedSequences.load(cache)
  iterator = data_lib.make_train_iterator(packed, b, seed=0, shuffle=True)
  next(iterator)
  started = time.perf_counter()
  for _ in range(_LOADER_BATCHES.value):
    batch = next(iterator)
  seconds = time.perf_counter() - started
  assert batch["inputs"].shape == (b, t)
  return {"loader_tokens_per_sec": _LOADER_BATCHES.value * b * t / seconds, "loader_batch_shape": f"{b}x{t}",
          "loader_load_average": load_average()}


def gpu_section(config) -> dict:
  """cudnn attention against the XLA reference on one batch of the config's model (its compute dtype: bf16 for
  cuDNN)."""
  t = config.data.seq_len
  tokens = np.random.default_rng(0).integers(0, config.model.vocab_size, (2, t + 1)).astype(np.int32)
  segments = np.ones_like(tokens)
  segments[:, t // 2:] = 2  # two packed documents per row: the mask must keep them apart on both paths
  batch = data_lib.packing.make_examples(tokens, segments)
  logits = {}
  model_config = dataclasses.replace(config.model, num_layers=2, document_mask=True)  # the check, not the speed
  for attention in ("xla", "cudnn"):
    kernels = resolved_kernels(dataclasses.replace(config, kernels=dataclasses.replace(config.kernels,
                                                                                        attention=attention)))
    model = GPT(model_config, kernels=kernels, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model)
    apply = jax.jit(lambda p, ids, pos, seg: nnx.merge(graphdef, p)(ids, pos, seg))
    logits[attention] = np.asarray(apply(params, batch["inputs"], batch["positions"], batch["segment_ids"]))
  scale = float(np.max(np.abs(logits["xla"])))
  return {"cudnn_vs_xla_max_abs_logit_diff": float(np.max(np.abs(logits["cudnn"] - logits["xla"]))),
          "cudnn_vs_xla_logit_scale": scale}


# ----------------------------------------------------------------------------------------------- main

TABLE_ROWS = [("tokens/s", "tokens_per_sec", "{:,.0f}"), ("step s", "step_sec", "{:.3f}"),
              ("CPU s/step", "cpu_sec_per_step", "{:.2f}"),
              ("GFLOP/s", "flops_per_sec", "{:,.1f}", 1e-9), ("of peak", "peak_ratio", "{:.0%}"),
              ("MFU", "mfu", "{:.1%}")]


def print_table(result: dict) -> None:
  names = [n for n in ("jaxlm", *TORCH_FRAMEWORKS) if f"{n}_tokens_per_sec" in result]
  if names:
    print(f"{'':10s}" + "".join(f"{n:>16s}" for n in names))
    for label, key, fmt, *scale in TABLE_ROWS:
      if f"{names[0]}_{key}" in result:
        factor = scale[0] if scale else 1.0
        print(f"{label:10s}" + "".join(f"{fmt.format(result[f'{n}_{key}'] * factor):>16s}" for n in names))
  for key, value in result.items():
    if not any(key.startswith(n + "_") and key.split(n + "_", 1)[1] in {r[1] for r in TABLE_ROWS} for n in names):
      print(f"  {key}: {value:.4g}" if isinstance(value, float) else f"  {key}: {value}")


def main(argv):
  del argv  # flags only: cli.run refuses positional arguments
  logging.set_verbosity(logging.WARNING)
  config = config_lib.from_config_dict(_CONFIG.value)
  workdir = _WORKDIR.value
  os.makedirs(workdir, exist_ok=True)
  platform = jax.default_backend()
  device = jax.devices()[0]
  result: dict = {
      "platform": platform, "device_kind": device.device_kind, "devices": jax.device_count(),
      "cpu_count": os.cpu_count(), "jax_version": jax.__version__, "xla_flags": os.environ.get("XLA_FLAGS", ""),
      "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
      "model": (f"{config.model.flavour} L{config.model.num_layers} d{config.model.d_model} "
                f"h{config.model.num_heads} V{config.model.vocab_size} {config.model.compute_dtype}"),
      "kernels": resolved_kernels(config, sharding.make_mesh(config.mesh)).describe(),
      "batch": f"{config.train.batch_size}x{config.data.seq_len}", "load_average_start": load_average(),
  }
  if bench_torch.available() is None:
    import torch
    result["torch_version"] = torch.__version__
  sections = _SECTIONS.value
  peak, datasheet = None, None
  if "peak" in sections or "step" in sections:
    result.update(peak_section(platform, config.model.compute_dtype))
    peak, datasheet = result["peak_flops"], result.get("peak_datasheet_flops")
  if "step" in sections:
    result.update(step_section(config, platform, peak, datasheet))
  if "compile" in sections:
    result.update(compile_section(config))
  if "loader" in sections:
    result.update(loader_section(config, workdir))
  if "gpu" in sections and platform == "gpu":
    result.update(gpu_section(config))
  result["load_average_end"] = load_average()
  path = os.path.join(workdir, "bench.json")
  atomic_files.write_json(path, result)
  print_table(result)
  print(f"wrote {path}")


if __name__ == "__main__":
  cli.run(main)
