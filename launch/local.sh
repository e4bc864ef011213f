#!/usr/bin/env bash
# Run one job as several JAX processes on this host, the way a cluster runs one process per host.
#
#   launch/local.sh <processes> <devices_per_process> <script> [flags...]
#   launch/local.sh 2 2 experiments/train_lm.py --config=experiments/configs/demo.py --workdir=runs/mp
#
# Each process sees <devices_per_process> simulated CPU devices (or, with JAXLM_LOCAL_GPUS=1, its own slice of the
# GPUs through CUDA_VISIBLE_DEVICES). Process 0 prints to the terminal; the others write <workdir or /tmp>/logs.
# If any process fails, the others are stopped and the exit status is the first failure's. SIGTERM or Ctrl-C stops
# the run the way a preemption does: every process is sent SIGUSR1, saves a checkpoint and exits 0, and this script
# waits for all of them (the same command again resumes).
set -euo pipefail

if [ $# -lt 3 ]; then
  echo "usage: launch/local.sh <processes> <devices_per_process> <script> [flags...]" >&2
  exit 2
fi
processes=$1; devices=$2; script=$3; shift 3
python=${PYTHON:-$(dirname "$0")/../.venv/bin/python}
[ -x "$python" ] || python=python3
port=${JAXLM_PORT:-$((20000 + RANDOM % 20000))}
logdir=$(mktemp -d "${TMPDIR:-/tmp}/jaxlm-local.XXXXXX")

pids=()
stop_others() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
# Ctrl-C reaches the processes directly too; SIGUSR1 beside it does not count as a second ("exit now") signal.
pass_on_stop() { for pid in "${pids[@]}"; do kill -USR1 "$pid" 2>/dev/null || true; done; }
trap pass_on_stop INT TERM

for ((i = 0; i < processes; i++)); do
  env_vars=(JAXLM_COORDINATOR_ADDRESS=127.0.0.1:$port JAXLM_NUM_PROCESSES=$processes JAXLM_PROCESS_ID=$i)
  if [ "${JAXLM_LOCAL_GPUS:-0}" = 1 ]; then
    first=$((i * devices)); list=$(seq -s, $first $((first + devices - 1)))
    env_vars+=(CUDA_VISIBLE_DEVICES=$list)
  else
    # Keep the caller's other XLA flags; only the simulated device count is this script's to set.
    other_flags=$(printf '%s' "${XLA_FLAGS:-}" |
                  sed -E 's/--xla_force_host_platform_device_count=[0-9]+//g; s/  +/ /g; s/^ //; s/ $//')
    device_flag="--xla_force_host_platform_device_count=$devices"
    env_vars+=(JAX_PLATFORMS=cpu XLA_FLAGS="${other_flags:+$other_flags }$device_flag")
  fi
  if [ "$i" = 0 ]; then
    env "${env_vars[@]}" "$python" "$script" "$@" &
  else
    env "${env_vars[@]}" "$python" "$script" "$@" > "$logdir/process_$i.log" 2>&1 &
  fi
  pids+=($!)
done

status=0
while [ "${#pids[@]}" -gt 0 ]; do
  code=0
  finished=""
  wait -n -p finished "${pids[@]}" || code=$?
  if [ -z "${finished:-}" ]; then
    if [ "$code" -gt 128 ]; then continue; fi  # a trapped signal cut the wait short; the processes still run
    break
  fi
  live=(); for pid in "${pids[@]}"; do [ "$pid" != "$finished" ] && live+=("$pid"); done; pids=("${live[@]}")
  if [ "$code" != 0 ] && [ "$status" = 0 ]; then
    status=$code
    echo "local.sh: process with pid $finished exited with status $code; stopping the others (logs: $logdir)" >&2
    tail -n 20 "$logdir"/process_*.log >&2 2>/dev/null || true
    stop_others
  fi
done
exit $status
