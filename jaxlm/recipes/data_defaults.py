"""Defaults that fit the data: fine-tuning's steps and warmup are derived from the examples unless the config sets
them (the sequence length is jaxlm/data/tuning/seq_lengths.py's).

  train.steps = 0        steps = ceil(train.epochs * training examples / train.batch_size)  (`resolve_steps`)
  train.learning_rate=0  FULL_FINETUNE_RATE, or LORA_RATE with lora.rank > 0         (`resolve_learning_rate`)
  train.warmup_steps=-1  warmup = round(train.warmup_fraction * steps)                     (`optim.warmup_steps`)

An explicit value always wins. Pretraining packs a token stream into rows, so it has no examples to count: it needs
explicit train.steps and data.seq_len (`require_fixed`).
"""

from __future__ import annotations

import dataclasses
import math

import jax

from jaxlm.config import Config, TrainConfig
from jaxlm.training import optim


# Fine-tuning's peak rates by method: adapters start at zero and carry few parameters, so they need a rate many
# times full fine-tuning's (benchmarks/results/cpu_minilm_lora_r8_vs_full_stdlib_docs_step_and_f1.json).
FULL_FINETUNE_RATE = 5e-5
LORA_RATE = 1e-3


def resolve_learning_rate(train: TrainConfig, lora_rank: int) -> TrainConfig:
  """`train` with the method's rate when train.learning_rate is 0 (an explicit rate always wins)."""
  if train.learning_rate > 0:
    return train
  return dataclasses.replace(train, learning_rate=LORA_RATE if lora_rank else FULL_FINETUNE_RATE)


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
          f"{train.batch_size}), warmup {optim.warmup_steps(train)} steps, peak learning rate {train.learning_rate:g}")


def print_on_process_0(line: str | None) -> None:
  if line and jax.process_index() == 0:
    print(line, flush=True)


def require_fixed(config: Config, what: str) -> None:
  """Runs without countable examples (packed pretraining) need explicit train.steps and data.seq_len."""
  if config.train.steps == 0:
    raise ValueError(f"train.steps=0 derives the steps from fine-tuning examples; {what} needs train.steps >= 1")
  if config.train.learning_rate == 0:
    raise ValueError(f"train.learning_rate=0 takes fine-tuning's rate for the method; {what} needs a rate > 0")
  if config.data.seq_len == 0:
    raise ValueError(f"data.seq_len=0 chooses the length from fine-tuning examples; {what} needs data.seq_len >= 1")
