"""How long a SIGKILLed CUDA process takes to be gone (issue #32's SIGKILL `detect` phase).

ft_launcher notices a dead worker only once the process has exited (its poll sees the exit
status), and the kernel tears down the process's memory and the CUDA driver its context before
that. This kills a child that holds what a 1B rank holds (GPU memory, an 11.3 GB shared staging
buffer, page-locked or not, or written and released from the process's page tables as the
checkpoint writer process now does) and times SIGKILL -> waitpid returns, and -> NVML shows the
GPU memory freed (what ft_launcher's `--ft-gpu-memory-reclaim-timeout` waits for).

    python3 bench/device/killexit.py --out $OUT/killexit.json
    PYTHONPATH=trainer python bench/device/killexit.py --host-only 4 --repeats 3 --out k.json  # CPU
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

CHILD = r"""
import sys, time, torch
gpu_gib, host_gib, register = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3] == "1"
release = sys.argv[4] == "1"
torch.cuda.init()
blocks = [torch.empty(1 << 30, dtype=torch.uint8, device="cuda") for _ in range(int(gpu_gib))]
torch.cuda.synchronize()
if host_gib:
    host = torch.empty(int(host_gib * (1 << 30)), dtype=torch.uint8).share_memory_()
    host.fill_(1)
    if register:
        rc = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
        assert int(rc) == 0, rc
    if release:  # what the checkpoint writer process does with each slice it wrote
        from rtj_trainer.checkpoint.writer import _byte_view, _page_releaser
        _page_releaser()(_byte_view(host))
print("ready", flush=True)
time.sleep(600)
"""


def used_mib() -> float:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits",
                          "-i", "0"], capture_output=True, text=True, check=True).stdout
    return float(out.strip().splitlines()[0])


def one(gpu_gib: float, host_gib: float, register: bool,
        release: bool = False) -> dict[str, float | bool]:
    baseline = used_mib()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(gpu_gib), str(host_gib),
                              "1" if register else "0", "1" if release else "0"],
                             stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "ready"
    held = used_mib()
    killed = time.perf_counter()
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    exited = time.perf_counter()
    while used_mib() > baseline + 512:
        time.sleep(0.02)
    freed = time.perf_counter()
    return {"gpu_gib": gpu_gib, "host_gib": host_gib, "registered": register, "released": release,
            "held_mib": held - baseline, "exit_seconds": round(exited - killed, 3),
            "gpu_freed_seconds": round(freed - killed, 3)}


HOST_CHILD = r"""
import ctypes, mmap, os, sys, time
path, release = sys.argv[1], sys.argv[2] == "1"
fd = os.open(path, os.O_RDWR)
size = os.fstat(fd).st_size
mapped = mmap.mmap(fd, size, mmap.MAP_SHARED)
for offset in range(0, size, mmap.PAGESIZE):
    mapped[offset] = 1
if release:  # what the checkpoint writer process does with each slice it wrote
    view = (ctypes.c_char * size).from_buffer(mapped)
    ctypes.CDLL("libc.so.6").madvise(ctypes.c_void_p(ctypes.addressof(view)),
                                     ctypes.c_size_t(size), 4)  # MADV_DONTNEED
print("ready", flush=True)
time.sleep(600)
"""


def one_host(gib: float, held: bool, release: bool) -> dict[str, float | bool]:
    """A process that mapped (and touched) a shared-memory file of `gib` GiB, SIGKILLed: its
    exit's seconds, with the file held by another process (this one: as a device keeper holds
    the staging buffer) or not (the dying process frees the pages), released or not."""
    path = f"/dev/shm/rtj-killexit-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, int(gib * (1 << 30)))
        child = subprocess.Popen([sys.executable, "-c", HOST_CHILD, path, "1" if release else "0"],
                                 stdout=subprocess.PIPE, text=True)
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        if not held:
            os.close(fd)
            os.unlink(path)
        killed = time.perf_counter()
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
        exited = time.perf_counter()
    finally:
        if held:
            os.close(fd)
            os.unlink(path)
    return {"host_gib": gib, "held_by_another": held, "released": release,
            "exit_seconds": round(exited - killed, 3)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--host-only", type=float, default=0.0, metavar="GIB",
                        help="no GPU: a process that mapped a shared file of GIB GiB, released "
                             "or not, held by another process or not (a machine without CUDA)")
    args = parser.parse_args()
    rows = []
    if args.host_only:
        for held in (False, True):
            for release in (False, True):
                for _ in range(args.repeats):
                    row = one_host(args.host_only, held, release)
                    print("[killexit]", row, flush=True)
                    rows.append(row)
        with open(args.out, "w") as f:
            json.dump({"runs": rows}, f, indent=1)
        return
    cases = ((30, 11.3, True, False), (30, 11.3, False, False), (30, 11.3, False, True),
             (30, 0, False, False))
    for gpu_gib, host_gib, register, release in cases:
        for _ in range(args.repeats):
            row = one(gpu_gib, host_gib, register, release)
            print("[killexit]", row, flush=True)
            rows.append(row)
    with open(args.out, "w") as f:
        json.dump({"runs": rows}, f, indent=1)


if __name__ == "__main__":
    main()
