#!/usr/bin/env bash
# Runs hf.sh parts one after another in a process session of their own, so that they outlive the
# device call that starts them (the tool ends a call's other processes when it returns, and one
# call may last at most 600 s): the whole of issue #32's table at one commit in one sitting, with
# the ratio's two variants in ONE invocation of bench.goodput (~600 s on its own).
#
#   JOBS="PART=ratio ...;PART=goodput ...;..." bash bench/device/detached.sh start
#   bash bench/device/detached.sh wait 560     # next call(s), each within the machine's 30 s
#                                              # warm window: waits up to N s, then copies what
#                                              # the jobs wrote so far to $OUT
#
# JOBS: ';'-separated environment assignments, one hf.sh run each (e.g. "PART=goodput
# SNAPSHOTS=20 GOODPUT_TIMEOUT=540"); each writes under /tmp/detached/<n>/ and its output to
# /tmp/detached/<n>.txt; /tmp/detached/done appears when the last one ended.
set -u
root=/tmp/detached
case ${1:-} in
  start)
    rm -rf "$root"; mkdir -p "$root"
    printf '%s\n' "${JOBS:?JOBS is empty}" > "$root/jobs"
    setsid bash -c '
      root=$1; n=0
      IFS=";" read -ra jobs < "$root/jobs"
      for job in "${jobs[@]}"; do
        n=$((n + 1)); mkdir -p "$root/$n"
        echo "$(date -u +%T) job $n: $job" >> "$root/progress"
        env $job OUT="$root/$n" bash bench/device/hf.sh > "$root/$n.txt" 2>&1
        rc=$?; echo "$(date -u +%T) job $n: exit $rc" >> "$root/progress"
      done
      touch "$root/done"' _ "$root" < /dev/null > /dev/null 2>&1 &
    sleep 2; cat "$root/progress" ;;
  wait)
    deadline=$((SECONDS + ${2:-560}))
    while [[ ! -e $root/done ]] && (( SECONDS < deadline )); do sleep 5; done
    cat "$root/progress"
    cp -r "$root"/. "${OUT:?}/" 2>/dev/null
    [[ -e $root/done ]] && echo "[detached] all jobs ended" || echo "[detached] still running" ;;
  *) echo "usage: detached.sh start|wait [seconds]" >&2; exit 2 ;;
esac
