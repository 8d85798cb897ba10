#!/usr/bin/env bash
# Stop the operator started by hack/operator-up.sh: SIGTERM its process group, SIGKILL after 15 s.
#   hack/operator-down.sh [CLUSTER_DIR]    (default .cluster)
set -euo pipefail
cd "$(dirname "$0")/.."
dir="${1:-.cluster}"
pidfile="$dir/operator.pid"
if [[ ! -f "$pidfile" ]]; then
  echo "no operator pid file in $dir; nothing to stop"
  exit 0
fi
pid="$(cat "$pidfile")"
if kill -0 "$pid" 2>/dev/null; then
  kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 30); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.5
  done
  if kill -0 "$pid" 2>/dev/null; then
    kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid" 2>/dev/null || true
  fi
  echo "operator stopped (pid $pid)"
fi
rm -f "$pidfile"
