"""Hardware profiles for the planner: one device type's memory, peak rates and prices, read from
`jaxlm/planner/hardware.json` (edit it, or pass another file)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

PROFILES_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware.json")
GIB = 2**30
PLATFORMS = ("gpu", "tpu", "cpu")  # jax.default_backend() names: the kernels are resolved for the profile's platform
LOW_PRECISION = ("bfloat16", "float16")  # compute dtypes a profile states a matmul peak for


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One device type; the fields are documented in jaxlm/planner/hardware.json."""
  name: str
  memory_gib: float
  bf16_flops: float
  hbm_bytes_per_sec: float
  interconnect_bytes_per_sec: float
  usd_per_hour_on_demand: float | None  # None: owned hardware, planned in hours and kWh
  usd_per_hour_spot: float | None  # None: no spot market for it
  matmul_efficiency: float = 0.7
  step_time_factor: float = 1.0
  usable_memory_fraction: float = 0.9
  max_devices: int = 8
  spot_preemptions_per_hour: float = 0.1
  description: str = ""
  platform: str = ""  # the jax platform its devices are: gpu | tpu | cpu; "" = this host's (a measured profile)
  fp16_flops: float | None = None  # None: as bf16_flops; 0: no fp16 matmul units
  compute_dtype: str = "bfloat16"  # what the planner plans with: bf16 where the device has it, else fp16
  board_power_watts: float = 0.0  # 0: unknown, no energy figure
  compute_capability: float = 0.0  # NVIDIA GPUs' CUDA compute capability; 0: not stated

  @property
  def has_fused_attention(self) -> bool:
    """cuDNN's fused (flash) attention needs an Ampere or newer NVIDIA GPU (compute capability 8.0)."""
    return not 0 < self.compute_capability < 8.0

  @property
  def owned(self) -> bool:
    """No price per hour: a machine one has, whose cost is its hours and energy."""
    return self.usd_per_hour_on_demand is None

  def peak_flops(self, dtype: str) -> float:
    """The dense matmul peak for `dtype`; f32 runs are measured against the profile's compute_dtype peak (the MFU
    convention of jaxlm.training.telemetry). 0 where the device has no units for it (`supports`)."""
    if dtype == "float16":
      return self.bf16_flops if self.fp16_flops is None else self.fp16_flops
    if dtype == "bfloat16":
      return self.bf16_flops
    return self.peak_flops(self.compute_dtype)

  def supports(self, dtype: str) -> bool:
    return self.peak_flops(dtype) > 0

  @property
  def usable_bytes(self) -> float:
    return self.memory_gib * GIB * self.usable_memory_fraction

  @property
  def matmul_flops(self) -> float:
    """The sustained matmul rate of the compute_dtype, as the roofline uses it."""
    return self.matmul_rate(self.compute_dtype)

  def matmul_rate(self, dtype: str) -> float:
    return self.peak_flops(dtype) * self.matmul_efficiency


def planned_dtype(compute_dtype: str, hardware: Hardware) -> tuple[str, str]:
  """(the compute dtype a run of `compute_dtype` gets on `hardware`, a one-line note when that is not what the config
  says, else ""). A low-precision dtype the device lacks becomes the profile's compute_dtype (bf16 on a V100 runs
  as fp16 with loss scaling); float32 stays float32."""
  if compute_dtype not in LOW_PRECISION or hardware.supports(compute_dtype):
    return compute_dtype, ""
  return hardware.compute_dtype, (
      f"{hardware.name} has no {compute_dtype} matmul units: planned with model.compute_dtype={hardware.compute_dtype}"
      + (" (dynamic loss scaling)" if hardware.compute_dtype == "float16" else "")
      + f"; set --config.model.compute_dtype={hardware.compute_dtype}")


def load_hardware(names: Sequence[str] | None = None, path: str = PROFILES_PATH) -> list[Hardware]:
  """The named profiles (all when `names` is empty), in the order given; an unknown name is a one-line error."""
  if not os.path.isfile(path):
    raise ValueError(f"hardware file {path!r} does not exist; fix --hardware_file (default: {PROFILES_PATH})")
  with open(path) as f:
    profiles = json.load(f)["profiles"]
  names = list(names or profiles)
  unknown = [n for n in names if n not in profiles]
  if unknown:
    raise ValueError(f"--hardware={unknown[0]} is not a profile in {path}; known: {', '.join(profiles)}")
  fields = {f.name for f in dataclasses.fields(Hardware)}
  result = []
  for name in names:
    extra = sorted(set(profiles[name]) - fields)
    if extra:
      raise ValueError(f"hardware profile {name!r} in {path} has unknown field {extra[0]!r}; known: {sorted(fields)}")
    profile = Hardware(name=name, **profiles[name])
    if profile.platform not in PLATFORMS:
      raise ValueError(f"hardware profile {name!r} in {path} has platform={profile.platform!r}; give one of "
                       f"{', '.join(PLATFORMS)} (the kernels are planned for it)")
    if profile.compute_dtype not in LOW_PRECISION or not profile.supports(profile.compute_dtype):
      raise ValueError(f"hardware profile {name!r} in {path} has compute_dtype={profile.compute_dtype!r} without a "
                       f"peak for it; give bfloat16 or float16 and its bf16_flops/fp16_flops")
    result.append(profile)
  return result
