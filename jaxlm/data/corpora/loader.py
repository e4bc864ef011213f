"""Grain loaders over packed sequences: sharded per JAX process, shuffled per epoch, resumable.

The train pipeline is a grain `MapDataset` of row *indices*:

  range(N)[this process's shard] -> shuffle(seed) -> repeat forever -> batch(B) -> gather rows -> [B, T] arrays

Shuffling before repeating gives every epoch its own order (grain mixes the epoch into the seed), and batches flow
across epoch boundaries, so no row is dropped. Rows are fetched with one vectorised numpy gather per batch
(`PackedSequences.batch`) rather than one record at a time: grain's `DataLoader` + `IndexSampler` path pays a sampler
cost per record that dominates a gather this cheap (docs/performance.md has the measurement).

The iterator position is grain's own state, `{"next_index": k}` (k = batches already yielded), which
`get_loader_state` returns as a JSON-ready dict for the training checkpoint. Resuming requires the same data, batch
size, seed and process count; `set_loader_state` checks the recorded shape of the pipeline and says what changed.
"""

from __future__ import annotations

import json
from typing import Any

import grain.python as gp
import jax
import numpy as np

from jaxlm.data.corpora.mixture import PretrainingBatches
from jaxlm.data.packing import PackedSequences

# Rows are fetched in the consumer thread: worker processes and read threads only add IPC and GIL contention for a
# gather this cheap (and the machines this runs on may have 2 cores).
_NO_THREADS = gp.ReadOptions(num_threads=0, prefetch_buffer_size=0)


def make_train_iterator(packed: PackedSequences, batch_size_per_process: int, seed: int, shuffle: bool,
                        shard_options: gp.ShardOptions | None = None) -> gp.DatasetIterator:
  """An endless iterator of example dicts of [B_local, T] numpy arrays for this JAX process.

  Every process walks the same shuffled order of *global* batches (B_local * process count rows) and gathers only
  its own contiguous slice of each: the global batch at every step, hence the loss, is the same whether the job runs
  as one process or several. `shard_options` defaults to this JAX process; tests pass explicit `ShardOptions` to
  simulate several processes. The iterator supports `get_loader_state` / `set_loader_state`.
  """
  if batch_size_per_process < 1:
    raise ValueError(f"batch_size_per_process={batch_size_per_process} must be >= 1; raise train.batch_size")
  if shard_options is None:
    shard_options = gp.ShardOptions(jax.process_index(), jax.process_count(), drop_remainder=True)
  global_batch = batch_size_per_process * shard_options.shard_count
  if len(packed) < global_batch:
    raise ValueError(
        f"the data holds {len(packed)} packed sequences but one global batch needs {global_batch} "
        f"({shard_options.shard_count} process(es) x {batch_size_per_process}); lower train.batch_size or "
        f"data.seq_len, or add data")
  first = shard_options.shard_index * batch_size_per_process
  rows = gp.MapDataset.range(len(packed))
  if shuffle:
    rows = rows.shuffle(seed=_grain_seed(seed))
  # repeat(None) is endless; with an endless parent, batch never sees a remainder.
  batches = rows.repeat(None).batch(global_batch, batch_fn=np.asarray)
  local = batches.map(lambda indices: packed.batch(indices[first:first + batch_size_per_process]))
  return iter(local.to_iter_dataset(_NO_THREADS))


def _grain_seed(seed: int) -> int:
  # grain wants a non-negative seed that fits 32 bits; fold larger or negative train.seed values into that range.
  return int(seed) % (2**32)


def get_loader_state(iterator: gp.DatasetIterator) -> dict[str, Any]:
  """The iterator position as a JSON-serialisable dict (grain's state; bytes states are decoded)."""
  state = iterator.get_state()
  if isinstance(state, bytes):  # grain's DataLoader iterators return JSON bytes
    state = json.loads(state.decode("utf-8"))
  # Round-trip through JSON so numpy integers become ints and anything unserialisable fails here, not at save time.
  return json.loads(json.dumps(state, default=_json_number))


def set_loader_state(iterator: gp.DatasetIterator, state: dict[str, Any]) -> None:
  """Moves a fresh iterator to `state`, so it yields exactly what the saved iterator would have yielded next."""
  if not isinstance(state, dict):
    raise TypeError(f"loader state must be the dict from get_loader_state, got {type(state).__name__}")
  if isinstance(iterator, PretrainingBatches):  # checks the state itself: batch size, mixture history
    iterator.set_state(state)
    return
  current = iterator.get_state()
  if isinstance(current, bytes):
    iterator.set_state(json.dumps(state).encode("utf-8"))
    return
  if set(current) != set(state):
    raise ValueError(f"loader state keys {sorted(state)} do not match this loader's {sorted(current)}; "
                     f"the checkpoint was written by a different data pipeline")
  iterator.set_state(state)


def _json_number(value: Any) -> Any:
  if isinstance(value, np.generic):
    return value.item()
  raise TypeError(f"loader state holds {type(value).__name__}, which JSON cannot store")


def eval_batches(packed: PackedSequences, batch_size_per_process: int, num_batches: int,
                 shard_options: gp.ShardOptions | None = None) -> list[dict[str, np.ndarray]]:
  """`num_batches` deterministic batches of [B_local, T] arrays for this process, in row order, no shuffle.

  Process p of P takes rows p, p + P, p + 2P, ... (strided, so processes split the rows evenly) and wraps around
  to the first rows when there are fewer than P * B * num_batches; the eval set is then seen more than once.
  """
  if len(packed) == 0:
    raise ValueError("the eval set holds no packed sequences; add eval data or raise data.eval_fraction")
  if batch_size_per_process < 1 or num_batches < 1:
    raise ValueError(f"batch_size_per_process={batch_size_per_process} and num_batches={num_batches} must be >= 1")
  if shard_options is None:
    shard_options = gp.ShardOptions(jax.process_index(), jax.process_count())
  slots = np.arange(num_batches * batch_size_per_process)  # this process's example slots, in order
  rows = (slots * shard_options.shard_count + shard_options.shard_index) % len(packed)
  return [packed.batch(chunk) for chunk in rows.reshape(num_batches, batch_size_per_process)]
