#!/bin/bash
# Per-step losses of three runs and their sha256, to show a refactor changes no number: the demo (1000 steps), the
# demo LM with LoRA rank 8 (300 steps) and in float16 with loss scaling (300 steps), every step logged.
#   benchmarks/loss_fingerprint.sh <jaxlm tree> <out folder> [python]
# Run it on a checkout of the old and of the new tree (e.g. `git worktree add ../before <commit>`): equal hashes,
# equal losses to the bit.
set -euo pipefail
TREE=$(cd "$1" && pwd); OUT=$(mkdir -p "$2" && cd "$2" && pwd); PY=${3:-python}
cd "$TREE"
export PYTHONPATH=$TREE XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu
for run in "demo:" "lora:--config.lora.rank=8 --config.train.steps=300 --config.train.learning_rate=1e-3" \
           "fp16:--config.model.compute_dtype=float16 --config.train.steps=300"; do
  name=${run%%:*}; flags=${run#*:}
  rm -rf "$OUT/$name"
  # shellcheck disable=SC2086
  "$PY" experiments/train_lm.py --config=experiments/configs/demo.py --workdir="$OUT/$name" --config.log.every_steps=1 \
    --config.log.progress_bar=False $flags > "$OUT/$name.log" 2>&1
  "$PY" - "$OUT/$name/metrics.jsonl" "$name" <<'PYEOF'
import hashlib, json, sys
losses = [json.loads(line)["loss"] for line in open(sys.argv[1])]
print(sys.argv[2], len(losses), "steps, sha256", hashlib.sha256(json.dumps(losses).encode()).hexdigest(), "last", losses[-1])
PYEOF
done
