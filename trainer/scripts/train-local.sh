#!/usr/bin/env bash
# Tiny CPU trainer: 2 ranks (gloo; RTJ_NPROC_PER_NODE) under NVRx ft_launcher on this machine, no
# Kubernetes. RTJ_WARM_WORKERS=1 starts the workers from pre-imported processes (rtj_trainer.launcher.warmpool).
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
  # As in the operator's pods (trainerenv.IN_PROCESS_RESTART_NCCL_ENV): a CUDA error seen by the
  # NCCL watchdog after an abort must not end the process.
  export TORCH_NCCL_RETHROW_CUDA_ERRORS=${TORCH_NCCL_RETHROW_CUDA_ERRORS:-0}
else
  export RTJ_HEARTBEAT_TIMEOUT_SECONDS=${RTJ_HEARTBEAT_TIMEOUT_SECONDS:-5}
fi
export RTJ_METRICS_HOST=${RTJ_METRICS_HOST:-127.0.0.1}
export TRAINER_FAULTS=${TRAINER_FAULTS:-}
export RTJ_FAULT_INJECTION=1   # a local run is the developer's own: faults may fire
export PYTHONUNBUFFERED=1

# The same ft_launcher settings as the operator's pods (operator/rtj_operator/ftflags.py); only
# the rendezvous (standalone here) and the numbers given below differ.
GPUS=${RTJ_GPUS:-$( (command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -c '^GPU') || echo 0)}
mapfile -t FT_FLAGS < <("$BIN/python" -m rtj_operator.ftflags \
  --max-restarts="${RTJ_MAX_RESTARTS:-3}" --term-timeout="${RTJ_TERM_TIMEOUT_SECONDS:-10}" \
  --initial-heartbeat-timeout="${RTJ_INITIAL_HEARTBEAT_TIMEOUT_SECONDS:-60}" \
  --heartbeat-timeout="$RTJ_HEARTBEAT_TIMEOUT_SECONDS" --gpus="$GPUS")
[[ ${#FT_FLAGS[@]} -gt 0 ]] || { echo "[train-local] python -m rtj_operator.ftflags failed" >&2; exit 2; }

# ft_launcher through the shim the pods run (rtj_trainer.launcher): a worker that exits with
# 94 (rtj_trainer.errors.FATAL_EXIT_CODE: restarting cannot help) ends the run with 93 at once.
exec "$BIN/python" -m rtj_trainer.launcher --rtj-non-retryable-exit-codes=94 --standalone --nnodes=1 --nproc-per-node="${RTJ_NPROC_PER_NODE:-2}" "${FT_FLAGS[@]}" \
  --no-python "$BIN/python" -m rtj_trainer --preset tiny "$@"
