#!/usr/bin/env bash
# The GPU benchmark in one script (minutes on an H100/H200): GPT-2 124M against torch.compile (when torch has CUDA),
# then the ~1.1B Llama flavour, each with the cuDNN-vs-XLA attention check. Results: runs/bench_gpu*/bench.json.
#   bash benchmarks/bench_gpu.sh [python]
set -euo pipefail
PY=${1:-python}
cd "$(dirname "$0")/.."
$PY benchmarks/bench.py --config=benchmarks/configs/bench_gpu.py --workdir=runs/bench_gpu \
    --frameworks=jaxlm,torch_compile --sections=peak,step,gpu --rounds=3 --steps_per_round=5
$PY benchmarks/bench.py --config=benchmarks/configs/bench_llama_1b.py --workdir=runs/bench_gpu_llama_1b \
    --frameworks=jaxlm --sections=peak,step,gpu --rounds=3 --steps_per_round=5
