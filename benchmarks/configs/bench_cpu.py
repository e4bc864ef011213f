"""Benchmark shape for the CPU: a 6-layer, 384-wide, 6-head GPT, seq 256, vocab 8192, batch 8, f32.

Command:  python benchmarks/bench.py --config=benchmarks/configs/bench_cpu.py --workdir=runs/bench
Runtime:  a few minutes on a 2-core CPU once torch.compile's cache is warm (its first compile takes minutes more).
Expected: jaxlm's tokens/s at least torch.compile's in the same run (bench.json `jaxlm_vs_torch_compile` >= 1),
          compile time of 24 layers at most 1.5x that of 2 layers, the loader above 2M tokens/s.

Only the shape is set: the kernels stay `auto`, so this measures what every CPU run gets by default.
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
  config.data.seq_len = 256
  config.train.batch_size = 8
  config.mesh.data = 1  # one device: a single-process comparison with torch on the same cores
  return config
