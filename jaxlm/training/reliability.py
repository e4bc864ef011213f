"""What keeps a run restartable: preemption signals, non-finite steps, and all-finite checks before saving.

Preemption: spot and preemptible machines get SIGTERM some seconds before they vanish; a user at a terminal sends
SIGINT (Ctrl-C). `StopSignals` turns the first of either into a flag that the training loop reads after each step;
the loop then saves a checkpoint with the data position and returns normally, so the next start resumes exactly
there. A second signal means "now": it raises KeyboardInterrupt, which is safe too, because an interrupted save
leaves only a temporary folder that restore ignores (see jaxlm/training/checkpoint.py). SIGUSR1 is a notice: it stops
the run the same way but never counts as that second signal (the launchers in launch/ pass their signals on as it).

Non-finite steps: the jitted train step itself skips an update whose loss, gradients or updates are not finite
(parameters and optimizer state stay bit-identical, no host sync); `NonFiniteCounter` counts those skips on the host
as the loop reads each step's metrics, and stops the run after `train.max_consecutive_nonfinite` in a row.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
# "Save and stop soon", never "now": the launchers (launch/slurm.sbatch, launch/local.sh) pass on the signals they
# receive as this one, and it may arrive beside a SIGTERM of the same preemption, which must not count as a second.
NOTICE_SIGNALS = (signal.SIGUSR1,)
# Multi-process runs agree on stopping through a collective every this many steps (see `should_stop`).
STOP_SYNC_EVERY_STEPS = 10


class NonFiniteError(ValueError):
  """Raised when training can not go on without producing, or saving, a non-finite state. A ValueError: its cause
  is a setting (most often the learning rate) or the data, and scripts report it as one line."""


class StopSignals:
  """Context manager: while active, the first SIGTERM/SIGINT sets `requested` instead of killing the process.

  A notice signal (SIGUSR1) sets `requested` too but never interrupts: only a second SIGTERM/SIGINT does.
  Handlers can only be installed from the main thread; elsewhere (e.g. a notebook worker thread) this does
  nothing and the default behaviour stays. The previous handlers are put back on exit.
  """

  def __init__(self, signals: tuple[int, ...] = STOP_SIGNALS, announce: bool = True,
               notices: tuple[int, ...] = NOTICE_SIGNALS):
    self.signals = signals
    self.notices = notices
    self.announce = announce
    self.requested = False
    self.signal_name: str | None = None
    self.received_at: float | None = None
    self._stop_signal_seen = False  # a SIGTERM/SIGINT (not a notice) has arrived
    self._previous: dict[int, Any] = {}

  def __enter__(self) -> StopSignals:
    if threading.current_thread() is threading.main_thread():
      for signum in (*self.signals, *self.notices):
        self._previous[signum] = signal.signal(signum, self._handle)
    return self

  def __exit__(self, *exc_info) -> None:
    self._restore()

  def _restore(self) -> None:
    for signum, handler in self._previous.items():
      signal.signal(signum, handler if handler is not None else signal.SIG_DFL)
    self._previous.clear()

  def _handle(self, signum: int, frame: Any) -> None:
    name = signal.Signals(signum).name
    notice = signum in self.notices
    if not notice and self._stop_signal_seen:  # the user (or the scheduler) will not wait for the checkpoint
      self._restore()
      raise KeyboardInterrupt(f"second stop signal ({name}) while finishing step and saving")
    self._stop_signal_seen = self._stop_signal_seen or not notice
    if self.requested:
      return
    self.requested, self.signal_name, self.received_at = True, name, time.time()
    if self.announce:
      print(f"\nreceived {name}: finishing the current step, saving a checkpoint and exiting "
            f"({'SIGTERM or SIGINT twice exits' if notice else 'send it again to exit'} at once)", file=sys.stderr,
            flush=True)


def should_stop(requested: bool, step: int, collective: bool | None = None,
                every: int = STOP_SYNC_EVERY_STEPS) -> bool:
  """Whether every process stops after `step`; each process must call this after every step.

  One process: the local flag, at once. Several processes must stop at the same step (their next save is a
  collective), so they OR their flags with an all-gather, only every `every` steps: the all-gather waits for the
  step in flight and so costs one pipeline bubble each time. A signal is then honoured within `every` steps.
  `collective=True` forces that path (tests use it on one process). `StopSignals` replaces the SIGTERM handler
  that jax.distributed's preemption service installs, so this, not `multihost_utils.reached_preemption_sync_point`,
  is where processes agree.
  """
  if collective is None:
    collective = jax.process_count() > 1
  if not collective:
    return requested
  if step % every:
    return False
  from jax.experimental import multihost_utils  # noqa: PLC0415 (only multi-process runs need it)

  return bool(np.any(multihost_utils.process_allgather(np.asarray(requested, np.int32))))


class NonFiniteCounter:
  """Counts skipped (non-finite) steps, in a row and in all; says when `max_consecutive` in a row is reached."""

  def __init__(self, max_consecutive: int):
    self.max_consecutive = max_consecutive
    self.consecutive = 0
    self.total = 0

  def update(self, step: int, skipped: bool, expected: bool = False) -> str | None:
    """Records `step`; returns the stop message when this step makes `max_consecutive` skips in a row. An
    `expected` skip (a float16 overflow that lowered the loss scale, jaxlm/training/loss_scale.py) counts in `total`
    only: it neither extends nor ends a run of non-finite steps."""
    if expected:
      self.total += 1
      return None
    if not skipped:
      self.consecutive = 0
      return None
    self.consecutive += 1
    self.total += 1
    if self.consecutive < self.max_consecutive:
      return None
    first = step - self.consecutive + 1
    return (f"{self.consecutive} consecutive non-finite steps ({first} to {step}; updates skipped, "
            f"train.max_consecutive_nonfinite={self.max_consecutive}): stopped at step {step}; the last checkpoint "
            f"holds finite values; lower train.learning_rate, check the data around these steps, or resume")


@jax.jit
def all_finite(tree: Any) -> jax.Array:
  """True when every floating-point leaf of `tree` is finite (integer leaves always are)."""
  flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
  return jnp.all(jnp.stack(flags)) if flags else jnp.array(True)


def first_nonfinite_path(tree: Any) -> str | None:
  """The path of the first leaf holding a NaN or inf (host-side; for error messages only)."""
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    value = np.asarray(jax.device_get(leaf))
    if value.dtype.kind in "fc" and not np.all(np.isfinite(value)):
      return path_str(path)
  return None


def path_str(path: tuple) -> str:
  """A pytree key path as `opt_state/1/0/mu/blocks/attn/w_q` (dict keys, indices and attribute names alike)."""
  parts = []
  for key in path:
    for attr in ("key", "idx", "name"):
      if hasattr(key, attr):
        parts.append(str(getattr(key, attr)))
        break
    else:
      parts.append(str(key))
  return "/".join(parts)
