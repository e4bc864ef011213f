"""Peak memory of preference tuning (DPO), full against LoRA, on the same pretrained decoder, each in a fresh process
on the CPU (one device: device memory is host memory, so the peak RSS counts both).

  python experiments/hf_from_gguf.py --out=runs/gemma3_270m && python experiments/preference_pairs.py --out=runs/rule_pairs
  python benchmarks/preference_memory.py --init_from=runs/gemma3_270m --workdir=runs/preference_memory

Each process runs experiments/configs/finetune_preferences.py for --steps steps (the reference pass over every pair,
the start evaluation and the steps) and reports its peak RSS (getrusage's ru_maxrss), the train state's bytes and the
model's parameter bytes. The reference is init_from's weights: its log-probabilities are computed before the first
step, so neither method holds a second copy of the weights, and LoRA holds no gradient or optimizer state for the
frozen base. Writes <workdir>/preference_memory.json.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

from absl import app, flags

flags.DEFINE_string("init_from", "runs/gemma3_270m", "an HF decoder folder")
flags.DEFINE_string("workdir", "runs/preference_memory", "where the runs and the result go")
flags.DEFINE_integer("steps", 3, "train steps per method")
flags.DEFINE_integer("batch_size", 4, "pairs per step")
flags.DEFINE_string("mode", "", "internal: full | lora (one process each)")
FLAGS = flags.FLAGS
MiB = 2**20
METHODS = {"full": 0, "lora": 16}


def _run(method: str) -> dict:
  from experiments.configs import finetune_preferences  # noqa: PLC0415
  from jaxlm import config as config_lib  # noqa: PLC0415
  from jaxlm.recipes import preference_tuning  # noqa: PLC0415

  config = finetune_preferences.get_config()
  config.init_from = FLAGS.init_from
  config.lora.rank = METHODS[method]
  config.train.steps, config.train.batch_size = FLAGS.steps, FLAGS.batch_size
  config.train.eval_every_steps, config.checkpoint.every_steps = 0, 0
  config.train.learning_rate = 1e-5 if method == "full" else 2e-4
  config.log.sample_tokens, config.log.progress_bar = 0, False
  result = preference_tuning.preference_tune(config_lib.from_config_dict(config),
                                             os.path.join(FLAGS.workdir, method))
  keys = ("trainable_params", "trainable_bytes", "optimizer_bytes", "frozen_bytes", "eval_preference_loss")
  return {"method": method, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
          **{k: result[k] for k in keys if k in result}}


def main(argv):
  del argv
  if FLAGS.mode:
    print("RESULT " + json.dumps(_run(FLAGS.mode)), flush=True)
    return
  import numpy as np  # noqa: PLC0415
  from safetensors import safe_open  # noqa: PLC0415

  with safe_open(os.path.join(FLAGS.init_from, "model.safetensors"), "np") as f:
    param_bytes = 4 * sum(int(np.prod(f.get_slice(k).get_shape())) for k in f.keys())  # as float32
  results = {"init_from": FLAGS.init_from, "steps": FLAGS.steps, "batch_pairs": FLAGS.batch_size,
             "param_bytes_f32_mib": param_bytes / MiB, "command": " ".join(sys.argv)}
  env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1", "JAX_PLATFORMS": "cpu"}
  for method in METHODS:
    out = subprocess.run([sys.executable, __file__, f"--mode={method}", f"--init_from={FLAGS.init_from}",
                          f"--workdir={FLAGS.workdir}", f"--steps={FLAGS.steps}", f"--batch_size={FLAGS.batch_size}"],
                         capture_output=True, text=True, env=env, check=False)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
      raise SystemExit(f"{method} failed:\n{out.stderr[-3000:]}")
    results[method] = json.loads(line[len("RESULT "):])
    print(method, results[method], flush=True)
  results["lora_over_full_peak"] = results["lora"]["peak_rss_mib"] / results["full"]["peak_rss_mib"]
  os.makedirs(FLAGS.workdir, exist_ok=True)
  with open(os.path.join(FLAGS.workdir, "preference_memory.json"), "w") as f:
    json.dump(results, f, indent=2)
  print(json.dumps({k: v for k, v in results.items() if not isinstance(v, dict)}, indent=2))


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  app.run(main)
