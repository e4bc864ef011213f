"""Training telemetry: FLOPs and MFU, tokens/s, device memory, metrics.jsonl + TensorBoard, the progress bar.

Nothing here touches device arrays inside the hot loop: the loop fetches its metrics one step late (the device has
already finished that step) and hands this module plain Python floats. The one exception is `measure_matmul_flops`,
which runs once per process, before training, when the device kind is not in `PEAK_FLOPS_BF16`.

Conventions shared with `metrics.jsonl` readers (docs/configuration.md): `mfu` is a fraction in [0, 1], not a
percentage; `tokens_per_sec` counts every token of the global batch (all devices, all processes).
The end-of-run report is `jaxlm/training/report.py`.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import os
import sys
import tempfile
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import tqdm

from jaxlm.config import LORA_MATMUL_WEIGHTS, LORA_TARGET_GROUPS, LoRAConfig, ModelConfig


def flops_per_token(model: ModelConfig, seq_len: int, num_labels: int = 0, lora: LoRAConfig | None = None) -> float:
  """Training FLOPs per token (forward + backward = 3x forward) of the model's matmuls, for every flavour.

  Convention (PaLM paper, appendix B; also nanoGPT / Chinchilla-style MFU): 6 FLOPs per matmul parameter per token
  (2 per multiply-add, times 3 for forward + backward) plus the attention matmuls:
    per layer  q and output projections   2 * D * H * K          (H * K = d_model)
               k and v projections        2 * D * G * K          (G = num_kv_heads: grouped/multi-query shrink them)
               MLP                        2 * D * F  (gpt2, bert: up, down)  or  3 * D * F  (llama SwiGLU, ModernBERT
                                          GeGLU: gate, up, down); a mixture of experts: the k experts a token takes
                                          (and a shared MLP) plus the router's D * E, the active parameters
    head       decoders                   V * D  (the output projection, tied or untied: the input embedding is a
                                          table lookup, which is no matmul, so untying adds parameters, not FLOPs)
               bert, num_labels == 0      D * D + V * D  (masked-LM transform and decoder, on every token)
               bert, num_labels > 0       (D * D + D * num_labels) / seq_len  (pooler and classifier, on the first
                                          token of each sequence only)
    attention  12 * num_layers * H * K * seq_len: scores (QK^T) and the weighted sum of values, 2 matmuls * 2 FLOPs
               * 3 passes per layer per token of context; every query head attends, whatever G is.
  There is no causal discount (the XLA path computes the full T x T scores), and nothing is counted for biases,
  norms, softmax, embeddings lookups or rematerialised recomputation: MFU is model FLOPs, so remat lowers it by
  design. tests/test_flops.py checks this count against the matmuls in the jaxpr of each flavour's gradient.

  LoRA (`lora.rank > 0`, jaxlm/adapters/lora.py): a frozen matmul weight takes no weight gradient, only its forward
  and the gradient of its input, 4 FLOPs per parameter per token instead of 6; each adapted matrix [d_in, d_out] adds
  its adapters' 6 * rank * (d_in + d_out) (x A, (x A) B, and their input and weight gradients); a classifier's head,
  trained whole (lora.HEAD_PREFIXES), keeps its 6; attention is unchanged. So a LoRA step counts
    4 * (matmul parameters) + 2 * (trained head) + 6 * rank * num_layers * sum over adapted (d_in + d_out) + attention
  (adapted matrices as lora.make_plan resolves `lora.targets`; tests/test_mfu_lora.py checks it against the jaxpr).
  """
  d, num_layers, width = model.d_model, model.num_layers, model.num_heads * model.head_dim
  kv_width = (model.num_kv_heads or model.num_heads) * model.head_dim
  mlp_matrices = 3 if model.flavour == "llama" or model.gated_mlp else 2
  if model.num_experts:  # a token meets its k experts (and the shared MLP) and the router: active parameters only
    mlp_params = (model.experts_per_token * model.expert_params + mlp_matrices * d * model.shared_expert_d_ff
                  + d * model.num_experts)
  else:
    mlp_params = mlp_matrices * d * model.mlp_width
  layer_params = 2 * d * width + 2 * d * kv_width + mlp_params
  if model.flavour != "bert":
    head_params = model.vocab_size * d
  elif num_labels:
    head_params = (d * d + d * num_labels) / seq_len
  else:
    head_params = d * d + model.vocab_size * d
  attention_flops = 12 * num_layers * width * seq_len
  matmul_params = num_layers * layer_params + head_params
  if lora is None or not lora.rank:
    return float(6 * matmul_params + attention_flops)
  trained_head = 0.0  # what a LoRA classifier trains whole: its classifier (and pre_classifier), first token only
  if model.flavour == "bert" and num_labels:
    trained_head = (d * num_labels + (d * d if model.classifier_head in ("dense_tanh", "dense_relu") else 0)) / seq_len
  adapted = sum(d_in + d_out for _, d_in, d_out in lora_matrices(model, lora.targets))
  return float(4 * matmul_params + 2 * trained_head + 6 * lora.rank * num_layers * adapted + attention_flops)


def lora_matrices(model: ModelConfig, targets: str) -> list[tuple[str, int, int]]:
  """(path in a block, d_in, d_out) of each block matrix that `lora.targets` adapts, resolved as lora.make_plan does:
  attention, mlp, all, weight names (w_q, w_down, ...) or path suffixes (mlp/shared/w_up). A mixture of experts' expert
  weights take no adapters (make_plan refuses them); its shared MLP's may."""
  d, width = model.d_model, model.num_heads * model.head_dim
  kv_width = (model.num_kv_heads or model.num_heads) * model.head_dim
  prefix = "bert/blocks/" if model.flavour == "bert" else "blocks/"  # the blocks' path in the model's parameters
  matrices = [("attn/w_q", d, width), ("attn/w_k", d, kv_width), ("attn/w_v", d, kv_width), ("attn/w_o", width, d)]
  gated = model.flavour == "llama" or model.gated_mlp
  mlp_prefix, mlp_width = ("mlp/shared/", model.shared_expert_d_ff) if model.num_experts else ("mlp/", model.mlp_width)
  if mlp_width:
    names = (("w_gate", d, mlp_width), ("w_up", d, mlp_width), ("w_down", mlp_width, d)) if gated else (
        ("w_in", d, mlp_width), ("w_out", mlp_width, d))
    matrices += [(mlp_prefix + name, d_in, d_out) for name, d_in, d_out in names]
  chosen = []
  for entry in (t.strip() for t in targets.split(",") if t.strip()):
    names = LORA_TARGET_GROUPS.get(entry, LORA_MATMUL_WEIGHTS if entry == "all" else (entry,))
    chosen += [m for m in matrices if m not in chosen and (m[0].rsplit("/", 1)[-1] in names or (
        "/" in entry and (prefix + m[0]).endswith(entry)))]
  return chosen


# Dense (no 2:4 sparsity) bf16 tensor-core peak per device, FLOP/s, keyed by a lower-case substring of
# `device.device_kind`; the longest matching key wins, so "h100 pcie" beats "h100" and "tpu v5 lite" beats "tpu v5".
# MFU on accelerators is always measured against this bf16 dense peak, whatever the compute dtype: an f32 run on a
# GPU uses TF32 tensor cores (XLA's default precision) and on a TPU bf16 passes, so it shows as low MFU, as it should.
PEAK_FLOPS_BF16: dict[str, float] = {
    "h100": 989e12,  # H100 SXM ("NVIDIA H100 80GB HBM3")
    "h100 pcie": 756e12,
    "h100 nvl": 835e12,
    "h800": 989e12,
    "h200": 989e12,  # same compute die as H100 SXM, more and faster HBM
    "gh200": 989e12,
    "a100": 312e12,
    "l4": 121e12,
    "l40": 181e12,
    "l40s": 362e12,
    # The A10G (AWS) has no public tensor datasheet; we use the A10's 125e12. Its sustained bf16 matmul rate is
    # nearer 70e12, so A10G MFU reads low (conservative) rather than flattering.
    "a10g": 125e12,
    "a10": 125e12,
    "v100": 125e12,  # fp16 tensor cores; the V100 has no bf16, so bf16 runs there are emulated and slow
    "tpu v4": 275e12,
    "tpu v5 lite": 197e12,  # v5e reports itself as "TPU v5 lite"
    "tpu v5e": 197e12,
    "tpu v5": 459e12,  # v5p reports itself as "TPU v5"
    "tpu v5p": 459e12,
    "tpu v6 lite": 918e12,  # v6e (Trillium)
    "tpu v6e": 918e12,
}


def measure_matmul_flops(n: int = 1024, dtype: Any = jnp.float32, repeats: int = 5, device=None,
                         warmup_seconds: float = 0.25) -> float:
  """Measured FLOP/s of one jitted n x n x n matmul on `device`: the best of `repeats` timed runs after a warm-up.

  The best run, not the mean, because the host may be shared and we want the machine's ceiling. n=1024 keeps it to
  a fraction of a second on a small CPU. The warm-up runs the matmul for `warmup_seconds` first: a CPU's first
  milliseconds of work (idle cores clocking up, the thread pool waking) ran 1024^3 at half the rate of the same
  matmul a moment later (docs/performance.md), which halves the peak and doubles MFU.
  """
  device = device or jax.devices()[0]
  # Inputs made by numpy on the host: jax.random would compile two more programs and double the first-call time.
  host_values = np.random.default_rng(0).standard_normal((2, n, n), dtype=np.float32).astype(jnp.dtype(dtype))
  a, b = jax.device_put(host_values[0], device), jax.device_put(host_values[1], device)
  return 2.0 * n**3 / best_seconds(jax.jit(jnp.matmul), a, b, repeats=repeats, warmup_seconds=warmup_seconds)


def best_seconds(fn: Callable, *args, repeats: int, warmup: int = 1, warmup_seconds: float = 0.0) -> float:
  """The fastest of `repeats` timed calls of fn(*args), after `warmup` untimed ones (compile, caches, thread pools),
  and more untimed ones until `warmup_seconds` have passed after the first. The best, not the mean: a shared host
  only ever adds time."""
  for _ in range(warmup):
    jax.block_until_ready(fn(*args))
  warm_until = time.perf_counter() + warmup_seconds
  while time.perf_counter() < warm_until:
    jax.block_until_ready(fn(*args))
  best = math.inf
  for _ in range(repeats):
    started = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - started)
  return best


# The CPU's matmul sizes for its measured peak, the best counting: one size alone can read low, and past 2048 the
# rate falls out of cache (docs/performance.md).
CPU_PEAK_SIZES = (1024, 2048)


# A JSON file the measured peaks are kept in and read from, for processes that start one after another on one host
# (a test session, a sweep, a job resumed after each preemption): each would otherwise spend seconds re-measuring.
PEAK_CACHE_ENV = "JAXLM_PEAK_FLOPS_CACHE"


@functools.lru_cache(maxsize=None)
def _measured_peak(platform: str, dtype_name: str, n: int) -> float:
  # Cached per (platform, dtype, size) so that every caller in the process sees the same denominator.
  path, key = os.environ.get(PEAK_CACHE_ENV), f"{platform}/{dtype_name}/{n}"
  known = _read_peaks(path) if path else {}
  if key not in known:
    known[key] = measure_matmul_flops(n=n, dtype=jnp.dtype(dtype_name), device=jax.local_devices(backend=platform)[0])
    if path:  # written whole under a name of this process's own (processes may start together), then renamed
      with open(f"{path}.{os.getpid()}.tmp", "w") as f:
        json.dump({**_read_peaks(path), key: known[key]}, f)  # another process may have added a key meanwhile
      os.replace(f"{path}.{os.getpid()}.tmp", path)
  return float(known[key])


def _read_peaks(path: str) -> dict[str, float]:
  try:
    with open(path) as f:
      return dict(json.load(f))
  except (OSError, ValueError):  # not written yet, or unreadable: measure
    return {}


def lookup_peak_flops(device_kind: str) -> tuple[str, float] | None:
  """(matched table key, bf16 dense peak FLOP/s) for a device kind, or None when the kind is not in the table."""
  kind = device_kind.lower()
  matches = [key for key in PEAK_FLOPS_BF16 if key in kind]
  if not matches:
    return None
  key = max(matches, key=len)
  return key, PEAK_FLOPS_BF16[key]


def peak_flops_per_device(device=None, dtype: Any = "bfloat16") -> tuple[float, str]:
  """(peak FLOP/s per device, where the number came from) for MFU denominators.

  Accelerators in `PEAK_FLOPS_BF16` get the bf16 dense datasheet peak (whatever `dtype` is; see the table comment).
  The CPU and unknown kinds get a measured matmul rate in `dtype` (pass the model's compute dtype), measured once per
  process (and once per host where JAXLM_PEAK_FLOPS_CACHE names a file to keep it in). On the CPU every simulated device (xla_force_host_platform_device_count) shares the same cores, so the
  host rate is split evenly between them: peak_per_device * num_devices is then the host's rate and MFU stays honest.
  The CPU's rate is the best of the sizes in CPU_PEAK_SIZES, each after a warm-up (measure_matmul_flops): a peak
  below what the step's own matmuls reach would show MFU above 100%.
  """
  device = device or jax.devices()[0]
  if device.platform != "cpu":
    match = lookup_peak_flops(device.device_kind)
    if match is not None:
      key, flops = match
      return flops, f"table: {key!r} bf16 dense peak for device kind {device.device_kind!r}"
  dtype_name = jnp.dtype(dtype).name
  if device.platform == "cpu":
    host_devices = len(jax.local_devices(backend="cpu"))
    n = max(CPU_PEAK_SIZES, key=lambda n: _measured_peak("cpu", dtype_name, n))
    flops = _measured_peak("cpu", dtype_name, n) / host_devices
    sizes = "/".join(map(str, CPU_PEAK_SIZES))
    return flops, (f"measured: best {dtype_name} n^3 matmul on the host (n={sizes}, warmed up; best n={n}), shared by "
                   f"{host_devices} CPU device(s)")
  # An accelerator we have no datasheet number for: a large matmul gets close to its peak.
  flops = _measured_peak(device.platform, dtype_name, 8192)
  return flops, f"measured: 8192^3 {dtype_name} matmul (device kind {device.device_kind!r} not in PEAK_FLOPS_BF16)"


class StepTimes:
  """Wall-clock seconds and host-side counts of timed steps (what jaxlm.training.loop.Task.count says a step processed:
  tokens, examples, flops, ...), summed, and the rates they make. The training loop keeps one for the steps since
  the last metrics line and one for the run; it leaves out each run's first step, which holds the compile."""

  def __init__(self):
    self.clear()

  def clear(self) -> None:
    self.steps, self.seconds, self.counts = 0, 0.0, {}

  def add(self, counts: dict[str, float], seconds: float) -> None:
    self.steps += 1
    self.seconds += seconds
    for key, value in counts.items():
      self.counts[key] = self.counts.get(key, 0) + value

  def rates(self, peak_flops: float) -> dict[str, float]:
    """`<count>_per_sec` for every count, `mfu` (counted flops over the peak of all devices) and `step_time_sec`;
    empty when no step was timed."""
    if not self.steps or self.seconds <= 0:
      return {}
    rates = {f"{k}_per_sec": v / self.seconds for k, v in self.counts.items() if k != "flops"}
    if "flops" in self.counts:
      rates["mfu"] = self.counts["flops"] / self.seconds / peak_flops
    rates["step_time_sec"] = self.seconds / self.steps
    return rates


def device_memory_stats(devices=None) -> dict[str, int]:
  """Allocator bytes per local device, flat for metrics: memory/{bytes_in_use,peak_bytes_in_use,bytes_limit}/d<id>.

  Also memory/peak_bytes_in_use/max over devices. Empty where the backend keeps no stats (the CPU returns None).
  """
  stats: dict[str, int] = {}
  for device in devices or jax.local_devices():
    try:
      device_stats = device.memory_stats()
    except (NotImplementedError, RuntimeError):  # some plugins raise instead of returning None
      device_stats = None
    for name in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit"):
      if device_stats and name in device_stats:
        stats[f"memory/{name}/d{device.id}"] = int(device_stats[name])
  peaks = [value for key, value in stats.items() if key.startswith("memory/peak_bytes_in_use/")]
  if peaks:
    stats["memory/peak_bytes_in_use/max"] = max(peaks)
  return stats


def _json_value(key: str, value: Any) -> Any:
  """A plain JSON value: bool/int -> int, reals -> float, NaN/inf -> None (JSON has no NaN), strings kept."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, (bool, np.bool_)):
    return int(value)
  if isinstance(value, numbers.Integral):
    return int(value)
  if isinstance(value, numbers.Real):
    value = float(value)
    return value if math.isfinite(value) else None
  array = np.asarray(value)  # 0-d numpy / already-fetched jax scalars
  if array.size != 1 or array.dtype.kind not in "biuf":
    raise TypeError(f"metric {key!r} must be a number or a string, got {type(value).__name__} {array.shape}")
  return _json_value(key, array.reshape(()).item())


def _rewrite_jsonl(path: str, keep: Callable[[int], bool]) -> int | None:
  """Keeps the parseable lines of `path` whose step passes `keep`; returns the largest step kept (None if none).

  Writes a temp file in the same folder and os.replace()s it, so a crash mid-rewrite leaves the old file whole. A line
  a killed run left half-written does not parse and is dropped here, before we append after it.
  """
  if not os.path.exists(path):
    return None
  with open(path) as f:
    original = f.read()
  kept, max_step = [], None
  for line in original.splitlines():
    try:
      record = json.loads(line)
      step = int(record["step"])
    except (ValueError, KeyError, TypeError):
      continue
    if keep(step):
      kept.append(line)
      max_step = step if max_step is None else max(max_step, step)
  text = "".join(line + "\n" for line in kept)
  if text != original:
    fd, temp_path = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".metrics.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
      f.write(text)
    os.replace(temp_path, path)
  return max_step


def _import_tensorboardx():
  """tensorboardX, imported here (the writer is optional). Its writer module imports torch at import time only to
  recognise torch tensors, 3.9 s when torch is installed (the `hf` extra); we log floats. So
  unless this process has imported torch already, tensorboardX is imported with torch hidden (a None entry in
  sys.modules makes its guarded `import torch` fail), and torch imports normally afterwards."""
  if "tensorboardX" in sys.modules or "torch" in sys.modules:
    import tensorboardX  # noqa: PLC0415
    return tensorboardX
  sys.modules["torch"] = None
  try:
    import tensorboardX  # noqa: PLC0415
  finally:
    del sys.modules["torch"]
  return tensorboardX


class MetricsWriter:
  """Appends `{"step": step, **metrics}` lines to <workdir>/metrics.jsonl and scalars to <workdir>/tensorboard/.

  Only process 0 writes; on other processes every method is a no-op. Each line is flushed, so a killed run keeps
  everything it logged.

  Resume: a run restarted from checkpoint S may have lines past S from the work it lost. Two rules remove them, so
  the file ends with exactly one line per logged step:
    * `start_step=S` (the restored checkpoint's step) drops lines with step > S when the writer opens;
    * whatever the caller passes, the first `write(step)` drops earlier lines with step >= that step.
  TensorBoard gets the same cut through tensorboardX's `purge_step`, which hides the older events at and past it.
  """

  def __init__(self, workdir: str, enable_tensorboard: bool = True, start_step: int | None = None):
    self.path = os.path.join(workdir, "metrics.jsonl")
    self.tensorboard_dir = os.path.join(workdir, "tensorboard")
    self._enabled = jax.process_index() == 0
    self._enable_tensorboard = enable_tensorboard
    self._start_step = start_step
    self._file = None
    self._tensorboard = None
    self._existing_max_step = None
    if self._enabled:
      os.makedirs(workdir, exist_ok=True)
      self._existing_max_step = _rewrite_jsonl(self.path, lambda step: start_step is None or step <= start_step)

  def _open(self, first_step: int) -> None:
    if self._existing_max_step is not None and self._existing_max_step >= first_step:
      _rewrite_jsonl(self.path, lambda step: step < first_step)
    self._file = open(self.path, "a")
    if self._enable_tensorboard:
      tensorboardX = _import_tensorboardx()
      purge_step = first_step if self._start_step is None else min(first_step, self._start_step + 1)
      self._tensorboard = tensorboardX.SummaryWriter(self.tensorboard_dir, purge_step=purge_step, flush_secs=30)

  def write(self, step: int, metrics: dict[str, Any]) -> None:
    if not self._enabled:
      return
    step = int(step)
    if self._file is None:
      self._open(step)
    record = {"step": step}
    record.update({key: _json_value(key, value) for key, value in metrics.items()})
    self._file.write(json.dumps(record, allow_nan=False) + "\n")
    self._file.flush()
    if self._tensorboard is not None:
      for key, value in metrics.items():
        if isinstance(value, str) or value is None:
          continue
        # NaN/inf go to TensorBoard as they are: a visible spike there is the point.
        self._tensorboard.add_scalar(key, float(np.asarray(value)), global_step=step)

  def flush(self) -> None:
    if self._tensorboard is not None:
      self._tensorboard.flush()

  def close(self) -> None:
    if self._file is not None:
      self._file.close()
      self._file = None
    if self._tensorboard is not None:
      self._tensorboard.close()
      self._tensorboard = None

  def __enter__(self) -> MetricsWriter:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()


def _format_postfix(values: dict[str, Any]) -> str:
  parts = []
  for key, value in values.items():
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
      text = "-" if value is None else str(value)
    elif key == "mfu":
      text = f"{100 * value:.1f}%"
    elif key == "tokens_per_sec":
      key, text = "tok/s", f"{value / 1e3:.1f}k" if value >= 1e4 else f"{value:.0f}"
    elif isinstance(value, float):
      text = f"{value:.4f}" if abs(value) < 1e4 else f"{value:.4g}"
    else:
      text = str(value)
    parts.append(f"{key}={text}")
  return ", ".join(parts)


class ProgressBar:
  """A tqdm bar on process 0: steps done, ETA, and a postfix such as loss=2.3456, tok/s=12.3k, mfu=41.2%.

  `update(step, loss=..., tokens_per_sec=..., mfu=...)` takes the absolute step and the same metric names as
  metrics.jsonl (`mfu` a fraction). Outside a terminal (a log file, SLURM) it redraws at most every 30 s.
  """

  def __init__(self, total_steps: int, initial_step: int = 0, enable: bool = True):
    self._bar = None
    if enable and jax.process_index() == 0:
      interactive = sys.stderr.isatty()
      self._bar = tqdm.tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True,
                            mininterval=0.1 if interactive else 30.0)

  def update(self, step: int, **postfix_values: Any) -> None:
    if self._bar is None:
      return
    if postfix_values:
      self._bar.set_postfix_str(_format_postfix(postfix_values), refresh=False)
    self._bar.update(step - self._bar.n)

  def write(self, text: str) -> None:
    """Prints a line above the bar (process 0 only) without tearing it."""
    if self._bar is not None:
      self._bar.write(text)
    elif jax.process_index() == 0:
      print(text, file=sys.stderr)

  def close(self) -> None:
    if self._bar is not None:
      self._bar.close()
      self._bar = None
