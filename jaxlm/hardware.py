"""Hardware profiles for the planner: one device type's memory, peak rates and prices, read from
`jaxlm/hardware.json` (edit it, or pass another file)."""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Sequence

PROFILES_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hardware.json")
GIB = 2**30
PLATFORMS = ("gpu", "tpu", "cpu")  # jax.default_backend() names: the kernels are resolved for the profile's platform


@dataclasses.dataclass(frozen=True)
class Hardware:
  """One device type; the fields are documented in jaxlm/hardware.json."""
  name: str
  memory_gib: float
  bf16_flops: float
  hbm_bytes_per_sec: float
  interconnect_bytes_per_sec: float
  usd_per_hour_on_demand: float
  usd_per_hour_spot: float
  matmul_efficiency: float = 0.7
  step_time_factor: float = 1.0
  usable_memory_fraction: float = 0.9
  max_devices: int = 8
  spot_preemptions_per_hour: float = 0.1
  description: str = ""
  platform: str = ""  # the jax platform its devices are: gpu | tpu | cpu; "" = this host's (a measured profile)

  @property
  def usable_bytes(self) -> float:
    return self.memory_gib * GIB * self.usable_memory_fraction

  @property
  def matmul_flops(self) -> float:
    """The sustained matmul rate the roofline uses."""
    return self.bf16_flops * self.matmul_efficiency


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
    result.append(profile)
  return result
