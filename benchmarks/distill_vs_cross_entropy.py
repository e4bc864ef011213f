"""Distillation from Gemma 3 270M against cross-entropy alone, and the distillation step's memory.

  python benchmarks/distill_vs_cross_entropy.py --part=quality --workdir=runs/distill_vs_ce --steps=40 \
      --out=benchmarks/results/cpu_distill_gemma3_vs_cross_entropy.json
  python benchmarks/distill_vs_cross_entropy.py --part=memory --workdir=runs/distill_memory \
      --out=benchmarks/results/cpu_distill_gemma3_step_memory.json

quality: experiments/configs/distill_gemma3.py's student trained for --steps on the same batches (same seed, same
  data) twice: distilled (distill.alpha = 0: the forward KL alone) and on cross-entropy alone (distill.alpha = 1, whose
  gradient is the cross-entropy's; the teacher still runs, so both report the held-out KL to it). Held-out
  cross-entropy (eval_loss) and KL (eval_distill_divergence) at every evaluation.
memory: the compiled train step's peak bytes (arguments + outputs - donated + temporaries, from XLA's buffer
  assignment) of the distillation step and of the plain student step, beside the teacher's weight bytes: the goal is
  distillation <= student + teacher weights x 1.25; the student also with its cross-entropy in the distillation
  kernel's chunk (like for like: the default chunk of the cross-entropy is larger); and, for scale, the bytes of one
  model's [B, T, V] f32 logits.
Needs runs/gemma3_270m (python experiments/hf_from_gguf.py --out=runs/gemma3_270m).
"""

from __future__ import annotations

import dataclasses
import json
import os
import runpy
import subprocess
import sys

from absl import app, flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from jaxlm import cli  # noqa: E402,F401  (the scripts' environment: huge pages, XLA flags)
from jaxlm.training import atomic_files  # noqa: E402

_PART = flags.DEFINE_enum("part", "quality", ["quality", "memory"], "what to measure")
_WORKDIR = flags.DEFINE_string("workdir", "runs/distill_vs_ce", "runs go here")
_OUT = flags.DEFINE_string("out", None, "results JSON")
_STEPS = flags.DEFINE_integer("steps", 40, "training steps of each run")
_CONFIG = os.path.join(ROOT, "experiments", "configs", "distill_gemma3.py")


def eval_curve(workdir: str) -> list[dict]:
  rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
  return [{"step": r["step"], "eval_loss": r["eval_loss"], "eval_distill_divergence": r["eval_distill_divergence"]}
          for r in rows if "eval_loss" in r]


def quality() -> dict:
  steps = _STEPS.value
  runs = {"distilled": "0.0", "cross_entropy": "1.0"}
  out = {"command": "python " + " ".join(sys.argv), "steps": steps, "runs": {}}
  for name, alpha in runs.items():
    workdir = os.path.join(_WORKDIR.value, name)
    subprocess.run([sys.executable, "experiments/train_lm.py", f"--config={_CONFIG}", f"--workdir={workdir}",
                    f"--config.distill.alpha={alpha}", f"--config.train.steps={steps}",
                    f"--config.train.warmup_steps={max(steps // 10, 1)}",
                    f"--config.train.eval_every_steps={max(steps // 4, 1)}", "--config.log.progress_bar=False",
                    "--config.checkpoint.every_steps=0"], check=True, cwd=ROOT)
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    times = [r["step_time_sec"] for r in rows if "step_time_sec" in r]
    out["runs"][name] = {"distill.alpha": float(alpha), "eval": eval_curve(workdir),
                         "median_step_time_sec": sorted(times)[len(times) // 2] if times else None}
  return out


def memory() -> dict:
  import jax  # noqa: PLC0415

  from jaxlm import config as config_lib  # noqa: PLC0415
  from jaxlm.kernels import registry  # noqa: PLC0415
  from jaxlm.planner import check_against_runs, plan  # noqa: PLC0415
  from jaxlm.recipes import pretraining  # noqa: PLC0415
  from jaxlm.training import loop  # noqa: PLC0415

  base = config_lib.from_config_dict(runpy.run_path(_CONFIG)["get_config"]())
  results = {"command": "python " + " ".join(sys.argv)}
  tokens = base.train.batch_size * base.data.seq_len
  student = dataclasses.replace(base, distill=dataclasses.replace(base.distill, teacher=""))
  # Like for like: the plain student's cross-entropy with the distillation kernel's chunk (its byte cap).
  distill_chunk = max(8, registry.DISTILL_CHUNK_BYTES // (24 * base.model.vocab_size))
  variants = {"student": student, "distillation": base,
              "student_distillation_chunk": dataclasses.replace(
                  student, kernels=dataclasses.replace(student.kernels, cross_entropy_chunk=distill_chunk))}
  results["one_model_logits_f32_bytes"] = tokens * base.model.vocab_size * 4  # what the kernel never holds whole
  for name, config in variants.items():
    workdir = os.path.join(_WORKDIR.value, name)
    config, mesh, kernels = loop.prepare_run(config, workdir)
    task = pretraining.language_model_task(config, workdir, mesh, kernels)
    batch = check_against_runs.synthetic_batch(config.train.batch_size, config.data.seq_len, config.model.vocab_size,
                                               mesh)
    compiled = task.train_step.lower(task.state, batch).compile()
    analysis = compiled.memory_analysis()
    results[name] = {"peak_bytes": plan.compiled_memory_bytes(compiled),
                     "argument_bytes": int(analysis.argument_size_in_bytes),
                     "temp_bytes": int(analysis.temp_size_in_bytes)}
    if name == "distillation":
      teacher = task.train_step.frozen[0]
      results["teacher_weight_bytes"] = int(sum(x.nbytes for x in jax.tree.leaves(teacher)))
    del task, compiled
  teacher = results["teacher_weight_bytes"]
  for reference in ("student", "student_distillation_chunk"):
    extra = results["distillation"]["peak_bytes"] - results[reference]["peak_bytes"]
    results["distillation"][f"over_{reference}_bytes"] = extra
    results["distillation"][f"over_{reference}_in_teacher_weights"] = extra / teacher
  results["goal"] = "distillation over_student_in_teacher_weights <= 1.25"
  return results


def main(argv):
  del argv
  results = quality() if _PART.value == "quality" else memory()
  atomic_files.write_json(_OUT.value, results)
  print(json.dumps(results, indent=1)[:3000])


if __name__ == "__main__":
  flags.mark_flag_as_required("out")
  app.run(main)
