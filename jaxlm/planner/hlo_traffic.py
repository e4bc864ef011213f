"""Collective traffic read from a compiled XLA program's HLO text (and, at the end, what profiles need: each
instruction's kind, `instruction_kinds`; which instruction a profiled kernel belongs to, `event_instruction`; and
instructions' shapes and source operations, `instruction_summaries`).

XLA exposes no counter for bytes moved by collectives, so we read them off the optimised HLO: every all-reduce,
all-gather, reduce-scatter, all-to-all and collective-permute, with its result shape and replica-group size, weighted
by how often it runs (ops inside the scanned-layers `while` loop run `known_trip_count` times). Bytes are per device
with ring algorithms: an all-reduce of S bytes over n devices moves 2 (n-1)/n S, an all-gather or all-to-all
(n-1)/n S, a reduce-scatter (n-1) S_result, a permute S.
"""

from __future__ import annotations

import collections
import functools
import re

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4,
               "s64": 8, "u64": 8, "f64": 8, "c64": 8}
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"=\s*(.+?)\s+(" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_SHAPE = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_WHILE = re.compile(r"\swhile\(.*body=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLS = re.compile(r"(?:calls|to_apply|true_computation|false_computation|branch_computations)=\{?%?([\w.\-]+)")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([\d,]*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]")


def _shape_bytes(type_text: str) -> int:
  total = 0
  for dtype, dims in _SHAPE.findall(type_text):
    if dtype in DTYPE_BYTES:
      size = 1
      for d in filter(None, dims.split(",")):
        size *= int(d)
      total += size * DTYPE_BYTES[dtype]
  return total


def _group_size(line: str, num_devices: int) -> int:
  if m := _GROUPS_LIST.search(line):
    return max(1, len([x for x in m.group(1).split(",") if x]))
  if m := _GROUPS_IOTA.search(line):
    return int(m.group(2))
  if "source_target_pairs" in line:
    return 2
  return num_devices  # no groups listed: all devices take part


def _moved_bytes(kind: str, size: int, n: int) -> float:
  if n <= 1:
    return 0.0
  return {"all-reduce": 2 * (n - 1) / n * size, "all-gather": (n - 1) / n * size, "all-to-all": (n - 1) / n * size,
          "reduce-scatter": (n - 1) * size, "collective-permute": float(size)}[kind]


def collective_bytes(hlo_text: str, num_devices: int) -> dict[str, float]:
  """Bytes each device sends per execution, by collective kind, plus `total` and `ops` (executed op count)."""
  ops: dict[str, list] = collections.defaultdict(list)  # computation -> [(kind, bytes)]
  edges: dict[str, list] = collections.defaultdict(list)  # computation -> [(callee, times)]
  entry, current = None, None
  for line in hlo_text.splitlines():
    # Computation headers start at column 0 and open a block; instructions are indented.
    if not line.startswith(" ") and line.rstrip().endswith("{") and (m := _COMPUTATION.match(line)):
      current = m.group(1)
      if line.startswith("ENTRY"):
        entry = current
      continue
    if current is None:
      continue
    if (m := _OP.search(line)) and "-done" not in line.split("=")[1].split("(")[0]:
      size = _shape_bytes(m.group(1))
      ops[current].append((m.group(2), _moved_bytes(m.group(2), size, _group_size(line, num_devices))))
    if m := _WHILE.search(line):
      trip = _TRIP.search(line)
      edges[current].append((m.group(1), int(trip.group(1)) if trip else 1))
    for callee in _CALLS.findall(line):
      edges[current].append((callee, 1))

  callers: dict[str, list] = collections.defaultdict(list)
  for caller, callees in edges.items():
    for callee, n in callees:
      callers[callee].append((caller, n))

  @functools.lru_cache(maxsize=None)
  def times(computation: str) -> float:  # executions per step; XLA call graphs are acyclic
    if computation == entry:
      return 1.0
    return sum(times(caller) * n for caller, n in callers.get(computation, []) if caller != computation)

  result = {kind: 0.0 for kind in COLLECTIVES}
  count = 0.0
  for computation, entries in ops.items():
    for kind, moved in entries:
      result[kind] += moved * times(computation)
      count += times(computation)
  result["total"] = sum(result[k] for k in COLLECTIVES)
  result["ops"] = count
  return result


# ----------------------------------------------------------------------------------------------- op kinds
# What each instruction of a compiled module is, for profiles (benchmarks/profile_step.py) that report time by kind.

_FUSION_BODY = re.compile(r"^%?([\w.\-]+) .*?\{\n(.*?)\n\}", re.M | re.S)
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$", re.M)
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_OPCODE = re.compile(r"(?:^|\s)([a-z][a-z0-9\-]*)\(")  # the first `name(` after the (possibly tuple) shape


def instruction_kinds(hlo_text: str) -> dict[str, str]:
  """Instruction name -> kind, for every instruction of the compiled module."""
  bodies = {name: body for name, body in _FUSION_BODY.findall(hlo_text)}
  kinds = {}
  for name, rest in _INSTRUCTION.findall(hlo_text):
    opcode = (_OPCODE.search(rest) or [None, ""])[1]
    called = _CALLS.search(rest)
    body = bodies.get(called.group(1), "") if called else ""
    kinds[name] = _kind(opcode, rest, body)
  return kinds


def _kind(opcode: str, line: str, body: str) -> str:
  text = line + body
  if opcode.startswith(COLLECTIVES) or any(f" {c}" in body for c in COLLECTIVES):
    return "collective"
  if opcode == "custom-call":
    if "cudnn" in line.lower() and ("fmha" in line.lower() or "attention" in line.lower()):
      return "attention (cuDNN)"
    return "matmul" if ("gemm" in line.lower() or "matmul" in line.lower()) else "custom-call"
  if opcode in ("dot", "convolution") or " dot(" in body or " convolution(" in body or "__cublas" in text:
    return "matmul"
  if opcode in ("copy", "transpose") or re.search(r" (copy|transpose)\(", body):
    return "copy/transpose"
  if opcode in ("dynamic-slice", "dynamic-update-slice", "slice", "concatenate", "pad", "gather", "scatter") or \
      re.search(r" (dynamic-update-slice|dynamic-slice|scatter|gather)\(", body):
    return "slicing"
  if opcode == "reduce" or " reduce(" in body:
    return "reduce"
  if opcode in ("while", "conditional", "call", "parameter", "tuple", "get-tuple-element", "bitcast", "constant"):
    return "control"
  return "elementwise"


def event_instruction(name: str, kinds: dict[str, str]) -> str | None:
  """The HLO instruction an event belongs to: its own name, or (XLA:GPU kernels replayed from CUDA graphs carry
  only the kernel's name) `loop_add_fusion_3` -> `loop_add_fusion.3`."""
  if name in kinds:
    return name
  stem, _, number = name.rpartition("_")
  return f"{stem}.{number}" if number.isdigit() and f"{stem}.{number}" in kinds else None


def library_kernel_kind(kernel: str) -> str:
  """The kind of a device kernel that belongs to no HLO instruction, from its library's naming (cuDNN, cuBLAS)."""
  lower = kernel.lower()
  if any(k in lower for k in ("sdpa", "fmha", "flash", "attention", "cudnn")):
    return "attention (cuDNN)"
  if any(k in lower for k in ("gemm", "xmma", "nvjet", "cutlass", "matmul", "gemv")):
    return "matmul"
  if "fusion" in lower or lower.startswith("wrapped_"):
    return "XLA fusion (unmatched)"  # XLA's own kernel whose name the compiled HLO does not show as such
  return "other kernel"


_OP_NAME = re.compile(r'op_name="([^"]*)"')


def instruction_summaries(hlo_text: str, names) -> dict[str, dict[str, str]]:
  """What the named instructions of a compiled module are, for a profile's top ops (one pass over the text): name ->
  its result shape and the JAX operation it came from (the `op_name` metadata, e.g.
  `jit(train_step)/transpose(jvp())/reduce_sum`). Names the module lacks (library kernels) are left out."""
  wanted, summaries = set(names), {}
  for name, rest in _INSTRUCTION.findall(hlo_text):
    if name in wanted:
      opcode = _OPCODE.search(rest)
      source = _OP_NAME.search(rest)
      summaries[name] = {"shape": rest[:opcode.start()].strip() if opcode else "",
                         "source": source.group(1) if source else ""}
  return summaries
