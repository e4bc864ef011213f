"""Decoding speed with float weights against int8 weights, in ONE process, rounds interleaved.

  python benchmarks/bench_decode.py --out=runs/decode_int8/gpt2.json                  # GPT-2 124M (bench_gpu.py)
  python benchmarks/bench_decode.py --config=benchmarks/configs/bench_llama_1b.py --out=runs/decode_int8/llama.json
  python benchmarks/bench_decode.py --config.model.num_layers=2 --config.model.d_model=128 \
      --config.model.num_heads=2 --config.model.vocab_size=512 --new_tokens=8 --rounds=1   # tiny: seconds on a CPU

Why: decoding at batch 1-8 reads every weight once per generated token and does little arithmetic with it, so its
speed is the weights' bytes over the memory bandwidth. Weight-only int8 (jaxlm.compress.quantization) halves those
bytes against bf16 when the matmul reads the int8 array itself (jaxlm/compress/int8.py, `_weight_only_dot`: XLA:GPU
fuses the int8 -> bf16 convert into its GEMM); whether it does, and what it buys, is what this measures.

The config's decoder with random weights, its parameters in the compute dtype (the baseline, e.g. `bf16`), against
the same weights quantized `int8_weight_only` and, labelled as such, `int8_w8a8_dynamic` (int8 inputs too, per-token
scales; --variants picks). For each --batches size: the same random prompts (--prompt_tokens per row) for every
variant, then --new_tokens greedy tokens through `jaxlm.inference.generate.generate` (KV cache, one compiled program; no stop
token, so every variant generates exactly as many), each variant compiled and run once, then timed once per round
for --rounds rounds, in turn (the order rotates each round). A call's time includes the prompt's prefill, one
step's worth of weight reads against --new_tokens steps. Reports the median per variant: tokens/s (batch x new tokens
over the call), ms per generated step, the parameters' bytes, and how XLA ran the matmuls of the compiled program
(`matmuls`: library calls, Triton GEMM fusions and how many of them read an s8 operand, s8 converts elsewhere).
Writes --out as JSON after each batch size (so a timed-out run keeps what it measured): rows, `ratios`
(<variant>_vs_<baseline> tokens/s per batch) and `verdict`, one line per int8 variant and batch saying whether it
was faster or slower than the baseline.
"""

from __future__ import annotations

import dataclasses
import os
import re
import statistics
import time

import jax
import numpy as np
from absl import flags, logging
from flax import nnx
from ml_collections import config_flags

from jaxlm import cli
from jaxlm import config as config_lib
from jaxlm import kernels as kernels_lib
from jaxlm.compress import quantization
from jaxlm.inference import generate
from jaxlm.models.gpt import GPT
from jaxlm.training import atomic_files

_CONFIG = config_flags.DEFINE_config_file("config", "benchmarks/configs/bench_gpu.py", "decoder config file")
_BATCHES = flags.DEFINE_list("batches", ["1", "8"], "batch sizes (prompts decoded together)")
_PROMPT = flags.DEFINE_integer("prompt_tokens", 32, "tokens of each row's prompt")
_NEW = flags.DEFINE_integer("new_tokens", 128, "tokens generated per row per call")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "timed calls per variant (one per round)")
_VARIANTS = flags.DEFINE_list("variants", ["float", "weight_only", "w8a8_dynamic"],
                              "float (parameters in the compute dtype) and jaxlm.compress.quantization modes")
_OUT = flags.DEFINE_string("out", "", "write the results as JSON here")

VARIANTS = ("float", "weight_only", "w8a8_dynamic")
_SHORT_DTYPE = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def float_decoder(config: config_lib.Config) -> tuple[nnx.GraphDef, nnx.State]:
  """The config's decoder with random weights stored in its compute dtype (what a bf16 deployment reads), initialised
  in one compiled program."""
  model_config = dataclasses.replace(config.model, param_dtype=config.model.compute_dtype)
  kernels = kernels_lib.resolve(config.kernels, compute_dtype=model_config.compute_dtype, causal=True,
                                **model_config.kernel_needs)
  make = lambda: GPT(model_config, kernels=kernels, rngs=nnx.Rngs(config.train.seed))  # noqa: E731
  graphdef, _ = nnx.split(nnx.eval_shape(make))
  return graphdef, jax.jit(lambda: nnx.split(make())[1])()


def matmul_summary(hlo: str) -> dict:
  """How a compiled program runs its matmuls. On a GPU: library calls by target (cuBLAS, cuDNN), Triton GEMM fusions
  and how many of them take an s8 operand (the int8 weight read by the GEMM itself), and s8 converts outside them:
  in a fusion that also reduces or dots (a matvec XLA wrote as a reduction: still an int8 read) or alone (a float
  copy of an int8 array written out: an embedding lookup's rows, or a weight XLA did not fuse; their shapes show
  which). On the CPU the weight-only path converts behind a barrier, so `alone` is expected there."""
  bodies = {m.group(1): (m.group(2), m.group(3)) for m in re.finditer(
      r"^(?:ENTRY )?%?([^\s(]+) \(([^\n]*)\) -> [^\n]*\{\n(.*?)^\}", hlo, re.M | re.S)}
  called = lambda text: re.findall(r"calls=%?([\w.\-]+)", text)  # noqa: E731
  gemm_lines = [line for line in hlo.splitlines() if re.search(r'"kind":"__triton\w*gemm', line)]
  inside_gemms, todo = set(), [c for line in gemm_lines for c in called(line)]
  while todo:  # the GEMM fusions' computations and everything they call
    name = todo.pop()
    if name not in inside_gemms:
      inside_gemms.add(name)
      todo += called(bodies.get(name, ("", ""))[1])
  reads_s8 = sum(any("s8[" in bodies.get(c, ("", ""))[0] for c in called(line)) for line in gemm_lines)
  with_matmul, alone, alone_shapes = 0, 0, set()
  for name, (header, body) in bodies.items():
    if name in inside_gemms:
      continue
    types = dict(re.findall(r"([\w.\-]+): (\w+)\[", header))  # parameters, then instructions
    types.update(re.findall(r"^\s*(?:ROOT )?%?([\w.\-]+) = (\w+)\[", body, re.M))
    converts = [shape for shape, operand in re.findall(
        r"= (\w+\[[\d,]*\])\S* convert\(%?([\w.\-]+)\)", body) if types.get(operand) == "s8"]
    if not converts:
      continue
    if re.search(r"\b(reduce|dot)\(", body):
      with_matmul += 1
    else:
      alone += 1
      alone_shapes.update(converts)
  targets = re.findall(r'custom_call_target="([^"]+)"', hlo)
  return {"library_calls": {t: targets.count(t) for t in sorted(set(targets))},
          "triton_gemm_fusions": len(gemm_lines), "triton_gemm_fusions_reading_s8": reads_s8,
          "dots": len(re.findall(r"\bdot\(", hlo)), "s8_converts_with_a_matmul": with_matmul,
          "s8_converts_alone": alone, "s8_converts_alone_shapes": sorted(alone_shapes)[:12]}


def main(argv):
  del argv  # flags only: cli.run refuses positional arguments
  logging.set_verbosity(logging.WARNING)
  config = config_lib.from_config_dict(_CONFIG.value)
  unknown = [v for v in _VARIANTS.value if v not in VARIANTS]
  if unknown:
    raise ValueError(f"--variants: {unknown[0]!r} is not one of {', '.join(VARIANTS)} (static w8a8 needs "
                     "calibration data: experiments/optimize.py measures it)")
  base = _SHORT_DTYPE.get(config.model.compute_dtype, config.model.compute_dtype)
  names = {"float": base, "weight_only": "int8_weight_only", "w8a8_dynamic": "int8_w8a8_dynamic"}
  graphdef, params = float_decoder(config)
  decoders = {}
  for variant in _VARIANTS.value:  # quantized from the same float weights
    decoders[names[variant]] = ((graphdef, params) if variant == "float" else
                                nnx.split(quantization.quantize(nnx.merge(graphdef, params), variant)))
  device = jax.devices()[0]
  c = config.model
  out = {"device_kind": device.device_kind, "platform": device.platform,
         "model": f"{c.flavour} L{c.num_layers} d{c.d_model} ff{c.d_ff} heads {c.num_heads}/"
                  f"{c.num_kv_heads or c.num_heads} vocab {c.vocab_size} {c.compute_dtype}",
         "baseline": base, "prompt_tokens": _PROMPT.value, "new_tokens": _NEW.value, "rounds": _ROUNDS.value,
         "param_bytes": {name: quantization.param_bytes(p) for name, (_, p) in decoders.items()},
         "rows": {}, "ratios": {}, "matmuls": {}, "verdict": []}
  rng = np.random.default_rng(0)
  for batch in map(int, _BATCHES.value):
    prompts = rng.integers(1, c.vocab_size, (batch, _PROMPT.value)).tolist()
    times = {name: [] for name in decoders}
    for name, (g, p) in decoders.items():  # compile and warm up
      started = time.perf_counter()
      generate.generate(g, p, prompts, _NEW.value)
      out["rows"].setdefault(f"batch{batch}", {})[name] = {"first_call_s": time.perf_counter() - started}
      out["matmuls"][f"batch{batch}/{name}"] = matmul_summary(
          generate.lower(g, p, prompts, _NEW.value).compile().as_text())  # the program just run (cached)
    order = list(decoders)
    for r in range(_ROUNDS.value):
      for name in order[r % len(order):] + order[:r % len(order)]:
        g, p = decoders[name]
        started = time.perf_counter()
        generate.generate(g, p, prompts, _NEW.value)  # returns host lists: the device work is done
        times[name].append(time.perf_counter() - started)
    for name, samples in times.items():
      median = statistics.median(samples)
      out["rows"][f"batch{batch}"][name].update(
          median_s=median, tokens_per_sec=batch * _NEW.value / median, ms_per_step=1e3 * median / _NEW.value,
          times_s=samples)
    rows = out["rows"][f"batch{batch}"]
    for name in decoders:
      if name == base or base not in rows:
        continue
      ratio = rows[name]["tokens_per_sec"] / rows[base]["tokens_per_sec"]
      out["ratios"][f"batch{batch}/{name}_vs_{base}"] = ratio
      out["verdict"].append(f"batch {batch}: {name} is {'SLOWER' if ratio < 1 else 'faster'} than {base}: "
                            f"{ratio:.2f}x its tokens/s ({rows[name]['ms_per_step']:.3f} vs "
                            f"{rows[base]['ms_per_step']:.3f} ms per step)")
    for name, row in rows.items():
      print(f"batch {batch:3d}  {name:18s} {row['tokens_per_sec']:10.1f} tokens/s  {row['ms_per_step']:8.3f} ms/step"
            f"  (first call {row['first_call_s']:.1f} s)  matmuls: {out['matmuls'][f'batch{batch}/{name}']}",
            flush=True)
    if _OUT.value:  # after every batch size: a run cut short keeps what it measured
      os.makedirs(os.path.dirname(os.path.abspath(_OUT.value)), exist_ok=True)
      atomic_files.write_json(_OUT.value, out)
  print("\n".join(out["verdict"]))


if __name__ == "__main__":
  cli.run(main)
