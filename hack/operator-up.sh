#!/usr/bin/env bash
# Run the operator in the background against the cluster of `make cluster-up`.
#   hack/operator-up.sh [CLUSTER_DIR]      (default .cluster)
# Writes CLUSTER_DIR/operator.pid and CLUSTER_DIR/operator.log; waits until its liveness endpoint
# answers. Settings come from RTJ_OPERATOR_* variables (see operator/rtj_operator/config.py).
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.cluster}"
if [[ ! -f "$dir/env" ]]; then
  echo "no cluster in $dir: run 'make cluster-up' first" >&2
  exit 1
fi
# shellcheck disable=SC1091
source "$dir/env"
pidfile="$dir/operator.pid"
if [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
  echo "operator already running (pid $(cat "$pidfile")); log: $dir/operator.log"
  exit 0
fi
export RTJ_OPERATOR_LIVENESS_PORT="${RTJ_OPERATOR_LIVENESS_PORT:-8091}"
export RTJ_OPERATOR_METRICS_PORT="${RTJ_OPERATOR_METRICS_PORT:-8090}"
# Its own session, so operator-down can stop the operator and nothing else.
setsid .venv/bin/python -m rtj_operator >"$dir/operator.log" 2>&1 < /dev/null &
echo $! >"$pidfile"
for _ in $(seq 1 120); do
  if ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    echo "the operator exited; last lines of $dir/operator.log:" >&2
    tail -n 20 "$dir/operator.log" >&2
    rm -f "$pidfile"
    exit 1
  fi
  if .venv/bin/python - "$RTJ_OPERATOR_LIVENESS_PORT" <<'PY' 2>/dev/null; then
import sys, urllib.request
urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/healthz", timeout=1).read()
PY
    echo "operator up (pid $(cat "$pidfile")); log: $dir/operator.log;" \
      "metrics: http://127.0.0.1:$RTJ_OPERATOR_METRICS_PORT/metrics"
    exit 0
  fi
  sleep 0.5
done
echo "the operator did not become live within 60 s; see $dir/operator.log" >&2
exit 1
