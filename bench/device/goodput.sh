#!/usr/bin/env bash
# Goodput of a 2,000-step run of the `1b` model shape on the GPUs of one host (2 ranks) with five
# injected faults (exception, SIGKILL, hang, exception, SIGKILL), in-process restart on; run on
# a lent GPU machine (wheels carried in .whl/; see bench/device/setup.sh):
#
#   bash bench/device/goodput.sh
#
# BATCH (default 4, half the `1b` preset's 8) keeps the whole run inside one device call's
# 10 minutes; shorter steps make each fault cost a larger share of the run, so the goodput is, if
# anything, understated. INTERVAL (default 100, ~10 s at batch 4) is what the machine's one disk
# absorbs: a save writes two ~7.5 GB shards at 1.3-1.6 GB/s (at 50 the commits fell behind).
# LOCAL_DIR (default /dev/shm/rtj-local; empty: off) keeps node-local copies of the saves
# (checkpoint.local_dir). Writes $OUT/goodput.json (bench.goodput's JSON).
set -u
. bench/device/setup.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# A warm machine keeps the last call's run directories: GBs of shards each, enough to fill its
# disk (seen: a goodput run after a recovery run found no space for any commit).
rm -rf /tmp/gp /dev/shm/rtj-local
LOCAL_DIR=${LOCAL_DIR-/dev/shm/rtj-local}
LOCAL_SET=(); [[ -n $LOCAL_DIR ]] && LOCAL_SET=(--set "checkpoint.local_dir=$LOCAL_DIR")
python3 -m bench.goodput --variants faulted-inprocess --steps "${STEPS:-2000}" \
  --checkpoint-interval "${INTERVAL:-100}" --heartbeat-timeout "${HB:-10}" \
  --set model.num_layers=16 --set model.d_model=2048 --set model.num_heads=16 \
  --set model.vocab_size=32000 --set model.seq_len=2048 --set data.batch_size="${BATCH:-4}" \
  "${LOCAL_SET[@]}" \
  --run-timeout "${RUN_TIMEOUT:-540}" --work-dir /tmp/gp --out "$OUT/goodput.json"
rc=$?
grep -aE "Cycle: [0-9]+ Event: failure_detected|fn_ex|injecting fault|resumed from|summary|timeline|RankShould|SOFT_TIMEOUT|HARD_TIMEOUT|rror" \
  /tmp/gp/*.log | grep -av "frame #" | tail -n 200 > "$OUT/goodput-log.txt"
exit $rc
