"""Multi-process start-up: one JAX process per host (or per group of devices), joined through a coordinator.

`initialize()` reads the job layout from the environment, so the same script runs alone, under `launch/local.sh`,
under SLURM and under Kubernetes:

  JAXLM_COORDINATOR_ADDRESS  host:port of process 0 (set by launch/local.sh, launch/k8s/jobset.yaml, skypilot.yaml)
  JAXLM_NUM_PROCESSES        number of processes
  JAXLM_PROCESS_ID           this process's index
  SLURM_*                    under `srun` with more than one task, JAX's own SLURM detection finds all three

With none of these set it does nothing: a single process sees all local devices. On the CPU, processes talk through
gloo collectives.
"""

from __future__ import annotations

import os
import socket
import time

import jax

ENV_COORDINATOR = "JAXLM_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "JAXLM_NUM_PROCESSES"
ENV_PROCESS_ID = "JAXLM_PROCESS_ID"


def _under_multi_task_slurm() -> bool:
  return "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1


def initialize(timeout_s: int = 120) -> bool:
  """Joins the multi-process job described by the environment; returns False when running as a single process.

  Fails with a one-line error, after `timeout_s` rather than hanging, when the coordinator cannot be reached.
  """
  explicit = os.environ.get(ENV_COORDINATOR)
  if not explicit and not _under_multi_task_slurm():
    return False
  if jax.distributed.is_initialized():
    return True
  kwargs = {}
  if explicit:
    try:
      kwargs = dict(coordinator_address=explicit, num_processes=int(os.environ[ENV_NUM_PROCESSES]),
                    process_id=int(os.environ[ENV_PROCESS_ID]))
    except (KeyError, ValueError) as e:
      raise ValueError(f"{ENV_COORDINATOR} is set, so {ENV_NUM_PROCESSES} and {ENV_PROCESS_ID} must be integers "
                       f"too ({e})") from None
  # JAX's client aborts the whole process (a C++ fatal error, no exception) when the coordinator never answers;
  # probing the port first turns that into a catchable, one-line error.
  if explicit and kwargs["process_id"] != 0:
    _wait_for_coordinator(explicit, timeout_s)
  elif not explicit and (slurm := _slurm_coordinator()) and slurm[1] != 0:
    _wait_for_coordinator(slurm[0], timeout_s)
  if os.environ.get("JAX_PLATFORMS", "") == "cpu" or _only_cpu_available():
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  try:
    jax.distributed.initialize(initialization_timeout=timeout_s, **kwargs)
  except Exception as e:  # jax raises XlaRuntimeError / RuntimeError with a long gRPC message
    where = explicit or "the SLURM job's first node"
    raise RuntimeError(f"could not join the job through the coordinator at {where} within {timeout_s} s; check that "
                       f"process 0 is running and the address/port is reachable ({type(e).__name__})") from None
  return True


def _wait_for_coordinator(address: str, timeout_s: float) -> None:
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=2):
        return
    except OSError:
      if time.monotonic() > deadline:
        raise RuntimeError(f"could not join the job through the coordinator at {address} within {timeout_s} s; "
                           "check that process 0 is running and the address/port is reachable") from None
      time.sleep(0.5)


def _slurm_coordinator() -> tuple[str, int] | None:
  """(coordinator host:port, this task's rank) as JAX's SLURM detection will choose them, or None if this jax
  version's (private) cluster class differs: then only JAX's own timeout guards the join."""
  try:
    from jax._src.clusters import SlurmCluster  # noqa: PLC0415
    if SlurmCluster.is_env_present():
      return SlurmCluster.get_coordinator_address(None, None), SlurmCluster.get_process_id()
  except (ImportError, AttributeError, TypeError, KeyError, ValueError):
    pass
  return None


def _only_cpu_available() -> bool:
  # Decided before any backend starts: asking jax.devices() here would initialise the backend too early.
  return os.environ.get("JAX_PLATFORMS", "") in ("", "cpu") and not os.path.exists("/dev/nvidia0")


def is_coordinator() -> bool:
  return jax.process_index() == 0
