#!/usr/bin/env bash
# Recovery of the `1b` shape on the GPUs of one host (2 ranks, one per GPU) after one injected
# fault, on a lent GPU machine (wheels carried in .whl/; see bench/device/setup.sh):
#
#   SCENARIOS=exception-inprocess,sigkill bash bench/device/recovery.sh
#
# The fault comes 50 steps after the first checkpoint: a 1b shard (about 7.5 GB a rank) takes
# 5-8 s to commit, so the restart has a committed checkpoint to load.
#
# LOCAL_DIR (default /dev/shm/rtj-local; empty: off) keeps node-local copies of the saves
# (checkpoint.local_dir).
#
# Writes $OUT/recovery.json (bench.recovery's JSON) and, per run, the launcher/trainer/NVRx lines
# of its log ($OUT/<scenario>-<n>.txt) so a fallback can be explained without the GB-sized run
# directories.
set -u
. bench/device/setup.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# A warm machine keeps the last call's run directories: GBs of shards each, enough to fill its
# disk (seen: a goodput run after a recovery run found no space for any commit).
rm -rf /tmp/rb /dev/shm/rtj-local
LOCAL_DIR=${LOCAL_DIR-/dev/shm/rtj-local}
LOCAL_SET=(); [[ -n $LOCAL_DIR ]] && LOCAL_SET=(--set "checkpoint.local_dir=$LOCAL_DIR")
SHAPE=(--set model.num_layers=16 --set model.d_model=2048 --set model.num_heads=16
       --set model.vocab_size=32000 --set model.seq_len=2048 --set data.batch_size=8)
python3 -m bench.recovery --repeats "${REPEATS:-1}" --set train.dump_stacks_on_sigterm=true \
  --scenarios "${SCENARIOS:-exception-inprocess,sigkill}" --steps "${STEPS:-80}" \
  --fault-step "${FAULT_STEP:-70}" --checkpoint-interval "${INTERVAL:-20}" "${SHAPE[@]}" "${LOCAL_SET[@]}" \
  --run-timeout "${RUN_TIMEOUT:-170}" --work-dir /tmp/rb --out "$OUT/recovery.json"
rc=$?
for f in /tmp/rb/*.log; do
  grep -aE "Cycle:|rtj-trainer|fn_ex|_ex:|rror|Traceback|estart|ealth|Killed|ignal|erminat|imeout|summary|timeline|resumed|RankShould|bort|rank0|workload:0|Thread 0x|File \"|most recent call" "$f" \
    | grep -avE "^[0-9.]+ frame #|waitForInput|NVL link|gpu_ib_map" | tail -n 400 > "$OUT/$(basename "$f" .log).txt"
done
exit $rc
