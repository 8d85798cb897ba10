#!/usr/bin/env bash
# Tiny CPU trainer: 2 ranks (gloo) under NVRx ft_launcher on this machine, no Kubernetes.
#
#   make train-local                                  # fault-free run
#   TRAINER_FAULTS="8:1:exception,17:0:sigkill,26:1:hang" make train-local
#   bash trainer/scripts/train-local.sh --set train.steps=60   # extra args go to the trainer
#
# Each run gets a fresh checkpoint/run directory (printed first; RTJ_RUN_DIR picks one). The
# heartbeat timeouts are short so that a `hang` is detected in about 5 s.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
BIN=${RTJ_VENV:-$ROOT/.venv}/bin
RUN_DIR=${RTJ_RUN_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/rtj-train-local.XXXXXX")}
mkdir -p "$RUN_DIR"
echo "[train-local] run directory: $RUN_DIR (TRAINER_FAULTS=${TRAINER_FAULTS:-})"

export RTJ_CHECKPOINT_DIR=$RUN_DIR
export RTJ_JOB_NAME=${RTJ_JOB_NAME:-train-local}
# With in-process restart on, the rank monitor must give the wrapper time to abort gloo's
# collectives (a few seconds on CPU) before it kills the ranks: a longer default then.
if [[ ${RTJ_INPROCESS_RESTART:-0} == 1 ]]; then
  export RTJ_HEARTBEAT_TIMEOUT_SECONDS=${RTJ_HEARTBEAT_TIMEOUT_SECONDS:-15}
else
  export RTJ_HEARTBEAT_TIMEOUT_SECONDS=${RTJ_HEARTBEAT_TIMEOUT_SECONDS:-5}
fi
export RTJ_METRICS_HOST=${RTJ_METRICS_HOST:-127.0.0.1}
export TRAINER_FAULTS=${TRAINER_FAULTS:-}
export PYTHONUNBUFFERED=1

exec "$BIN/ft_launcher" --standalone --nnodes=1 --nproc-per-node=2 \
  --max-restarts="${RTJ_MAX_RESTARTS:-3}" \
  --ft-initial-rank-heartbeat-timeout="${RTJ_INITIAL_HEARTBEAT_TIMEOUT_SECONDS:-60}" \
  --ft-rank-heartbeat-timeout="$RTJ_HEARTBEAT_TIMEOUT_SECONDS" \
  --ft-workload-check-interval=1 \
  --ft-gpu-memory-reclaim-timeout=0 \
  --ft-checkpoint-iteration-file="$RUN_DIR/latest-committed-step" \
  --workers-stop-timeout=5 --term-timeout=10 --monitor-interval=0.3 \
  --no-python "$BIN/python" -m rtj_trainer --preset tiny "$@"
