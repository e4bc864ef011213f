"""The end-of-run report: <workdir>/report.md with a loss plot (loss.png) beside it, built from metrics.jsonl.

Kept apart from telemetry.py because it runs once, after training, and pulls in matplotlib; `jaxlm.telemetry`
re-exports `write_report` and `read_metrics`.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import jax

from jaxlm import files


def read_metrics(workdir: str) -> list[dict[str, Any]]:
  """The records of <workdir>/metrics.jsonl in file order; lines that do not parse (a killed write) are skipped."""
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return []
  records = []
  with open(path) as f:
    for line in f:
      try:
        record = json.loads(line)
      except ValueError:
        continue
      if isinstance(record, dict) and "step" in record:
        records.append(record)
  return records


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
  points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
  return [step for step, _ in points], [value for _, value in points]


def _plot_loss(records: list[dict[str, Any]], path: str, log_y: bool | None) -> bool:
  """Draws train loss (line) and eval loss (points) against step; False when nothing was logged to draw."""
  train_steps, train_loss = _series(records, "loss")
  eval_steps, eval_loss = _series(records, "eval_loss")
  if not train_loss and not eval_loss:
    return False
  # The object API with an explicit Agg canvas: no pyplot, so no global backend switch in the caller's process.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  figure = Figure(figsize=(7, 4), dpi=120)
  FigureCanvasAgg(figure)
  axes = figure.add_subplot()
  if train_loss:
    axes.plot(train_steps, train_loss, label="train loss", linewidth=1.2)
  if eval_loss:
    axes.plot(eval_steps, eval_loss, "o", label="eval loss", markersize=4)
  values = train_loss + eval_loss
  if log_y is None:  # a log axis only when the loss spans more than a decade (the first steps of a fresh model)
    log_y = min(values) > 0 and max(values) / min(values) > 10
  if log_y:
    axes.set_yscale("log")
  axes.set_xlabel("step")
  axes.set_ylabel("loss (nats/token)")
  axes.grid(True, alpha=0.3)
  axes.legend()
  figure.tight_layout()
  figure.savefig(path)
  return True


def _format_value(key: str, value: Any) -> str:
  if value is None:
    return "-"
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    return str(value)
  if isinstance(value, int):
    return f"{value:,}"
  if not math.isfinite(value):
    return str(value)
  if "mfu" in key:  # a fraction everywhere in jaxlm
    return f"{100 * value:.1f}%"
  if abs(value) >= 1e5:
    return f"{value:,.0f}"
  return f"{value:.4g}"


def _table(rows: dict[str, Any]) -> str:
  lines = ["| key | value |", "| --- | --- |"]
  for key, value in rows.items():
    cell = _format_value(key, value).replace("|", "\\|").replace("\n", " ")
    lines.append(f"| {key} | {cell} |")
  return "\n".join(lines)


def _fenced(text: str, language: str = "") -> str:
  # Generated code may itself contain ``` fences: open with one backtick more than the longest run inside.
  longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
  fence = "`" * max(3, longest + 1)
  return f"{fence}{language}\n{text.rstrip()}\n{fence}"


def loss_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
  """first_loss, final_loss, final_eval_loss, min_eval_loss and last_step from metrics.jsonl records."""
  summary: dict[str, Any] = {}
  _, train_loss = _series(records, "loss")
  _, eval_loss = _series(records, "eval_loss")
  if train_loss:
    summary["first_loss"] = train_loss[0]
    summary["final_loss"] = train_loss[-1]
  if eval_loss:
    summary["final_eval_loss"] = eval_loss[-1]
    summary["min_eval_loss"] = min(eval_loss)
  if records:
    summary["last_step"] = max(r["step"] for r in records)
  return summary


def write_report(workdir: str, title: str, summary: dict[str, Any], config_text: str, sample_text: str | None = None,
                 data_stats: dict[str, Any] | None = None, log_y: bool | None = None,
                 extra_sections: list[tuple[str, str]] | None = None) -> str:
  """Writes <workdir>/report.md (and loss.png) on process 0 and returns the report's path (on every process).

  The summary table starts with the loss figures read from metrics.jsonl (first/final loss, eval loss, last step),
  then the caller's `summary` (steps, tokens, tokens_per_sec, mfu, wall time, devices, ...); a caller key of the
  same name overrides the derived one. `log_y=None` picks a log axis when the loss spans more than a decade.
  `extra_sections`: (heading, markdown) pairs placed before the config (e.g. fine-tuning's confusion matrix).
  """
  report_path = os.path.join(workdir, "report.md")
  if jax.process_index() != 0:
    return report_path
  os.makedirs(workdir, exist_ok=True)
  records = read_metrics(workdir)
  rows = loss_summary(records)
  rows.update(summary)
  has_plot = _plot_loss(records, os.path.join(workdir, "loss.png"), log_y)

  sections = [f"# {title}", "## Summary", _table(rows), "## Loss"]
  sections.append("![loss](loss.png)" if has_plot else "No loss values were logged.")
  if data_stats:
    sections += ["## Data", _table(data_stats)]
  if sample_text is not None:
    sections += ["## Sample", _fenced(sample_text)]
  for heading, markdown in extra_sections or []:
    sections += [f"## {heading}", markdown]
  sections += ["## Config", _fenced(config_text)]
  text = "\n\n".join(sections) + "\n"
  files.write_text(report_path, text)
  return report_path
