"""benchmarks/profile_step.py: HLO instructions get the right kinds (jaxlm.planner.hlo_traffic.instruction_kinds); a
profiled tiny step written with its time by kind: tests/test_gpu_checks.py (the GPU script's dry run profiles one)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxlm.planner import hlo_traffic


def test_hlo_kinds_of_a_sharded_matmul_step():
  mesh = jax.make_mesh((4,), ("data",))
  x = jax.device_put(np.ones((8, 16), np.float32), NamedSharding(mesh, P("data")))
  w = jnp.ones((16, 4), jnp.float32)
  # x @ w, then a sum over the sharded rows: a dot and an all-reduce.
  text = jax.jit(lambda x, w: jnp.tanh(x @ w).sum(axis=0)).lower(x, w).compile().as_text()
  kinds = hlo_traffic.instruction_kinds(text)
  assert "matmul" in kinds.values() and "collective" in kinds.values(), kinds


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
