"""What a new worker process pays on a GPU before its first step is as fast as the next ones:
each piece timed the first time a fresh process does it, then again in the same process.

    python3 bench/device/firststep.py --out $OUT/firststep.json

Pieces, in order, each in a fresh child process (`--repeats` of them):
- `context`: `torch.cuda.set_device` and a first tensor (the CUDA context);
- `matmul_bf16`, `matmul_fp32`: a linear layer forward and backward (cuBLAS/cuBLASLt handles,
  their workspaces, the kernels' modules);
- `triton`: rotary and SwiGLU forward and backward through rtj_trainer.kernels at a small shape
  (Triton's driver and the kernels' binaries, from Triton's disk cache after the first run),
  then `triton_real_shape` at the 1b shape (batch 4, seq 2048, 16 heads of 128; SwiGLU 5440);
- `process_group`: a one-rank NCCL process group with `device_id` (communicator at once), then
  `all_reduce`;
- `allocate_4gib`: 4 GiB from the caching allocator, freed (cudaMalloc of new segments).

Then `warm.device.warm_up` (rtj_trainer.warm.device) in another fresh process, followed by the
same pieces: what a warm worker that did it before attach leaves for the worker to pay.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time
t = time.perf_counter()
import torch
import torch.distributed as dist
from rtj_trainer import kernels
out = {"import": time.perf_counter() - t}
warm = sys.argv[1] == "warm"
if warm:
    from rtj_trainer.warm import device as warm_device
    t = time.perf_counter()
    out["warm_up_report"] = warm_device.warm_up(0)
    out["warm_up"] = time.perf_counter() - t

def timed(name, fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    out.setdefault(name, []).append(round(time.perf_counter() - t, 4))

def context():
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")

def matmul(dtype):
    def go():
        layer = torch.nn.Linear(2048, 5440, device="cuda", dtype=dtype)
        x = torch.randn(8192, 2048, device="cuda", dtype=dtype, requires_grad=True)
        layer(x).float().sum().backward()
    return go

def triton(batch, seq, heads, dim, inner):
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    def go():
        x = torch.randn(batch, seq, heads, dim, **bf16, requires_grad=True)
        cos = torch.randn(batch, seq, 1, dim, **bf16)
        sin = torch.randn(batch, seq, 1, dim, **bf16)
        kernels.rotary(x, cos, sin).float().sum().backward()
        gate = torch.randn(batch * seq, inner, **bf16, requires_grad=True)
        up = torch.randn(batch * seq, inner, **bf16, requires_grad=True)
        kernels.swiglu(gate, up).float().sum().backward()
    return go

def process_group():
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(29400 + os.getpid() % 1000))
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))

def all_reduce():
    dist.all_reduce(torch.ones(1024, device="cuda"))

def allocate():
    block = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    del block

for round_ in range(2):
    if round_ == 0:
        timed("context", context)
    timed("matmul_bf16", matmul(torch.bfloat16))
    timed("matmul_fp32", matmul(torch.float32))
    timed("triton", triton(1, 64, 2, 64, 128))
    timed("triton_real_shape", triton(4, 2048, 16, 128, 5440))
    if round_ == 0:
        timed("process_group", process_group)
    timed("all_reduce", all_reduce)
    timed("allocate_4gib", allocate)
dist.destroy_process_group()
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"cold": [], "warm": []}
    for mode in ("cold", "warm"):
        for _ in range(args.repeats):
            t = time.perf_counter()
            done = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True,
                                  text=True, timeout=300, env=dict(os.environ))
            if done.returncode != 0:
                results[mode].append({"rc": done.returncode, "stderr": done.stderr[-3000:]})
                continue
            figures = json.loads(done.stdout.strip().splitlines()[-1])
            figures["process_seconds"] = round(time.perf_counter() - t, 3)
            results[mode].append(figures)
            print(f"[firststep] {mode}: {json.dumps(figures)}", flush=True)
    with open(args.out, "w", encoding="utf-8") as handle:
        json.dump({"benchmark": "firststep", "command": " ".join(sys.argv),
                   "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
