#!/usr/bin/env bash
# The GPU speed checks as ONE script, for a short device session. Each part has its own time limit, so one failure
# or hang does not eat the rest (every part writes its own files as it ends). Results go under OUT
# (default runs/gpu_checks):
#   ab_gpt2/ab.json           GPT-2 124M, bf16, seq 1024, batch 32: jaxlm's options side by side in ONE process,
#                             rounds interleaved (benchmarks/ab_step.py), beside torch.compile's HF GPT-2 step of the
#                             same shape; tokens/s and MFU (bf16 datasheet peak) per contender
#   profile_gpt2/profile.json where the baseline step's time goes, kernel by kernel (benchmarks/profile_step.py)
#   ab_llama/ab.json          the ~1.1B Llama flavour, seq 2048, batch 8: options side by side
#   profile_llama/profile.json  its baseline step kernel by kernel
#   (log.txt)                 tests/test_kernels.py's cuDNN-vs-XLA attention test, skipped on the CPU
#   log.txt                   everything printed
# Usage: bash benchmarks/gpu_checks.sh [python] [OUT]
# On an image whose jax lacks some of our dependencies (e.g. ml_collections, grain): install them into a folder and
# put it on PYTHONPATH.
set -uo pipefail
PY=${1:-python}
OUT=${2:-runs/gpu_checks}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9} PYTHONUNBUFFERED=1

part() {  # part <seconds> <name> <command...>: runs one check, logs its status, never stops the script
  local limit=$1 name=$2
  shift 2
  echo "=== $name ($(date +%T), limit ${limit}s)" | tee -a "$OUT/log.txt"
  timeout "$limit" "$@" >>"$OUT/log.txt" 2>&1
  echo "=== $name: exit $?" | tee -a "$OUT/log.txt"
}

# The baseline is the bench config as it stands: kernels `auto` (what a GPU run gets by default) and plain causal
# attention (its rows hold one document each, so the function is the same and cuDNN gets no bias tensor). Each
# variant changes one thing. The XLA options aim at the step's time in XLA's own fusions (norms, GELU, bias
# gradients): cuDNN LayerNorm, Triton block-level (normalization/softmax) fusions, Triton multi-output fusions.
# Each is a compile option of its variant alone; one this XLA lacks is skipped, the others still run.
GPT2="--config=benchmarks/configs/bench_gpu.py"
TRITON_BLOCKS="triton_blocks:xla.xla_gpu_experimental_enable_fusion_block_level_rewriter=True"
VARIANTS="base:,ln_cudnn:xla.xla_gpu_enable_cudnn_layer_norm=True,$TRITON_BLOCKS"
VARIANTS+=",triton_mof:xla.xla_gpu_unsupported_enable_triton_multi_output_fusion=True,b64:train.batch_size=64"
# torch.compile runs in the same process: JAX must not take 90% of the memory up front.
XLA_PYTHON_CLIENT_PREALLOCATE=false part 240 ab_gpt2 $PY benchmarks/ab_step.py $GPT2 --torch --rounds=5 \
    --steps_per_round=5 --workdir="$OUT/ab_gpt2" --variants="$VARIANTS"
part 90 profile_gpt2 $PY benchmarks/profile_step.py $GPT2 --workdir="$OUT/profile_gpt2" --top=30
LLAMA="--config=benchmarks/configs/bench_llama_1b.py"
# Batch 16: fixed per-step costs spread over twice the tokens. Four contenders' states and temporaries must fit:
# JAX allocates as it goes, not 75% up front.
XLA_PYTHON_CLIENT_PREALLOCATE=false part 200 ab_llama $PY benchmarks/ab_step.py $LLAMA --rounds=3 \
    --steps_per_round=3 --workdir="$OUT/ab_llama" \
    --variants="base:,qkv:kernels.fuse_qkv=separate,$TRITON_BLOCKS,b16:train.batch_size=16"
part 90 profile_llama $PY benchmarks/profile_step.py $LLAMA --workdir="$OUT/profile_llama" --top=30
# cuDNN attention against the XLA reference (bf16, packed documents): the one test the CPU suite skips.
JAX_PLATFORMS=cuda part 90 test_cudnn $PY -m pytest -q -p no:cacheprovider tests/test_kernels.py -k cudnn
rm -rf "$OUT/profile_gpt2/trace" "$OUT/profile_llama/trace"  # the raw traces are too deep and large to come back
grep -h -B1 -A12 "ms/step (min" "$OUT/log.txt" | grep -v "^WARNING\|^I0\|^W0" >"$OUT/summary.txt"
grep -h -A45 "ms wall; ops" "$OUT/log.txt" >>"$OUT/summary.txt"
grep -h "passed\|failed\|error" "$OUT/log.txt" | tail -3 >>"$OUT/summary.txt"
cat "$OUT/summary.txt"
