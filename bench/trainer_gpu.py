"""GPU smoke and checkpoint benchmark of the trainer on one GPU (run through the device tool).

Runs `python -m rtj_trainer` (one rank, FSDP2 over a 1-GPU mesh, bf16) four times on the same
config and compares:

1. no checkpoints (the baseline step time);
2. NVRx async checkpoints every `--interval` steps (stall = the step loop blocked);
3. synchronous checkpoints at the same interval;
4. a resume of run 2 (a new process loads the newest committed checkpoint and trains on).

Training efficiency of a run = productive step seconds / (productive + checkpoint stall) inside
the step loop. Also measures the raw device-to-host staging copy (page-locked shared buffer vs
pageable memory) on the same state size. Prints one JSON object per run and a final JSON line with
everything; `--out` also writes it to a file.

    python bench/trainer_gpu.py --preset 1b --steps 120 --interval 60 --out $OUT/gpu.json
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
from pathlib import Path
from typing import Any


def run_trainer(
    name: str, preset: str, ckpt_dir: Path, sets: list[str], port: int, timeout: float
) -> dict[str, Any]:
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), PYTHONUNBUFFERED="1", RTJ_CHECKPOINT_DIR=str(ckpt_dir))
    cmd = [sys.executable, "-m", "rtj_trainer", "--preset", preset,
           *[a for s in sets for a in ("--set", s)]]
    began = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
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
    result["log_tail"] = lines[-6:]
    return result


def staging_copy_benchmark(gib: float) -> dict[str, Any]:
    import torch

    n = int(gib * (1 << 30))
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {"bytes": n}
    shared = torch.empty(n, dtype=torch.uint8).share_memory_()
    rc = torch.cuda.cudart().cudaHostRegister(shared.data_ptr(), n, 0)
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
        torch.cuda.cudart().cudaHostUnregister(shared.data_ptr())
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="1b")
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--interval", type=int, default=60)
    parser.add_argument("--resume-extra-steps", type=int, default=10)
    parser.add_argument("--root", default="/tmp/rtj-gpu-bench")
    parser.add_argument("--out", default=None)
    parser.add_argument("--staging-gib", type=float, default=4.0)
    parser.add_argument("--timeout", type=float, default=200)
    parser.add_argument("--device", default="cuda", help="cpu: a local dry run of this script")
    args = parser.parse_args()
    root = Path(args.root)
    common = [f"train.steps={args.steps}", f"train.device={args.device}", "train.log_every=20",
              "checkpoint.verify_checksums=true"]
    results: dict[str, Any] = {"preset": args.preset, "steps": args.steps,
                               "interval": args.interval}
    try:
        if args.device != "cuda":
            raise RuntimeError("staging benchmark needs CUDA")
        results["staging"] = staging_copy_benchmark(args.staging_gib)
    except Exception as exc:  # a failed micro-benchmark must not stop the trainer runs
        results["staging"] = {"error": repr(exc)}
    print(json.dumps({"staging": results["staging"]}), flush=True)
    plans = [
        ("no_checkpoint", "none", ["checkpoint.interval_steps=0", "checkpoint.save_final=false"]),
        ("async", "async", [f"checkpoint.interval_steps={args.interval}", "checkpoint.mode=async"]),
        ("sync", "sync", [f"checkpoint.interval_steps={args.interval}", "checkpoint.mode=sync"]),
    ]
    runs = []
    for i, (name, folder, sets) in enumerate(plans):
        ckpt = root / folder
        r = run_trainer(name, args.preset, ckpt, [*common, *sets], 29500 + i, args.timeout)
        runs.append(r)
        print(json.dumps(r), flush=True)
        if folder != "async":  # keep the disk free: only the async run is resumed
            shutil.rmtree(ckpt, ignore_errors=True)
    resume = run_trainer(
        "resume_async", args.preset, root / "async",
        [*common, f"train.steps={args.steps + args.resume_extra_steps}",
         f"checkpoint.interval_steps={args.interval}", "checkpoint.mode=async"],
        29510, args.timeout)
    runs.append(resume)
    print(json.dumps(resume), flush=True)
    results["runs"] = runs
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    print(json.dumps(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
