"""Peak memory of an RL step (LoRA) with a KL to the reference (rl.beta > 0) against the same step without one
(beta = 0), each in a fresh process on the CPU (one device: device memory is host memory, so the peak RSS counts
both); and the same pair for full fine-tuning, where beta > 0 holds a frozen copy of the weights.

  python experiments/hf_from_gguf.py --out=runs/gemma3_270m && python experiments/rl_tasks.py --out=runs/rl_tasks
  python benchmarks/rl_memory.py --init_from=runs/gemma3_270m --workdir=runs/rl_memory

Each process runs experiments/configs/finetune_rl.py for --steps steps (the start evaluation on --eval_prompts
held-out prompts, the rollouts and the updates) and reports its peak RSS (getrusage's ru_maxrss). With LoRA the
reference is the base with zero adapters: beta > 0 adds the reference log-prob pass, not a second copy of the
weights. Writes <workdir>/rl_memory.json.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

from absl import app, flags

flags.DEFINE_string("init_from", "runs/gemma3_270m", "an HF decoder folder")
flags.DEFINE_string("data", "runs/rl_tasks", "a folder with train.jsonl and eval.jsonl (experiments/rl_tasks.py)")
flags.DEFINE_string("workdir", "runs/rl_memory", "where the runs and the result go")
flags.DEFINE_integer("steps", 2, "train steps per run")
flags.DEFINE_integer("batch_size", 16, "completions per step")
flags.DEFINE_integer("eval_prompts", 8, "held-out prompts answered at the start and the end")
flags.DEFINE_bool("full", True, "also measure full fine-tuning (its beta > 0 keeps a frozen copy)")
flags.DEFINE_string("mode", "", "internal: <lora|full>_<beta> (one process each)")
FLAGS = flags.FLAGS
MiB = 2**20
BETA = 0.04


def _run(mode: str) -> dict:
  from experiments.configs import finetune_rl  # noqa: PLC0415
  from jaxlm import config as config_lib  # noqa: PLC0415
  from jaxlm.recipes import policy_optimization  # noqa: PLC0415

  method, beta = mode.split("_")
  config = finetune_rl.get_config()
  config.init_from = FLAGS.init_from
  config.data.train_files = (os.path.join(FLAGS.data, "train.jsonl"),)
  config.data.eval_files = (os.path.join(FLAGS.data, "eval.jsonl"),)
  config.lora.rank = 0 if method == "full" else config.lora.rank
  config.rl.beta = float(beta)
  config.rl.eval_prompts = FLAGS.eval_prompts
  config.train.steps, config.train.batch_size, config.train.warmup_steps = FLAGS.steps, FLAGS.batch_size, 0
  config.train.eval_every_steps, config.checkpoint.every_steps = 0, 0
  config.train.learning_rate = 1e-5 if method == "full" else 2e-4
  config.log.progress_bar = False
  result = policy_optimization.policy_optimize(config_lib.from_config_dict(config), os.path.join(FLAGS.workdir, mode))
  keys = ("trainable_params", "trainable_bytes", "optimizer_bytes", "frozen_bytes", "eval_reward")
  return {"mode": mode, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
          **{k: result[k] for k in keys if k in result}}


def main(argv):
  del argv
  if FLAGS.mode:
    print("RESULT " + json.dumps(_run(FLAGS.mode)), flush=True)
    return
  results = {"init_from": FLAGS.init_from, "steps": FLAGS.steps, "batch_completions": FLAGS.batch_size,
             "beta": BETA, "command": " ".join(sys.argv)}
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
  modes = ["lora_0", f"lora_{BETA}"] + (["full_0", f"full_{BETA}"] if FLAGS.full else [])
  for mode in modes:
    out = subprocess.run([sys.executable, __file__, f"--mode={mode}", f"--init_from={FLAGS.init_from}",
                          f"--data={FLAGS.data}", f"--workdir={FLAGS.workdir}", f"--steps={FLAGS.steps}",
                          f"--batch_size={FLAGS.batch_size}", f"--eval_prompts={FLAGS.eval_prompts}"],
                         capture_output=True, text=True, env=env, check=False)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
      raise SystemExit(f"{mode} failed:\n{out.stderr[-3000:]}")
    results[mode] = json.loads(line[len("RESULT "):])
    print(mode, results[mode], flush=True)
  results["lora_beta_over_beta0_peak"] = results[f"lora_{BETA}"]["peak_rss_mib"] / results["lora_0"]["peak_rss_mib"]
  if FLAGS.full:
    results["full_beta_over_beta0_peak"] = (results[f"full_{BETA}"]["peak_rss_mib"]
                                            / results["full_0"]["peak_rss_mib"])
  os.makedirs(FLAGS.workdir, exist_ok=True)
  with open(os.path.join(FLAGS.workdir, "rl_memory.json"), "w") as f:
    json.dump(results, f, indent=2)
  print(json.dumps({k: v for k, v in results.items() if not isinstance(v, dict)}, indent=2))


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  app.run(main)
