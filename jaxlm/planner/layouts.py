"""The layouts the planner compares: data, FSDP and tensor parallelism, their mixes, and pipelines of each schedule
over data x FSDP (jaxlm/training/pipeline.py serves no tensor axis beside a pipeline), on a power-of-two device
count."""

from __future__ import annotations

import dataclasses
import math

from jaxlm.config import SCHEDULES


def mesh_shapes(num_devices: int) -> list[tuple[int, int, int]]:
  """Every (data, fsdp, tensor) of powers of two whose product is `num_devices`: DP, FSDP, TP and their mixes."""
  powers = [2**i for i in range(int(math.log2(num_devices)) + 1)]
  return [(d, f, num_devices // (d * f)) for d in powers for f in powers if num_devices % (d * f) == 0]


@dataclasses.dataclass(frozen=True)
class Layout:
  """One way to lay a run over devices: mesh.data x mesh.fsdp x mesh.tensor x mesh.pipeline, and the pipeline's
  schedule (mesh.pipeline_schedule) when it has stages."""
  data: int
  fsdp: int
  tensor: int
  pipeline: int = 1
  schedule: str = ""

  @property
  def sizes(self) -> tuple[int, int, int]:
    return self.data, self.fsdp, self.tensor

  @property
  def devices(self) -> int:
    return self.data * self.fsdp * self.tensor * self.pipeline

  @property
  def mesh(self) -> str:
    return f"{self.data}x{self.fsdp}x{self.tensor}x{self.pipeline}"

  @property
  def name(self) -> str:
    """The parallelisms it uses, e.g. `data`, `fsdp+tensor`, `data+pipeline(1f1b)`; `single` for one device."""
    used = [axis for axis, size in (("data", self.data), ("fsdp", self.fsdp), ("tensor", self.tensor)) if size > 1]
    if self.pipeline > 1:
      used.append(f"pipeline({self.schedule})")
    return "+".join(used) or "single"


def as_layout(sizes: "tuple[int, ...] | Layout") -> Layout:
  if isinstance(sizes, Layout):
    return sizes
  return Layout(*sizes[:3]) if len(sizes) == 3 or sizes[3] == 1 else Layout(*sizes[:4], schedule="gpipe")


def layouts(num_devices: int, num_layers: int | None = None) -> list[Layout]:
  """Every data x fsdp x tensor mix of `mesh_shapes`, and every pipeline of 2+ stages (a power of two dividing
  `num_layers`) over data x fsdp on the devices left, once per schedule (jaxlm.training.pipeline: no tensor axis with
  it)."""
  result = [Layout(*s) for s in mesh_shapes(num_devices)]
  stages = 2
  while stages <= num_devices:
    if num_devices % stages == 0 and (num_layers is None or num_layers % stages == 0):
      for data, fsdp, tensor in mesh_shapes(num_devices // stages):
        if tensor == 1:
          result += [Layout(data, fsdp, 1, stages, schedule) for schedule in SCHEDULES]
    stages *= 2
  return result


def accumulation_splits(batch_size: int, data_shards: int) -> list[int]:
  """grad_accum values that split the global batch into equal micro-batches, each divisible over the data shards."""
  return [k for k in range(1, batch_size + 1) if batch_size % k == 0 and (batch_size // k) % data_shards == 0]
