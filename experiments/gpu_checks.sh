#!/usr/bin/env bash
# Every check still owed to a GPU, as ONE script for a short device session (about 6 minutes on an H200, at most
# 9.6; each part has its own time limit so one failure does not eat the rest). Results go under OUT (default
# runs/gpu_checks):
#   doctor.txt                 versions, devices, bf16 matmul, FLOP/s
#   plan_gpt2_small/           planner: predicted vs measured step time and memory for gpt2_small on this GPU (#7)
#   bench_<variant>/bench.json GPT-2 124M speed options, jaxlm only (#9): no document mask, layer loop, fused q/k/v,
#                              batch 64 + remat=dots
#   bench_torch/bench.json     the same shape with torch.compile beside jaxlm's best-known options
#   profile_gpt2/profile.json  where the GPT-2 step's time goes, kernel by kernel (experiments/profile_step.py)
#   log.txt                    everything printed
# Usage: bash experiments/gpu_checks.sh [python] [OUT]
# On an image whose jax lacks some of our dependencies (e.g. ml_collections, grain): install them into a folder and
# put it on PYTHONPATH (WORKSPACE.md, "GPU device sessions").
set -uo pipefail
PY=${1:-python}
OUT=${2:-runs/gpu_checks}
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}

part() {  # part <seconds> <name> <command...>: runs one check, logs its status, never stops the script
  local limit=$1 name=$2
  shift 2
  echo "=== $name ($(date +%T), limit ${limit}s)" | tee -a "$OUT/log.txt"
  timeout "$limit" "$@" >>"$OUT/log.txt" 2>&1
  echo "=== $name: exit $?" | tee -a "$OUT/log.txt"
}

part 45 doctor bash -c "$PY experiments/doctor.py > $OUT/doctor.txt 2>&1"
part 90 plan_gpt2_small $PY experiments/plan.py --config=experiments/configs/gpt2_small.py \
    --hardware=h200_141gb,h100_80gb --devices=1 --compile=none --measure --workdir="$OUT/plan_gpt2_small"
bench_variant() {  # bench_variant <name> <overrides...>: jaxlm alone, 2 rounds of 5 steps
  local name=$1
  shift
  part 55 "bench_$name" $PY experiments/bench.py --config=experiments/configs/bench_gpu.py --frameworks=jaxlm \
      --sections=peak,step --rounds=2 --steps_per_round=5 --workdir="$OUT/bench_$name" "$@"
}
# b32_ce4096 itself ran 99.3 ms/step on 2026-11-30 (WORKSPACE.md); without the document mask cuDNN gets no bias
# tensor and computes no bias gradient (the bench's rows hold one document each, so the function is the same).
B32="--config.train.batch_size=32 --config.model.cross_entropy_chunk=4096 --config.model.document_mask=False"
bench_variant b32_ce4096_nodoc $B32
bench_variant b32_ce4096_nodoc_loop $B32 --config.model.scan_layers=False
bench_variant b32_ce4096_nodoc_qkv $B32 --config.model.fuse_qkv=True
bench_variant b64_ce4096_nodoc_qkv_dots --config.train.batch_size=64 --config.model.cross_entropy_chunk=4096 \
    --config.model.document_mask=False --config.model.fuse_qkv=True --config.model.remat=dots
part 70 profile_gpt2 $PY experiments/profile_step.py --config=experiments/configs/bench_gpu.py \
    --workdir="$OUT/profile_gpt2" $B32
# torch.compile beside jaxlm with the options above (batch 16: both must fit on one GPU at once).
XLA_PYTHON_CLIENT_PREALLOCATE=false part 150 bench_torch $PY experiments/bench.py \
    --config=experiments/configs/bench_gpu.py --frameworks=jaxlm,torch_compile --sections=step --rounds=3 \
    --steps_per_round=5 --workdir="$OUT/bench_torch" --config.model.cross_entropy_chunk=4096 \
    --config.model.fuse_qkv=True --config.model.document_mask=False
grep -h "jaxlm_mfu\|jaxlm_tokens_per_sec\|jaxlm_vs_torch_compile\|torch_compile_mfu" "$OUT"/bench_*/bench.json \
    >"$OUT/summary.txt" 2>/dev/null
grep -h "measured here" "$OUT/log.txt" >>"$OUT/summary.txt"
grep -h -A8 "ms wall; ops" "$OUT/log.txt" >>"$OUT/summary.txt"
cat "$OUT/summary.txt"
