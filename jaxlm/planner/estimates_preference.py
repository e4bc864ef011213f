"""Sizing a preference-tuning run (DPO, IPO, SimPO: jaxlm/recipes/preference_tuning.py) as the planner sizes an LM run.

A pair is two sequences (prompt + chosen, prompt + rejected) in one forward, so a step of B pairs holds the
activations and does the work of an LM step of 2B sequences (`as_sequence_run`); the gradient goes through the same
fused cross-entropy, plus one forward-only pass over the output table (`Kernels.token_log_probs`). DPO and IPO also
run the reference model once over every training pair before the first step (forward only, the policy's shape):
`reference_pass` adds its time to the run. The reference's weights are never in memory beside the policy's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxlm.config import Config

SEQUENCES_PER_PAIR = 2


def as_sequence_run(config: Config) -> Config:
  """The LM run whose steps match the preference run's: train.batch_size sequences = 2 x the pairs."""
  t = config.train
  return dataclasses.replace(config, train=dataclasses.replace(t, batch_size=SEQUENCES_PER_PAIR * t.batch_size))


def reference_pass(row: dict[str, Any], config: Config, tokens: float) -> dict[str, Any]:
  """`row` (a plan row of `as_sequence_run(config)`) with the reference pass's seconds added to its hours and
  costs. `tokens`: the run's sequence tokens; the pass reads each training pair once (tokens / train.epochs when
  the epochs are set). Its work per sequence is a forward: 2 of a full step's 6 FLOPs per parameter and token, 2 of
  LoRA's 4 (a frozen base forms no weight gradient)."""
  if config.preference.loss == "simpo" or not row.get("step_time_sec"):
    return {**row, "reference_pass_sec": 0.0}
  steps_of_sequences = tokens / max(row["micro_batch"] * row["grad_accum"] * config.data.seq_len, 1)
  passes = 1.0 / config.train.epochs if config.train.epochs >= 1 else 1.0
  forward_share = 2 / (4 if config.lora.rank else 6)
  seconds = steps_of_sequences * passes * row["step_time_sec"] * forward_share
  row = {**row, "reference_pass_sec": seconds}
  hours = seconds / 3600
  for key in ("on_demand_hours", "spot_hours"):
    if row.get(key) is not None:
      row[key] += hours
  for key, hours_key in (("on_demand_usd", "on_demand_hours"), ("spot_usd", "spot_hours")):
    if row.get(key) is not None and row.get(hours_key):
      row[key] *= row[hours_key] / (row[hours_key] - hours)
  if row.get("energy_kwh") is not None:
    row["energy_kwh"] *= row["on_demand_hours"] / (row["on_demand_hours"] - hours)
  return row
