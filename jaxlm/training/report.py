"""The end-of-run report: <workdir>/report.md with a loss plot (loss.png) beside it, built from metrics.jsonl; and
experiments/optimize.py's section of it (`write_optimization`: optimize.json, optimize.png, the table).

Kept apart from telemetry.py because it runs once, after training, and pulls in matplotlib; `jaxlm.training.telemetry`
re-exports `write_report` and `read_metrics`.
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any

import jax

from jaxlm.training import atomic_files


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
  atomic_files.write_text(report_path, text)
  return report_path


OPTIMIZE_BEGIN, OPTIMIZE_END = "<!-- optimize:begin -->", "<!-- optimize:end -->"


def write_optimization(workdir: str, rows: dict[str, dict], *, kind: str, unit: str, items_per_batch: int,
                       repeats: int, command: str) -> str:
  """experiments/optimize.py's outputs for `rows` ({variant: metrics}, fp32 first; `kind` "lm" or "classifier"):
  optimize.json (every row's numbers flat, with the changes vs fp32), optimize.png and the "Optimization" section
  of report.md (replaced when re-run). Returns the section's table."""
  metric = "perplexity" if kind == "lm" else "accuracy"
  base = rows["fp32"]
  flat: dict[str, Any] = {"kind": kind, "metric": metric, "device_kind": jax.devices()[0].device_kind,
                          "devices": jax.device_count(), "command": command,
                          "timing_batch_items": items_per_batch, "unit": unit}
  for name, row in rows.items():
    key = name.replace(" ", "_")
    for k, v in row.items():
      flat[f"{key}/{k}"] = v
    for suffix in ("", "_before_finetune"):
      if kind == "lm" and f"perplexity{suffix}" in row:
        flat[f"{key}/perplexity{suffix}_change_pct"] = 100 * (row[f"perplexity{suffix}"] / base["perplexity"] - 1)
      elif kind != "lm" and f"accuracy{suffix}" in row:
        flat[f"{key}/accuracy{suffix}_change_points"] = 100 * (row[f"accuracy{suffix}"] - base["accuracy"])
        flat[f"{key}/f1_macro{suffix}_change_points"] = 100 * (row[f"f1_macro{suffix}"] - base["f1_macro"])
    flat[f"{key}/checkpoint_ratio_vs_fp32"] = base["checkpoint_bytes"] / row["checkpoint_bytes"]
    flat[f"{key}/speedup_vs_fp32"] = base["latency_ms"] / row["latency_ms"]
  atomic_files.write_json(os.path.join(workdir, "optimize.json"), flat)
  table = _optimization_table(kind, unit, rows)
  _optimization_chart(os.path.join(workdir, "optimize.png"), kind, rows)
  section = "\n".join([
      OPTIMIZE_BEGIN, "## Optimization (experiments/optimize.py)", "",
      f"`{command}` on {jax.device_count()} x {jax.devices()[0].device_kind}; latency = fastest forward of one eval "
      f"batch ({items_per_batch} {unit}), best of {repeats}. Pruned models are stored dense (their zeros are "
      "written).", "", table, "", "![optimization](optimize.png)", OPTIMIZE_END, ""])
  report = os.path.join(workdir, "report.md")
  text = open(report).read() if os.path.exists(report) else ""
  if OPTIMIZE_BEGIN in text and OPTIMIZE_END in text:
    text = text[:text.index(OPTIMIZE_BEGIN)] + text[text.index(OPTIMIZE_END) + len(OPTIMIZE_END):].lstrip("\n")
  atomic_files.write_text(report, text.rstrip("\n") + "\n\n" + section)
  return table


def _optimization_table(kind: str, unit: str, rows: dict[str, dict]) -> str:
  base = rows["fp32"]
  if kind == "lm":
    head = "| variant | perplexity | vs fp32 | token acc |"
    cells = lambda r: (f"{r['perplexity']:.4f} | {100 * (r['perplexity'] / base['perplexity'] - 1):+.2f}% | "
                       f"{r['token_accuracy']:.4f} |")
  else:
    head = "| variant | accuracy | vs fp32 (points) [95% CI] | macro-F1 | vs fp32 (points) [95% CI] | flips |"

    def change(r, metric):
      low, high = (r.get(f"{metric}_change_points_ci95_{end}") for end in ("low", "high"))
      return f"{100 * (r[metric] - base[metric]):+.2f}" + (f" [{low:+.2f}, {high:+.2f}]" if low is not None else "")

    cells = lambda r: (f"{100 * r['accuracy']:.2f} | {change(r, 'accuracy')} | {100 * r['f1_macro']:.2f} | "
                       f"{change(r, 'f1_macro')} | {r.get('flips_vs_fp32', 0):.0f} |")
  head += f" latency ms/batch | {unit}/s | param MB | checkpoint MB | checkpoint vs fp32 |"
  before = any(k.endswith("_before_finetune") for r in rows.values() for k in r)
  if before:  # the pruned rows' metric before their masked fine-tune
    head += " before fine-tune |"
  downstream = sorted({k for r in rows.values() for k in r if k.startswith("lm_eval/")})  # --lm_eval_tasks
  head += "".join(f" {k[len('lm_eval/'):]} |" for k in downstream)
  lines = [head, "|" + " --- |" * (head.count("|") - 1)]
  for name, r in rows.items():
    line = (f"| {name} | " + cells(r) + f" {r['latency_ms']:.2f} | {r[f'{unit}_per_sec']:.0f} | "
            f"{r['param_bytes'] / 1e6:.3f} | {r['checkpoint_bytes'] / 1e6:.3f} | "
            f"{base['checkpoint_bytes'] / r['checkpoint_bytes']:.2f}x |")
    if before:
      if "perplexity_before_finetune" in r:
        line += f" ppl {r['perplexity_before_finetune']:.4f} |"
      elif "accuracy_before_finetune" in r:
        line += f" acc {100 * r['accuracy_before_finetune']:.2f}, F1 {100 * r['f1_macro_before_finetune']:.2f} |"
      else:
        line += " |"
    line += "".join(f" {r[k]:.4f} |" if k in r else " |" for k in downstream)
    lines.append(line)
  return "\n".join(lines)


def _optimization_chart(path: str, kind: str, rows: dict[str, dict]) -> None:
  """Quality change, latency and checkpoint size of every variant, as three bar panels."""
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  names = list(rows)
  base = rows["fp32"]
  if kind == "lm":
    quality, label = [100 * (rows[n]["perplexity"] / base["perplexity"] - 1) for n in names], "perplexity vs fp32 (%)"
  else:
    quality, label = [100 * (rows[n]["accuracy"] - base["accuracy"]) for n in names], "accuracy vs fp32 (points)"
  panels = [(quality, label), ([rows[n]["latency_ms"] for n in names], "latency per batch (ms)"),
            ([rows[n]["checkpoint_bytes"] / 1e6 for n in names], "checkpoint on disk (MB)")]
  figure = Figure(figsize=(15, 4.5), dpi=100)
  FigureCanvasAgg(figure)
  for ax, (values, title) in zip(figure.subplots(1, 3), panels):
    ax.barh(names, values, color="tab:blue")
    ax.set_title(title)
    ax.invert_yaxis()
    ax.grid(axis="x", alpha=0.3)
  figure.tight_layout()
  figure.savefig(path)
