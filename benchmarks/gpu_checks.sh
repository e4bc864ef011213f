#!/usr/bin/env bash
# The GPU speed checks as ONE script, for a short device session: the parts' time limits add up to 1015 s, so
# one failure or hang does not eat the rest (every part writes its own files as it ends). Results go under OUT
# (default runs/gpu_checks):
#   ab_gpt2/ab.json           GPT-2 124M, bf16, seq 1024, batch 32: jaxlm's options side by side in ONE process,
#                             rounds interleaved (benchmarks/ab_step.py), beside torch.compile's HF GPT-2 step of the
#                             same shape; tokens/s and MFU (bf16 datasheet peak) per contender
#   profile_gpt2/profile.json where the baseline step's time goes, kernel by kernel (benchmarks/profile_step.py)
#   ab_llama/ab.json          the ~1.1B Llama flavour, seq 2048, batch 8: its step and MFU
#   ab_kernels/ab.json        the Llama flavour (4 layers) side by side: attention cuDNN (auto) / XLA / tokamax,
#                             tokamax's RMSNorm and gated linear unit against XLA's
#   ab_fp8/ab.json            the Llama flavour (4 layers) with fp8 weight matmuls (kernels.matmul=fp8) against bf16,
#                             and each step's custom calls (fp8 GEMMs: __cublas$lt$matmul$f8); HLO in ab_fp8/hlo/
#   ab_fp16/ab.json           GPT-2 in float16 with dynamic loss scaling against bf16
#   ab_moe/ab.json            a mixture-of-experts Llama step (8 experts, top-2): dropless with XLA's ragged_dot
#                             (auto) against tokamax's grouped matmul and jax's Mosaic GPU kernels (mosaic),
#                             beside a dense model of the same active parameters
#   (log.txt) grouped_matmul  the grouped matmul alone, forward + backward: the ideal batched matmul, XLA's
#                             ragged_dot, mosaic (benchmarks/bench_grouped_matmul.py; not in a dry run)
#   (log.txt) test_mosaic     tests/test_grouped_matmul_vjp.py on the real Mosaic kernels (not in a dry run)
#   qlora_7b/step_memory.json a QLoRA (NF4 base, rank 64) step of a random 7B Llama: the measured peak memory beside
#                             the planner's prediction (benchmarks/step_memory.py)
#   int8.json                 W8A8 int8 matmuls and MLP against bf16 and f32 (benchmarks/bench_int8.py)
#   decode_int8/{gpt2,llama_1b}.json  decoding tokens/s at batch 1 and 8, bf16 weights against int8 weight-only
#                             and W8A8 dynamic, GPT-2 124M then the ~1.1B Llama (benchmarks/bench_decode.py)
#   (log.txt)                 tests/test_kernels.py's cuDNN-vs-XLA attention test (not in a dry run)
#   log.txt                   everything printed
# Usage: bash benchmarks/gpu_checks.sh [python] [OUT]
# GPU_CHECKS_PARTS="ab_kernels int8" runs only the parts named (default: all), to split a device session's minutes.
# GPU_CHECKS_DRY_RUN=1 runs every part on tiny shapes on whatever device there is (the test suite does, on the CPU),
# so a lent GPU's minutes are not spent finding a broken flag.
# On an image whose jax lacks some of our dependencies (e.g. ml_collections, grain): install them into a folder and
# put it on PYTHONPATH.
set -uo pipefail
PY=${1:-python}
OUT=${2:-runs/gpu_checks}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9} PYTHONUNBUFFERED=1
TINY=""  # overrides appended to every --config: none on a GPU
ROUNDS=(--rounds=3 --steps_per_round=5)
KERNEL_LAYERS="--config.model.num_layers=4"  # the kernels' A/B: per-layer costs, a quarter of the compiles
GPU_PLATFORM=cuda
TORCH=--torch
INT8_SHAPE=(--batch=64 --seq=128)
DECODE=(--batches=1,8 --rounds=5)
if [ "${GPU_CHECKS_DRY_RUN:-0}" = 1 ]; then
  TINY="--config.model.num_layers=2 --config.model.d_model=128 --config.model.num_heads=2 --config.model.num_kv_heads=2"
  TINY+=" --config.model.d_ff=256 --config.model.vocab_size=512 --config.data.seq_len=32 --config.train.batch_size=4"
  ROUNDS=(--rounds=1 --steps_per_round=1 --warmup_steps_per_round=0)
  TORCH=""
  KERNEL_LAYERS=""
  INT8_SHAPE=(--batch=2 --seq=8 --repeats=1)
  DECODE=(--batches=2 --rounds=1 --new_tokens=4)
  GPU_PLATFORM=cpu
fi

gpu_only() {  # a dry run leaves out the XLA:GPU options (xla.*), which the CPU lacks
  if [ "${GPU_CHECKS_DRY_RUN:-0}" = 1 ]; then tr ',' '\n' <<<"$1" | grep -v ":xla\." | paste -sd, -
  else echo "$1"; fi
}

part() {  # part <seconds> <name> <command...>: runs one check, logs its status, never stops the script
  local limit=$1 name=$2
  shift 2
  if [ -n "${GPU_CHECKS_PARTS:-}" ] && ! grep -qw -- "$name" <<<"$GPU_CHECKS_PARTS"; then return; fi
  echo "=== $name ($(date +%T), limit ${limit}s)" | tee -a "$OUT/log.txt"
  timeout "$limit" "$@" >>"$OUT/log.txt" 2>&1
  echo "=== $name: exit $?" | tee -a "$OUT/log.txt"
}

# The baseline is the bench config as it stands: kernels `auto` (what a GPU run gets by default) and plain causal
# attention (its rows hold one document each, so the function is the same and cuDNN gets no bias tensor). Each
# variant changes one thing. The XLA options aim at the step's time in XLA's own fusions (norms, GELU, bias
# gradients): cuDNN LayerNorm, Triton multi-output fusions.
# Each is a compile option of its variant alone; one this XLA lacks is skipped, the others still run.
GPT2="--config=benchmarks/configs/bench_gpu.py $TINY"
VARIANTS="base:,ln_cudnn:xla.xla_gpu_enable_cudnn_layer_norm=True"
VARIANTS+=",triton_mof:xla.xla_gpu_unsupported_enable_triton_multi_output_fusion=True"
# torch.compile runs in the same process: JAX must not take 90% of the memory up front. (The dry run leaves it out:
# without the GPU's XLA options and torch it is ab_fp16's bf16 variant.)
[ "${GPU_CHECKS_DRY_RUN:-0}" = 1 ] || XLA_PYTHON_CLIENT_PREALLOCATE=false \
  part 150 ab_gpt2 $PY benchmarks/ab_step.py $GPT2 $TORCH "${ROUNDS[@]}" --workdir="$OUT/ab_gpt2" \
    --variants="$(gpu_only "$VARIANTS")"
part 40 profile_gpt2 $PY benchmarks/profile_step.py $GPT2 --workdir="$OUT/profile_gpt2" --top=30
LLAMA="--config=benchmarks/configs/bench_llama_1b.py $TINY"
# (The dry run leaves it out: ab_kernels runs the same command with more variants.)
[ "${GPU_CHECKS_DRY_RUN:-0}" = 1 ] || \
  part 75 ab_llama $PY benchmarks/ab_step.py $LLAMA "${ROUNDS[@]}" --workdir="$OUT/ab_llama" --variants="base:"
# tokamax's kernels (not picked by `auto` until measured) against cuDNN and XLA; a kernel this image cannot run is
# reported and skipped.
KERNELS="base:,attention_xla:kernels.attention=xla,attention_tokamax:kernels.attention=tokamax"
KERNELS+=",norm_tokamax:kernels.norm=tokamax,glu_tokamax:kernels.glu=tokamax"
XLA_PYTHON_CLIENT_PREALLOCATE=false part 80 ab_kernels $PY benchmarks/ab_step.py $LLAMA $KERNEL_LAYERS "${ROUNDS[@]}" \
    --workdir="$OUT/ab_kernels" --variants="$KERNELS"
# fp8 weight matmuls (e4m3 operands, e5m2 gradients) against bf16: the 1.1B's layer shapes, 4 layers so both compile
# in the limit. --hlo counts the compiled steps' fp8 GEMMs. (The dry run leaves it out: the CPU refuses fp8.)
[ "${GPU_CHECKS_DRY_RUN:-0}" = 1 ] || XLA_PYTHON_CLIENT_PREALLOCATE=false \
  part 90 ab_fp8 $PY benchmarks/ab_step.py $LLAMA $KERNEL_LAYERS "${ROUNDS[@]}" --workdir="$OUT/ab_fp8" --hlo \
    --variants="bf16:,fp8:kernels.matmul=fp8"
# float16 compute (dynamic loss scaling, jaxlm/training/loss_scale.py) against bf16, for GPUs without bf16.
XLA_PYTHON_CLIENT_PREALLOCATE=false part 55 ab_fp16 $PY benchmarks/ab_step.py $GPT2 "${ROUNDS[@]}" \
    --workdir="$OUT/ab_fp16" --variants="bf16:,fp16:model.compute_dtype=float16"
# The dropless MoE step's grouped matmuls: XLA's ragged_dot (what auto picks on a GPU) against tokamax's kernel.
MOE="--config=benchmarks/configs/bench_moe_gpu.py $TINY"
[ "${GPU_CHECKS_DRY_RUN:-0}" = 1 ] && MOE+=" --config.model.num_experts=4 --config.model.expert_d_ff=256"
MOE_VARIANTS="ragged_dot:,tokamax:kernels.grouped_matmul=tokamax"
# 2 x 2816: the same active parameters (a dense variant the dry run needs not compile again)
[ "${GPU_CHECKS_DRY_RUN:-0}" = 1 ] || MOE_VARIANTS+=",dense_same_active:model.num_experts=0;model.d_ff=5632"
# jax's Mosaic GPU kernels need a Hopper GPU (the CPU dry run cannot run them)
[ "${GPU_CHECKS_DRY_RUN:-0}" = 1 ] || MOE_VARIANTS+=",mosaic:kernels.grouped_matmul=mosaic"
part 120 ab_moe $PY benchmarks/ab_step.py $MOE "${ROUNDS[@]}" --workdir="$OUT/ab_moe" --variants="$MOE_VARIANTS"
part 100 qlora_7b $PY benchmarks/step_memory.py --config=experiments/configs/llama_7b_qlora.py $TINY \
    --config.train.batch_size=4 --workdir="$OUT/qlora_7b"
part 45 int8 $PY benchmarks/bench_int8.py "${INT8_SHAPE[@]}" --out="$OUT/int8.json"
# Decoding reads every weight once per step: int8 weights against bf16 (GPT-2's JSON is written before the Llama runs;
# the part fails if either does).
# (The dry run decodes GPT-2 alone: the Llama's int8 path is the same code, tested in tests/test_quantization.py.)
if [ "${GPU_CHECKS_DRY_RUN:-0}" = 1 ]; then
  part 120 decode_int8 $PY benchmarks/bench_decode.py $GPT2 ${DECODE[*]} --out="$OUT/decode_int8/gpt2.json"
else
  part 120 decode_int8 bash -c "$PY benchmarks/bench_decode.py $GPT2 ${DECODE[*]} --out=\"$OUT/decode_int8/gpt2.json\"; \
  s=\$?; $PY benchmarks/bench_decode.py $LLAMA ${DECODE[*]} --out=\"$OUT/decode_int8/llama_1b.json\" && exit \$s"
fi
# cuDNN attention against the XLA reference (bf16, packed documents): the one test the CPU suite skips.
# (The dry run leaves it out: on a CPU the test skips, and the suite runs tests/test_kernels.py itself.)
[ "${GPU_CHECKS_DRY_RUN:-0}" = 1 ] || \
  JAX_PLATFORMS=$GPU_PLATFORM part 30 test_cudnn $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py -k cudnn
# The grouped matmul alone (the rows not measured yet), and the mosaic VJP's test on the real kernels.
[ "${GPU_CHECKS_DRY_RUN:-0}" = 1 ] || \
  part 60 grouped_matmul $PY benchmarks/bench_grouped_matmul.py --only=ideal,ragged_dot,mosaic
[ "${GPU_CHECKS_DRY_RUN:-0}" = 1 ] || \
  JAX_PLATFORMS=$GPU_PLATFORM part 50 test_mosaic $PY -m pytest -q -p no:cacheprovider tests/test_grouped_matmul_vjp.py
rm -rf "$OUT/profile_gpt2/trace"  # the raw trace is too deep and large to come back
grep -h -B1 -A12 "ms/step (min" "$OUT/log.txt" | grep -v "^WARNING\|^I0\|^W0" >"$OUT/summary.txt"
grep -h -A45 "ms wall; ops" "$OUT/log.txt" >>"$OUT/summary.txt"
grep -h "passed\|failed\|error" "$OUT/log.txt" | tail -3 >>"$OUT/summary.txt"
grep -h "^=== .*: exit\|skipped:\|predicted" "$OUT/log.txt" >>"$OUT/summary.txt"
grep -h " custom calls: " "$OUT/log.txt" >>"$OUT/summary.txt"  # ab_step.py --hlo (ab_fp8)
grep -h "forward + backward\|: skipped, " "$OUT/log.txt" >>"$OUT/summary.txt"  # bench_grouped_matmul.py's rows
cat "$OUT/summary.txt"
