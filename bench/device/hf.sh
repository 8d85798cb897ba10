#!/usr/bin/env bash
# A Hugging Face Llama of the `1b` shape (bench/models/llama-1b: 16 x 2048, 16 heads, SwiGLU 5440,
# 32k vocabulary; 934M parameters against the GPT's 941M) against the built-in GPT on ONE GPU,
# one rank, warm workers on, on a lent GPU machine (wheels carried in .whl/; see setup.sh):
#
#   PART=steps,recovery bash bench/device/hf.sh    # step time of both models, then recovery
#   PART=goodput bash bench/device/hf.sh           # 2,000 steps, five faults, the HF model
#
# steps: bench/trainer_gpu.py, no checkpoints, STEPS (default 60) steps at batch 8, the median
#   step time after step 20, GPT first, then the HF model.
# recovery: bench.recovery, an exception (in-process restart) and a SIGKILL (ft_launcher restart,
#   warm workers) at step 45 of 50, a checkpoint every 20, node-local copies in /dev/shm; the HF
#   model, then the GPT's SIGKILL for a side-by-side figure from the same machine (GPT=0: skip).
# goodput: bench.goodput's faulted-inprocess variant as in docs/benchmarks.md's one-H200 rows
#   (batch 4, a checkpoint every 100 steps, keep 2), with model.hf_path (MODEL=gpt: the GPT).
# snapcost: bench/trainer_gpu.py, the HF model at batch 4 (the goodput runs' batch), STEPS
#   (default 200) steps with no checkpoint, then the same with node-local snapshots every
#   SNAPSHOTS (default 10) steps and no saves: the mean step time of both, plus the snapshots'
#   stall (attempt_snapshots), is their cost.
# ratio: bench.goodput's faulted-inprocess and baseline variants in one invocation, the HF model,
#   RATIO_STEPS (default 1000) steps, four faults (exception, SIGKILL, exception, SIGKILL; no
#   hang: with one rank the baseline never recovers from one), a checkpoint every 100 steps;
#   RATIO_FAULTS replaces the fault schedule (for a shorter RATIO_STEPS); RUN_TIMEOUT (default 330)
#   is each variant's limit: the baseline's restarts take ~30 s each, so it needs about twice ours;
#   VARIANTS=baseline runs one of the two (when both do not fit one call: then not "the same run").
# SNAPSHOTS=N (recovery, goodput, ratio): node-local snapshots every N steps between saves
#   (checkpoint.local_interval_steps; the summary's attempt_snapshots has their count and stall).
# Writes JSON and log excerpts under $OUT (goodput: also the run's losses.jsonl and commits.jsonl,
# gzipped).
set -u
. bench/device/setup.sh || exit 1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export RTJ_NPROC_PER_NODE=1 RTJ_WARM_WORKERS=1
# the node-local copies (GBs of RAM in /dev/shm) and run folders go with the call: two calls that
# followed a goodput run on the same machine (2026-12-05) came back with nothing
trap 'rm -rf /dev/shm/rtj-local /tmp/gp /tmp/rb /tmp/st' EXIT
HF=$PWD/bench/models/llama-1b
SHAPE=(--set model.num_layers=16 --set model.d_model=2048 --set model.num_heads=16
       --set model.vocab_size=32000 --set model.seq_len=2048)
HFSET=(--set "model.hf_path=$HF")
# BOUNCE_MIB=N: checkpoint.snapshot_bounce_mib (the snapshot thread's two page-locked buffers)
[[ -n ${BOUNCE_MIB:-} ]] && HFSET+=(--set "checkpoint.snapshot_bounce_mib=$BOUNCE_MIB")
# SAVE_DEVICE_COPY=false: saves staged in the step loop (checkpoint.save_device_copy)
[[ -n ${SAVE_DEVICE_COPY:-} ]] && HFSET+=(--set "checkpoint.save_device_copy=$SAVE_DEVICE_COPY")
# DIRECT_IO=true|false: shards written with O_DIRECT or not (checkpoint.direct_io; default: on CUDA)
[[ -n ${DIRECT_IO:-} ]] && HFSET+=(--set "checkpoint.direct_io=$DIRECT_IO")
# KEEPER=0: no device keepers; 1 (the default since 2026-12-06, as `faultTolerance.deviceKeepers:
# Auto` on GPU pods): they hold the snapshots' buffer (RTJ_DEVICE_KEEPER, rtj_trainer.keeper)
export RTJ_DEVICE_KEEPER=${KEEPER:-1}
SNAP=(); [[ ${SNAPSHOTS:-0} != 0 ]] && SNAP=(--set "checkpoint.local_interval_steps=$SNAPSHOTS")
rc=0
excerpt() {  # the launcher/trainer lines of each run's log, small enough to bring back
  for f in "$1"/*.log; do
    [[ -e $f ]] || continue
    grep -aE "Cycle:|fn_ex|injecting fault|resumed from|summary|timeline|RankShould|SOFT_TIMEOUT|HARD_TIMEOUT|rror|Traceback|ms/step|rtj-warm\]" "$f" \
      | grep -avE "frame #|waitForInput" | tail -n 150
  done > "$2"
}
if [[ ,${PART:-steps,recovery}, == *,steps,* ]]; then
  for model in ${MODELS:-gpt hf}; do
    rm -rf /tmp/st
    extra=(); [[ $model == hf ]] && extra=("${HFSET[@]}")
    python3 bench/trainer_gpu.py --preset 1b --runs no_checkpoint --steps "${STEPS:-60}" \
      --staging-gib 0 --timeout 240 "${extra[@]}" --root /tmp/st --out "$OUT/steptime-$model.json" \
      > /dev/null || rc=1
    python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['runs'][0]; print('[hf.sh] step time', sys.argv[2], r.get('step_ms_median'), 'ms; rc', r['rc'], r.get('stderr_tail', '')[-1500:])" \
      "$OUT/steptime-$model.json" "$model"
  done
fi
if [[ ,${PART:-steps,recovery}, == *,recovery,* ]]; then
  runs=(hf); [[ ${GPT:-1} == 1 ]] && runs+=(gpt)
  for model in "${runs[@]}"; do
    rm -rf /tmp/rb /dev/shm/rtj-local
    extra=(); scenarios=sigkill
    [[ $model == hf ]] && extra=("${HFSET[@]}") && scenarios=exception-inprocess,sigkill
    python3 -m bench.recovery --repeats "${REPEATS:-1}" --scenarios "$scenarios" --fault-rank 0 \
      --steps 50 --fault-step 45 --checkpoint-interval 20 "${SHAPE[@]}" --set data.batch_size=8 \
      "${extra[@]}" "${SNAP[@]}" --set checkpoint.local_dir=/dev/shm/rtj-local \
      --set checkpoint.keep=2 --run-timeout 150 --work-dir /tmp/rb --out "$OUT/recovery-$model.json" || rc=1
    excerpt /tmp/rb "$OUT/recovery-$model-log.txt"
  done
fi
if [[ ,${PART:-}, == *,snapcost,* ]]; then
  rm -rf /tmp/st /dev/shm/rtj-snap
  # a fresh machine compiles the Triton kernels in its first run: not in either measured run
  python3 bench/trainer_gpu.py --preset 1b --runs no_checkpoint --steps 5 --staging-gib 0 \
    --timeout 120 "${HFSET[@]}" --root /tmp/st > /dev/null 2>&1
  timeout "${SNAPCOST_TIMEOUT:-300}" python3 bench/trainer_gpu.py --preset 1b --runs no_checkpoint,snapshots --steps "${STEPS:-200}" \
    --snapshot-every "${SNAPSHOTS:-10}" --staging-gib 0 --timeout 240 "${HFSET[@]}" \
    --set data.batch_size=4 --root /tmp/st --out "$OUT/snapcost.json" > /dev/null || rc=1
  python3 -c "import json,sys
for r in json.load(open(sys.argv[1]))['runs']:
    print('[hf.sh] snapcost', r['run'], 'rc', r['rc'], 'mean step ms', r.get('step_ms_mean'), 'loop ms/step', r.get('loop_ms_per_step'), 'median step ms', r.get('step_ms_median'), (r.get('summary') or {}).get('attempt_snapshots'), r.get('stderr_tail', '')[-1500:])" "$OUT/snapcost.json"
fi
if [[ ,${PART:-}, == *,ratio,* ]]; then
  rm -rf /tmp/gp /dev/shm/rtj-local
  timeout "${GOODPUT_TIMEOUT:-560}" python3 -m bench.goodput --variants "${VARIANTS:-faulted-inprocess,baseline}" \
    --steps "${RATIO_STEPS:-1000}" --faults "${RATIO_FAULTS:-250:0:exception,450:0:sigkill,650:0:exception,850:0:sigkill}" \
    --checkpoint-interval 100 --heartbeat-timeout 10 "${SHAPE[@]}" --set data.batch_size=4 \
    "${HFSET[@]}" "${SNAP[@]}" --set checkpoint.local_dir=/dev/shm/rtj-local \
    --set checkpoint.keep=2 --run-timeout "${RUN_TIMEOUT:-330}" --work-dir /tmp/gp --out "$OUT/ratio.json" || rc=1
  excerpt /tmp/gp "$OUT/ratio-log.txt"
fi
if [[ ,${PART:-}, == *,goodput,* ]]; then
  rm -rf /tmp/gp /dev/shm/rtj-local
  extra=("${HFSET[@]}"); [[ ${MODEL:-hf} == gpt ]] && extra=()
  timeout "${GOODPUT_TIMEOUT:-530}" python3 -m bench.goodput --variants faulted-inprocess \
    --steps 2000 --faults 330:0:exception,740:0:sigkill,1130:0:hang,1560:0:exception,1870:0:sigkill \
    --checkpoint-interval 100 --heartbeat-timeout 10 "${SHAPE[@]}" --set data.batch_size=4 \
    "${extra[@]}" "${SNAP[@]}" --set checkpoint.local_dir=/dev/shm/rtj-local \
    --set checkpoint.keep=2 --run-timeout 460 --work-dir /tmp/gp --out "$OUT/goodput-${MODEL:-hf}.json" || rc=1
  excerpt /tmp/gp "$OUT/goodput-${MODEL:-hf}-log.txt"
  # every step's end (losses.jsonl) and every commit's writer figures (commits.jsonl), small
  # enough to bring back: where the seconds between the steps went
  for name in losses commits; do
    found=$(find /tmp/gp -name "$name.jsonl" -print -quit)
    [[ -n $found ]] && gzip -c "$found" > "$OUT/goodput-${MODEL:-hf}-$name.jsonl.gz"
  done
fi
exit $rc
