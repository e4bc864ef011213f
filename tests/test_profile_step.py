"""benchmarks/profile_step.py: HLO instructions get the right kinds (jaxlm.planner.hlo_traffic.instruction_kinds), and a
profiled tiny step is written with its time by kind."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
from conftest import xla_flags_without_device_count
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlm.planner import hlo_traffic

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_hlo_kinds_of_a_sharded_matmul_step():
  mesh = jax.make_mesh((4,), ("data",))
  x = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh, P("data")))
  w = jnp.ones((16, 4), jnp.float32)
  # x @ w, then a sum over the sharded rows: a dot and an all-reduce.
  text = jax.jit(lambda x, w: jnp.tanh(x @ w).sum(axis=0)).lower(x, w).compile().as_text()
  kinds = hlo_traffic.instruction_kinds(text)
  assert "matmul" in kinds.values() and "collective" in kinds.values(), kinds


def test_profile_of_a_tiny_step_is_written(tmp_path):
  config = tmp_path / "tiny.py"
  config.write_text(
      "from jaxlm.config import default_config\n"
      "def get_config():\n"
      "  c = default_config()\n"
      "  c.model.vocab_size, c.model.num_layers, c.model.d_model, c.model.num_heads = 512, 2, 128, 4\n"
      "  c.model.max_seq_len, c.data.seq_len, c.model.compute_dtype = 64, 64, 'float32'\n"
      "  c.train.batch_size, c.mesh.data = 8, 1\n"
      "  return c\n")
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  # One device (as a user's laptop); the suite's cheaper compile settings stay (conftest.py).
  env["XLA_FLAGS"] = xla_flags_without_device_count()
  result = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks/profile_step.py"), f"--config={config}",
                           f"--workdir={tmp_path}/profile", "--steps=1"],
                          env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-2000:]
  profile = json.loads(open(tmp_path / "profile" / "profile.json").read())
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


def test_gpu_kernel_names_map_to_their_instructions():
  """XLA:GPU kernels replayed from CUDA graphs carry only the kernel's name (as seen on an H200, jax 0.11.2):
  `loop_add_fusion_3` is instruction `loop_add_fusion.3`; cuBLAS / cuDNN kernels get a kind from their names."""
  kinds = {"loop_add_fusion.3": "elementwise", "input_reduce_fusion": "reduce"}
  assert hlo_traffic.event_instruction("loop_add_fusion_3", kinds) == "loop_add_fusion.3"
  assert hlo_traffic.event_instruction("input_reduce_fusion", kinds) == "input_reduce_fusion"
  assert hlo_traffic.event_instruction("loop_add_fusion_4", kinds) is None
  assert hlo_traffic.library_kernel_kind("nvjet_sm90_tst_128x128_64x6_2x1_v_bz_TNT") == "matmul"
  assert hlo_traffic.library_kernel_kind(
      "cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26") == "attention (cuDNN)"
  assert hlo_traffic.library_kernel_kind("wrapped_concatenate_12") == "XLA fusion (unmatched)"
  assert hlo_traffic.library_kernel_kind("void cublasLt::splitKreduce_kernel<32, 16, int, float>") == "other kernel"


def test_instruction_summary_reads_shape_and_source():
  text = ('  %fusion.7 = f32[4096,128]{1,0} fusion(%p.1), kind=kInput, calls=%fused_reduce.2, '
          'metadata={op_name="jit(train_step)/jvp()/reduce_max" stack_frame_id=40}\n')
  assert hlo_traffic.instruction_summaries(text, ["fusion.7", "fusion.8"]) == {
      "fusion.7": {"shape": "f32[4096,128]{1,0}", "source": "jit(train_step)/jvp()/reduce_max"}}
