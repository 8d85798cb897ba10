"""GPU smoke and checkpoint benchmark of the trainer on one GPU (run on a lent GPU machine).

Runs `python -m rtj_trainer` (one rank, FSDP2 over a 1-GPU mesh, bf16) on the same config and
compares:

1. no checkpoints (the baseline step time; `--baseline-steps`);
2. NVRx async checkpoints every `--interval` steps (stall = the step loop blocked);
3. synchronous checkpoints at the same interval;
4. a resume of run 2 (a new process loads the newest committed checkpoint and trains on);
5. optionally async checkpoints at a second, shorter interval (`--second-interval`);
6. optionally node-local snapshots every `--snapshot-every` steps and no saves (`snapshots`: its
   mean step time against run 1's, plus its snapshots' stall, is what they cost; its
   `loop_ms_per_step` also holds the staging buffer's one-time allocation after the first step).

Training efficiency of a run = step seconds / (step seconds + checkpoint stall) inside the step
loop. Per save it reports the stall (and, from `commits.jsonl`, how much of it was waiting for the
previous write vs staging the copy), the writer's seconds (write to the page cache + fsync) and
GB/s. Also measures the raw device-to-host staging copy (page-locked shared buffer vs pageable
memory). Prints one JSON object per run and a final JSON line with everything; `--out` is
rewritten after every run, so a run cut short still leaves what was measured.

    python bench/trainer_gpu.py --preset 1b --steps 300 --interval 100 --out $OUT/gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def run_trainer(
    name: str, preset: str, ckpt_dir: Path, sets: list[str], port: int, timeout: float
) -> dict[str, Any]:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), PYTHONUNBUFFERED="1", RTJ_CHECKPOINT_DIR=str(ckpt_dir))
    cmd = [sys.executable, "-m", "rtj_trainer", "--preset", preset,
           *[a for s in sets for a in ("--set", s)]]
    keeper = None
    if os.environ.get("RTJ_DEVICE_KEEPER") == "1":  # as the launcher shim starts one a rank
        env["RTJ_DEVICE_KEEPER_DIR"] = keeper_dir = str(ckpt_dir) + "-keeper"
        os.makedirs(keeper_dir, exist_ok=True)
        keeper = subprocess.Popen([sys.executable, "-m", "rtj_trainer.keeper",
                                   f"--directory={keeper_dir}", "--local-rank=0"])
        deadline = time.time() + 60
        while not os.path.exists(os.path.join(keeper_dir, "keeper-0.sock")):
            if time.time() > deadline or keeper.poll() is not None:
                break
            time.sleep(0.1)
    began = time.time()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    finally:
        if keeper is not None:
            keeper.kill()
            keeper.wait()
    wall = time.time() - began
    lines = proc.stdout.strip().splitlines()
    result: dict[str, Any] = {"run": name, "rc": proc.returncode, "process_wall_seconds": wall,
                              "command": " ".join(cmd)}
    if proc.returncode != 0 or not lines:
        result["stderr_tail"] = proc.stderr[-3000:]
        result["stdout_tail"] = proc.stdout[-2000:]
        return result
    summary = json.loads(lines[-1])
    result.update(summary=summary)
    resumed = [ln for ln in lines if "resumed from" in ln]
    result["resumed"] = resumed[0] if resumed else None
    stalls = [float(m) for m in re.findall(r"stall ([0-9.]+) s", proc.stdout)]
    result["stalls"] = stalls
    result["saves"] = read_commits(ckpt_dir, began)
    step_seconds = float(summary.get("productive_seconds", 0.0))
    if summary.get("attempt_steps") != summary.get("steps"):  # a resume: restored seconds too
        step_seconds = float(summary["attempt_loop_seconds"]) - sum(stalls)
    stall_total = float(summary.get("attempt_checkpoint_stall_seconds_total", 0.0))
    result["step_seconds"] = round(step_seconds, 3)
    if summary.get("attempt_steps"):
        steps = int(summary["attempt_steps"])
        # The whole loop a step: stalls and slowdowns too, but also one-time costs outside the
        # steps (a run with checkpoints allocates and page-locks its staging buffer after the
        # first step: seconds for GBs, which a run without checkpoints never pays).
        result["loop_ms_per_step"] = round(1000 * float(summary["attempt_loop_seconds"]) / steps,
                                           2)
        if summary.get("attempt_steps") == summary.get("steps"):  # the steps alone
            result["step_ms_mean"] = round(1000 * step_seconds / steps, 2)
    result["training_efficiency"] = round(step_seconds / max(1e-9, step_seconds + stall_total), 4)
    result["log_tail"] = lines[-6:]
    result.update(step_time(proc.stdout + proc.stderr))
    return result


STEP_LINE = re.compile(r"step (\d+)/\d+ loss \S+ ([0-9.]+) ms/step")


def step_time(log: str, *, skip: int = 20) -> dict[str, Any]:
    """The steady step time from the trainer's progress lines (`step N/M loss L T ms/step`, one
    every `train.log_every` steps; T is that step's time): the median of the steps after the
    first `skip` (warm-up: allocator, autotuning), and every sample."""
    samples = [(int(m.group(1)), float(m.group(2))) for m in STEP_LINE.finditer(log)]
    steady = sorted(ms for step, ms in samples if step > skip)
    median = steady[len(steady) // 2] if steady else None
    if steady and len(steady) % 2 == 0:
        median = (steady[len(steady) // 2 - 1] + steady[len(steady) // 2]) / 2
    return {"step_ms_samples": samples, "step_ms_median": median}


def read_commits(ckpt_dir: Path, since: float) -> list[dict[str, Any]]:
    """One entry per checkpoint this run committed: stall parts, writer seconds and GB/s."""
    from rtj_trainer.checkpoint.store import read_commit_log

    saves: list[dict[str, Any]] = []
    for commit in read_commit_log(ckpt_dir):
        if commit.get("committed_at", 0) < since:
            continue
        writer = commit.get("slowest_writer") or {}
        seconds = float(writer.get("seconds", 0.0))
        shard_bytes = int(commit.get("shard_bytes_max", commit.get("bytes", 0)))
        saves.append({
            "step": commit["step"],
            "shard_GB": round(shard_bytes / 1e9, 3),
            "stall": commit.get("rank0_stall"),
            "writer_seconds": seconds,
            "writer_write_seconds": writer.get("write_seconds"),
            "writer_fsync_seconds": writer.get("fsync_seconds"),
            "writer_threads": writer.get("threads"),
            "write_GBps": round(shard_bytes / seconds / 1e9, 3) if seconds else None,
            "save_to_commit_seconds": commit.get("save_to_commit_seconds"),
        })
    return saves


def staging_copy_benchmark(gib: float) -> dict[str, Any]:
    import torch

    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {"bytes": n}
    shared = torch.empty(n, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
    rc = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
        shared.data_ptr(), n, 0)
    out["cudaHostRegister_rc"] = int(rc)
    pageable = torch.empty(n, dtype=torch.uint8)
    pageable.fill_(1)
    for label, dst in (("registered_shared", shared), ("pageable", pageable)):
        best = 1e9
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out[label] = {"seconds": round(best, 4), "GBps": round(n / best / 1e9, 2)}
    if int(rc) == 0:
        torch.cuda.cudart().cudaHostUnregister(  # type: ignore[no-untyped-call]
            shared.data_ptr())
    return out


def staging_allocation_benchmark(nbytes: int, repeats: int = 2) -> dict[str, Any]:
    """What `Checkpointer.prepare` costs once per process: allocate the shared staging buffer
    and page-lock it (on CUDA), in a thread as the trainer does, while this thread stands in for
    the step loop and records its longest wait (`main_max_gap_seconds`: how long the GIL was
    held by the allocation). The trainer's way (rtj_trainer.checkpoint.hostmem: a memfd,
    populated with MADV_POPULATE_WRITE from threads) against torch's
    `torch.empty(n).share_memory_()` (what the trainer used before) and `_new_shared`."""
    import threading

    import torch
    from rtj_trainer.checkpoint import hostmem

    def torch_share() -> torch.Tensor:
        buffer: torch.Tensor = torch.empty(nbytes, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
        return buffer

    def torch_new_shared() -> torch.Tensor:
        storage = torch.UntypedStorage._new_shared(nbytes)  # type: ignore[no-untyped-call]
        return torch.empty(0, dtype=torch.uint8).set_(storage)

    cuda = torch.cuda.is_available()
    cudart = torch.cuda.cudart() if cuda else None  # type: ignore[no-untyped-call]
    out: dict[str, Any] = {"bytes": nbytes, "populate_threads": hostmem.populate_threads()}
    makers: list[tuple[str, Callable[[], torch.Tensor]]] = [
        ("hostmem", lambda: hostmem.shared_buffer(nbytes)), ("share_memory_", torch_share),
        ("new_shared", torch_new_shared)]
    for attempt in range(repeats):
        for label, make in makers:
            times: dict[str, Any] = {}

            def work(make: Callable[[], torch.Tensor] = make,
                     times: dict[str, Any] = times) -> None:
                t0 = time.perf_counter()
                buffer = make()
                t1 = time.perf_counter()
                rc = int(cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)) if cudart else -1
                t2 = time.perf_counter()
                if rc == 0:
                    cudart.cudaHostUnregister(buffer.data_ptr())
                times.update(allocate_seconds=round(t1 - t0, 3),
                             register_seconds=round(t2 - t1, 3), register_rc=rc,
                             t1=t1, t2=t2, buffer=buffer)  # freed after the measurement

            worker = threading.Thread(target=work)
            gaps: list[tuple[float, float]] = []
            last = time.perf_counter()
            worker.start()
            while worker.is_alive():
                time.sleep(0.001)
                now = time.perf_counter()
                gaps.append((now - last, now))
                last = now
            worker.join()
            t1, t2 = times.pop("t1", 0.0), times.pop("t2", 0.0)
            del times["buffer"]  # unmapping GBs holds the GIL too, but not in the trainer's loop
            times["main_max_gap_seconds"] = round(max((g for g, _ in gaps), default=0.0), 4)
            times["main_max_gap_in_register_seconds"] = round(
                max((g for g, at in gaps if t1 < at <= t2 + 0.001), default=0.0), 4)
            out[f"{label}_{attempt}"] = times
            print(json.dumps({"allocation": {label: times}}), flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--interval", type=int, default=100)
    parser.add_argument("--baseline-steps", type=int, default=None,
                        help="steps of the no-checkpoint run (default: --steps)")
    parser.add_argument("--second-interval", type=int, default=0,
                        help="also run async at this interval (0: skip)")
    parser.add_argument("--second-steps", type=int, default=120)
    parser.add_argument("--budget", type=float, default=1e9,
                        help="seconds; start no further trainer run once this much has passed")
    parser.add_argument("--resume-extra-steps", type=int, default=10)
    parser.add_argument("--root", default="/tmp/rtj-gpu-bench")
    parser.add_argument("--out", default=None)
    parser.add_argument("--staging-gib", type=float, default=4.0)
    parser.add_argument("--timeout", type=float, default=200)
    parser.add_argument("--device", default="cuda", help="cpu: a local dry run of this script")
    parser.add_argument("--runs", default="no_checkpoint,async,sync,resume_async,second",
                        help="comma-separated subset of the trainer runs to make")
    parser.add_argument("--set", action="append", default=[], dest="sets", metavar="KEY=VALUE",
                        help="a trainer override for every run (repeatable), e.g. "
                             "model.hf_path=bench/models/llama-1b")
    parser.add_argument("--snapshot-every", type=int, default=0,
                        help="also the run `snapshots`: no saves, node-local snapshots every N "
                             "steps (its step time against no_checkpoint's is their cost)")
    parser.add_argument("--snapshot-dir", default="/dev/shm/rtj-snap")
    parser.add_argument("--allocation-gb", type=float, default=0.0,
                        help="also time allocating + page-locking a staging buffer of this size")
    args = parser.parse_args()
    started = time.time()
    root = Path(args.root)
    common = [f"train.steps={args.steps}", f"train.device={args.device}", "train.log_every=10",
              "checkpoint.verify_checksums=true", *args.sets]
    results: dict[str, Any] = {"preset": args.preset, "steps": args.steps,
                               "interval": args.interval, "sets": args.sets}
    try:
        if args.device != "cuda":
            raise RuntimeError("staging benchmark needs CUDA")
        if args.staging_gib <= 0:
            raise RuntimeError("skipped (--staging-gib 0)")
        results["staging"] = staging_copy_benchmark(args.staging_gib)
    except Exception as exc:  # a failed micro-benchmark must not stop the trainer runs
        results["staging"] = {"error": repr(exc)}
    print(json.dumps({"staging": results["staging"]}), flush=True)
    if args.allocation_gb:
        try:
            results["allocation"] = staging_allocation_benchmark(int(args.allocation_gb * 1e9))
        except Exception as exc:
            results["allocation"] = {"error": repr(exc)}
        print(json.dumps({"allocation": results["allocation"]}), flush=True)
    every = [f"checkpoint.interval_steps={args.interval}"]
    plans: list[tuple[str, str, list[str], bool]] = [  # name, folder, --set values, keep folder
        ("no_checkpoint", "none", [f"train.steps={args.baseline_steps or args.steps}",
                                   "checkpoint.interval_steps=0", "checkpoint.save_final=false"],
         False),
        ("async", "async", [*every, "checkpoint.mode=async"], True),
        ("sync", "sync", [*every, "checkpoint.mode=sync"], False),
        ("resume_async", "async", [f"train.steps={args.steps + args.resume_extra_steps}",
                                   *every, "checkpoint.mode=async"], False),
    ]
    if args.snapshot_every:  # the step-time cost of node-local snapshots (issue #32)
        plans.append(("snapshots", "snap", [
            f"train.steps={args.baseline_steps or args.steps}",
            f"checkpoint.interval_steps={10 * (args.baseline_steps or args.steps)}",
            "checkpoint.save_final=false", f"checkpoint.local_dir={args.snapshot_dir}",
            f"checkpoint.local_interval_steps={args.snapshot_every}"], False))
    if args.second_interval:
        plans.append((f"async_every_{args.second_interval}", "async2",
                      [f"train.steps={args.second_steps}",
                       f"checkpoint.interval_steps={args.second_interval}",
                       "checkpoint.mode=async"], False))
    runs: list[dict[str, Any]] = []
    results["runs"] = runs
    wanted = set(args.runs.split(","))
    for i, (name, folder, sets, keep) in enumerate(plans):
        if name not in wanted and not (name.startswith("async_every") and "second" in wanted):
            continue
        if time.time() - started > args.budget:
            runs.append({"run": name, "skipped": "--budget spent"})
            continue
        ckpt = root / folder
        r = run_trainer(name, args.preset, ckpt, [*common, *sets], 29500 + 10 * i, args.timeout)
        runs.append(r)
        print(json.dumps(r), flush=True)
        if not keep:  # keep the disk free: only the async run is resumed
            shutil.rmtree(ckpt, ignore_errors=True)
            shutil.rmtree(args.snapshot_dir, ignore_errors=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
    if args.out:  # also when no trainer run was made (`--runs none --allocation-gb N`)
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
