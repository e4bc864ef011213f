"""The well-known small CPU recipe: nanoGPT's shakespeare_char on a laptop CPU (character-level, 4 layers, 4 heads,
128 wide, context 64, batch 12, lr 1e-3, beta2 0.99, 2000 steps, f32, 65 symbols), as a step-time benchmark.

Command:  python benchmarks/bench.py --config=benchmarks/configs/shakespeare_char.py --workdir=runs/bench_char \
            --frameworks=jaxlm,torch_eager,torch_nanogpt --sections=step --rounds=10 --steps_per_round=20
          (torch_eager: HF transformers' GPT-2 of the same shape, eager; torch_nanogpt: nanoGPT's GPT with its
          train.py defaults, eager, as nanoGPT's README runs this recipe on a CPU with --compile=False)
Runtime:  under a minute on a 2-core CPU.
Result:   bench.json `jaxlm_vs_torch_eager` and `jaxlm_vs_torch_nanogpt` (above 1: jaxlm faster) and the median
          step times `*_step_sec`.

The bench times fixed random tokens, so it needs no data. Training it on Tiny Shakespeare needs the text as a file
(--config.data.source=files --config.data.train_files=input.txt) and a character-level tokenizer.json with an
end-of-document token (--config.data.tokenizer=..., model.vocab_size = its size): the byte-level BPE that jaxlm
trains by default needs at least 257 tokens. The kernels stay `auto`.
"""

from jaxlm.config import default_config


def get_config():
  config = default_config()
  config.model.vocab_size = 65  # the distinct characters of Tiny Shakespeare
  config.model.num_layers = 4
  config.model.d_model = 128
  config.model.num_heads = 4
  config.model.max_seq_len = 64
  config.model.compute_dtype = "float32"  # XLA's CPU bf16 matmuls are slower than f32
  config.data.seq_len = 64
  config.train.steps = 2000
  config.train.batch_size = 12
  config.train.learning_rate = 1e-3
  config.train.warmup_steps = 100
  config.train.b2 = 0.99  # nanoGPT raises beta2 for its small batches of few tokens
  config.train.eval_every_steps = 250
  config.train.eval_batches = 20
  config.checkpoint.every_steps = 250
  config.mesh.data = 1  # one device: a single-process comparison with torch on the same cores
  return config
