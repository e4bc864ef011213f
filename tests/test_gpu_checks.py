"""benchmarks/gpu_checks.sh, the one script a lent GPU runs, dry-run on tiny shapes on the CPU: every part runs to
its end and writes its results, so a GPU session's minutes are not lost to a broken flag or path."""

import json
import os
import subprocess
import sys

from conftest import xla_flags_without_device_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = ("ab_gpt2/ab.json", "profile_gpt2/profile.json", "ab_llama/ab.json", "profile_llama/profile.json",
           "ab_kernels/ab.json", "ab_fp16/ab.json", "qlora_7b/step_memory.json", "int8.json")


def test_every_part_runs_on_tiny_shapes(tmp_path):
  out = tmp_path / "gpu_checks"
  # One device (the GPU script's meshes are one GPU's), and the suite's other XLA flags (fast CPU compiles).
  env = {**os.environ, "GPU_CHECKS_DRY_RUN": "1",
         "XLA_FLAGS": f"{xla_flags_without_device_count()} --xla_force_host_platform_device_count=1"}
  done = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_checks.sh"), sys.executable, str(out)],
                        env=env, capture_output=True, text=True, timeout=600)
  log = (out / "log.txt").read_text()
  exits = [line for line in log.splitlines() if line.startswith("=== ") and ": exit " in line]
  assert len(exits) == 9 and all(line.endswith("exit 0") for line in exits), (exits, done.stdout[-3000:])
  for path in RESULTS:
    assert (out / path).exists(), (path, log[-3000:])
  memory = json.loads((out / "qlora_7b" / "step_memory.json").read_text())
  assert memory["lora"] == "rank 64 base nf4" and memory["predicted_peak_bytes"] > 0
  fp16 = json.loads((out / "ab_fp16" / "ab.json").read_text())
  assert "fp16" in json.dumps(fp16)
