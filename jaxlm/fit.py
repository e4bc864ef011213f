"""Defaults that fit the data: fine-tuning's steps, warmup and sequence length are derived from the examples
unless the config sets them.

  train.steps = 0        steps = ceil(train.epochs * training examples / train.batch_size)  (`resolve_steps`)
  train.warmup_steps=-1  warmup = round(train.warmup_fraction * steps)                     (`optim.warmup_steps`)
  data.seq_len = 0       the 99th percentile of the tokenized training lengths, rounded up to a multiple of 8 and
                         capped by the model's position table                               (`choose_seq_len`)

An explicit value always wins. Whatever seq_len is, a run that cuts more than `TRUNCATION_WARNING_RATE` of its
examples prints a warning line saying how many and what to change (`truncation_warning`). Pretraining packs a token
stream into rows, so it has no examples to count: it needs explicit train.steps and data.seq_len (`require_fixed`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from jaxlm import optim
from jaxlm.config import Config, TrainConfig

SEQ_LEN_PERCENTILE = 99.0  # a chosen data.seq_len keeps this share of the examples whole
SEQ_LEN_MULTIPLE = 8  # a chosen data.seq_len is rounded up to a multiple of this (friendlier matmul shapes)
TRUNCATION_WARNING_RATE = 0.02  # more than this share of examples cut prints a warning


def resolve_steps(train: TrainConfig, num_examples: int) -> TrainConfig:
  """`train` with steps derived from train.epochs when train.steps is 0 (at least one step)."""
  if train.steps > 0:
    return train
  if num_examples < 1:
    raise ValueError("train.steps=0 derives the steps from the training examples, but there are none; add data")
  return dataclasses.replace(train, steps=max(1, math.ceil(train.epochs * num_examples / train.batch_size)))


def describe_steps(train: TrainConfig, num_examples: int, derived: bool, unit: str = "examples") -> str:
  """One line for the start of a run: the steps, how many passes over the data they make, and the warmup."""
  epochs = train.steps * train.batch_size / max(1, num_examples)
  origin = f"train.epochs={train.epochs:g}:" if derived else "train.steps;"
  return (f"steps: {train.steps} ({origin} {epochs:.3g} epochs of {num_examples} {unit} at batch "
          f"{train.batch_size}), warmup {optim.warmup_steps(train)} steps")


def choose_seq_len(lengths: np.ndarray, max_positions: int, at_least: int = 1) -> int:
  """The sequence length for tokenized `lengths`: their 99th percentile rounded up to a multiple of 8, at least
  `at_least`, at most `max_positions`."""
  if len(lengths) == 0:
    return min(max_positions, max(at_least, SEQ_LEN_MULTIPLE))
  high = int(math.ceil(float(np.percentile(np.asarray(lengths), SEQ_LEN_PERCENTILE))))
  rounded = -(-max(high, at_least, 1) // SEQ_LEN_MULTIPLE) * SEQ_LEN_MULTIPLE
  return int(min(max_positions, rounded))


def truncation_warning(num_cut: int, num_examples: int, seq_len: int, max_positions: int,
                       chosen: bool) -> str | None:
  """The warning line when more than TRUNCATION_WARNING_RATE of the examples are cut, else None."""
  if num_examples == 0 or num_cut / num_examples <= TRUNCATION_WARNING_RATE:
    return None
  if seq_len >= max_positions:
    advice = f"the model has no more positions ({max_positions}); shorten the texts or use a longer-context model"
  elif chosen:
    advice = f"set data.seq_len up to the model's {max_positions} positions"
  else:
    advice = f"raise data.seq_len (the model has {max_positions} positions) or set it to 0 to choose it from the data"
  return (f"warning: {num_cut / num_examples:.1%} of the examples ({num_cut} of {num_examples}) are longer than "
          f"data.seq_len={seq_len} tokens and are cut; {advice}")


def print_on_process_0(line: str | None) -> None:
  if line and jax.process_index() == 0:
    print(line, flush=True)


def require_fixed(config: Config, what: str) -> None:
  """Runs without countable examples (packed pretraining) need explicit train.steps and data.seq_len."""
  if config.train.steps == 0:
    raise ValueError(f"train.steps=0 derives the steps from fine-tuning examples; {what} needs train.steps >= 1")
  if config.data.seq_len == 0:
    raise ValueError(f"data.seq_len=0 chooses the length from fine-tuning examples; {what} needs data.seq_len >= 1")
