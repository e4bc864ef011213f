"""Session 11: what the H200 MFU goals of #9 ask of the step, from the 2026-11-30 profiles and bench JSONs, and
memory-traffic estimates of the non-matmul work that could be cut (arithmetic, not a measurement).
  python experiments/results/cpu_2026-12-01/session11/gpu_gap.py
"""
import json
import pathlib

RESULTS = pathlib.Path(__file__).resolve().parents[2] / "h200_2026-11-30"
HBM = 4.8e12  # H200 datasheet bandwidth, bytes/s; the profile's big reductions ran at ~4.4e12
DATASHEET = 989e12

for name, bench, profile, goal, params, tokens, vocab, chunks in (
    ("GPT-2 124M, B32 x 1024", "bench_gpt2.json", "profile_gpt2_b32.json", 0.50, 124e6, 32768, 50304, 8),
    ("Llama 1.1B, B8 x 2048", "bench_llama_1b.json", "profile_llama_b8.json", 0.60, 1.1e9, 16384, 32768, 4)):
  b = json.loads((RESULTS / bench).read_text())
  p = json.loads((RESULTS / profile).read_text())
  step = p["step_ms"]
  flops = b["flops_per_token"] * b["tokens_per_step"]
  mfu = flops / (step / 1e3) / DATASHEET
  needed = flops / goal / DATASHEET * 1e3
  kinds = p["kinds_ms"]
  library = kinds.get("matmul", 0) + kinds.get("attention (cuDNN)", 0)
  xla = p["op_ms_total"] - library
  # The fused cross-entropy per chunk of [tokens / chunks, V] f32 logits: written once by the matmul, read by three
  # reductions (max, argmax, sum of exp) and by the gradient pass, which writes a bf16 gradient: 5.5 passes.
  logits = tokens / chunks * vocab * 4
  ce_ms = 5.5 * logits * chunks / HBM * 1e3
  one_pass_ce_saving = 2 * logits * chunks / HBM * 1e3  # one variadic reduction instead of three
  adam_ms = params * 28 / HBM * 1e3  # f32 param, grad, m, v read; param, m, v written
  print(f"{name}: profiled step {step:.1f} ms (MFU {mfu:.3f}); goal {goal:.0%} needs <= {needed:.1f} ms: cut "
        f"{step - needed:.1f} ms. Library kernels (cuBLAS, cuDNN) {library:.1f} ms, XLA's own {xla:.1f} ms. "
        f"Traffic estimates: fused CE {ce_ms:.1f} ms (one-pass statistics would save {one_pass_ce_saving:.1f}), "
        f"AdamW update {adam_ms:.1f} ms")
