"""Benchmark shape for the CPU: the 6-layer, 384-wide, 6-head GPT, seq 256, vocab 8192, batch 8, f32.

Command:  python experiments/bench.py --config=experiments/configs/bench_cpu.py --workdir=runs/bench
Runtime:  2.5-5 minutes on an idle 2-core CPU once torch.compile's cache is warm (its first compile takes 1-6
          minutes, longer under load).
Expected: goals: jaxlm tokens/s at least torch.compile's in the same run (bench.json `jaxlm_vs_torch_compile` >= 1),
          compile time of 24 layers at most 1.5x that of 2 layers, the loader above 2M tokens/s. Measured
          (WORKSPACE.md, idle machine): jaxlm_vs_torch_compile 0.96-1.07 with the options below (0.97-1.03 before
          model.attention=cpu_fused, 0.89 before model.matmul=blas, 0.82-0.85 before the chunked cross-entropy,
          0.76 before remat=dots and causal_blocks' hand-written backward, 0.705 with fuse_qkv alone, 0.66 with
          none), compile ratio 0.78-1.6 wall / 0.96-1.06 CPU-seconds, loader 4.1-6.0M tokens/s.
"""

from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 8192
  config.model.num_layers = 6
  config.model.d_model = 384
  config.model.num_heads = 6
  config.model.max_seq_len = 256
  config.model.compute_dtype = "float32"  # XLA's CPU bf16 matmuls are slower than f32
  # jaxlm's fastest CPU options (each tested equal to its reference in tests/test_perf_options.py; torch's SDPA
  # likewise skips the masked half of causal attention): fused q/k/v 1.15x, block-causal attention 1.10-1.15x.
  config.model.fuse_qkv = True
  # Block-causal attention as one C++ call per layer and direction (jaxlm/cpu_attention.cc): 1.003-1.065x the
  # einsum blocks (model.attention=causal_blocks) with BLAS matmuls per step in two in-process A/Bs; blocks of 64
  # within 2% of 32, 128: 1.027x (WORKSPACE.md 2026-12-01, session 9).
  config.model.attention = "cpu_fused"
  config.model.attention_block = 32
  # Recompute the elementwise ops (norms, GELU, softmax) in the backward pass and keep only matmul outputs: fewer
  # [L, ...] residual buffers for the layer scan to zero-fill, write and read back. Measured 1.18-1.19x per step
  # on this CPU in one process, in turns with the default (WORKSPACE.md 2026-11-30).
  config.model.remat = "dots"
  # The fused cross-entropy over 1024-token chunks: no [8, 256, 8192] f32 logits, softmax and gradient arrays to
  # write and read back (the reference path's exp fusion alone took ~90 ms of thread time per step). With XLA's
  # matmuls 512 was best (1.05-1.10x over the logits path); with the BLAS matmuls below, 512 runs 0.95x and 2048
  # 0.93x of 1024 in an in-process A/B with a warm-up step per round (WORKSPACE.md 2026-12-01).
  config.model.cross_entropy_chunk = 1024
  # Every weight matmul, the cross-entropy's and attention's as OpenBLAS sgemm custom calls split over XLA's
  # threads (jaxlm/blas.py): XLA:CPU's own GEMMs ran 0.72-0.80x torch's on the weight-gradient shapes. 1.17x per
  # step in an in-process A/B with a warm-up step per round (WORKSPACE.md 2026-12-01).
  config.model.matmul = "blas"
  config.data.seq_len = 256
  config.train.batch_size = 8
  config.mesh.data = 1  # one device: a single-process comparison with torch on the same cores
  return config
