"""benchmarks/gpu_checks.sh, the one script a lent GPU runs, dry-run on tiny shapes on the CPU: every part runs to
its end and writes its results, so a GPU session's minutes are not lost to a broken flag or path. Its files also
show benchmarks/ab_step.py skipping the variants that cannot run (tokamax on the CPU) and timing the rest, and
benchmarks/profile_step.py writing a profiled step with its time by kind."""

import json
import os
import subprocess
import sys

from conftest import xla_flags_without_device_count

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = ("profile_gpt2/profile.json",
           "ab_kernels/ab.json", "ab_fp16/ab.json", "ab_moe/ab.json", "qlora_7b/step_memory.json", "int8.json",
           "decode_int8/gpt2.json")


def test_every_part_runs_on_tiny_shapes(tmp_path):
  out = tmp_path / "gpu_checks"
  # One device (the GPU script's meshes are one GPU's), and the suite's other XLA flags (fast CPU compiles).
  env = {**os.environ, "GPU_CHECKS_DRY_RUN": "1",
         "XLA_FLAGS": f"{xla_flags_without_device_count()} --xla_force_host_platform_device_count=1"}
  done = subprocess.run(["bash", os.path.join(ROOT, "benchmarks", "gpu_checks.sh"), sys.executable, str(out)],
                        env=env, capture_output=True, text=True, timeout=600)
  log = (out / "log.txt").read_text()
  exits = [line for line in log.splitlines() if line.startswith("=== ") and ": exit " in line]
  assert len(exits) == 7 and all(line.endswith("exit 0") for line in exits), (exits, done.stdout[-3000:])
  for path in RESULTS:
    assert (out / path).exists(), (path, log[-3000:])
  memory = json.loads((out / "qlora_7b" / "step_memory.json").read_text())
  for name in ("gpt2",):  # bf16 against both int8 modes, a ratio and a verdict line each
    decode = json.loads((out / "decode_int8" / f"{name}.json").read_text())
    assert set(decode["ratios"]) == {"batch2/int8_weight_only_vs_bf16", "batch2/int8_w8a8_dynamic_vs_bf16"}, decode
    assert len(decode["verdict"]) == 2 and decode["rows"]["batch2"]["bf16"]["tokens_per_sec"] > 0
    assert decode["param_bytes"]["int8_weight_only"] < 0.6 * decode["param_bytes"]["bf16"]
  assert memory["lora"] == "rank 64 base nf4" and memory["predicted_peak_bytes"] > 0
  fp16 = json.loads((out / "ab_fp16" / "ab.json").read_text())
  assert "fp16" in json.dumps(fp16)
  ab = json.loads((out / "ab_kernels" / "ab.json").read_text())
  assert set(ab["failed"]) == {"attention_tokamax", "norm_tokamax", "glu_tokamax"}, ab["failed"]
  assert "runs on gpu/tpu, not cpu" in ab["failed"]["attention_tokamax"]
  assert set(ab["rows"]) == {"base", "attention_xla"} and ab["rows"]["base"]["tokens_per_sec"] > 0
  assert 0 < ab["rows"]["base"]["mfu"]
  moe = json.loads((out / "ab_moe" / "ab.json").read_text())
  assert set(moe["rows"]) == {"ragged_dot"} and set(moe["failed"]) == {"tokamax"}, moe
  profile = json.loads((out / "profile_gpt2" / "profile.json").read_text())
  assert profile["step_ms"] > 0 and profile["top_ops"]
  # Each top op says what it computes: its shape and the JAX operation it came from.
  assert any(row.get("source", "").startswith("jit(") and row.get("shape") for row in profile["top_ops"])
  # Every op counted has a kind, and the kinds add up to the total. (Which kind leads is not asserted: on a
  # tiny model and a shared 2-core machine the thunks' times are mostly waiting.)
  kinds = profile["kinds_ms"]
  assert kinds["matmul"] > 0 and set(kinds) <= {"matmul", "attention (cuDNN)", "custom-call", "collective",
                                                 "copy/transpose", "slicing", "reduce", "elementwise"}, kinds
  assert abs(sum(kinds.values()) - profile["op_ms_total"]) < 1e-6 * profile["op_ms_total"] + 1e-9
  shares = profile["wall_time_shares"]
  assert set(shares) <= {"library alone", "library beside XLA ops", "one XLA op", "several XLA ops", "nothing"}
  assert abs(sum(shares.values()) - 1) < 1e-9, shares
