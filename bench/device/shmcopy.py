"""How fast GBs go from GPU memory into a /dev/shm file, by the ways a snapshot could take.

The snapshot thread (rtj_trainer.checkpoint.snapshots) copies a rank's state from a device
buffer through two page-locked bounce buffers into the file's memory map, at about 3 GB/s on the
goodput runs (11.3 GB in ~3.5 s). This measures, with no training beside it, which part costs:

- `mmap-fresh`: bounce -> the memory map of a new file (every page allocated and faulted in);
- `mmap-reused`: the same into a file whose pages exist (the snapshot's spare file);
- `mmap-populated`: a reused file mapped with MAP_POPULATE (page tables filled up front);
- `pwrite-fresh` / `pwrite-reused`: bounce -> os.pwrite, no mapping at all.

each with bounce buffers of 64 and 256 MiB. Run on a device machine from the repository root:

    python3 bench/device/shmcopy.py --gib 4 --out $OUT/shmcopy.json
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch


def _through_bounce(source: torch.Tensor, bounces: list[torch.Tensor], stream: torch.cuda.Stream,
                    land: Callable[[torch.Tensor, int, int], None]) -> None:
    inflight: list[tuple[torch.Tensor, int, int, torch.cuda.Event]] = []
    chunk = bounces[0].numel()
    for index, start in enumerate(range(0, source.numel(), chunk)):
        if len(inflight) == len(bounces):
            bounce, s, e, done = inflight.pop(0)
            done.synchronize()
            land(bounce, s, e)
        end = min(source.numel(), start + chunk)
        bounce = bounces[index % len(bounces)]
        with torch.cuda.stream(stream):
            bounce[: end - start].copy_(source[start:end], non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
        inflight.append((bounce, start, end, done))
    while inflight:
        bounce, s, e, done = inflight.pop(0)
        done.synchronize()
        land(bounce, s, e)


def _fill(mapped: mmap.mmap, source: torch.Tensor, bounces: list[torch.Tensor],
          stream: torch.cuda.Stream) -> None:
    target = torch.frombuffer(mapped, dtype=torch.uint8, count=source.numel())

    def land(bounce: torch.Tensor, start: int, end: int) -> None:
        target[start:end].copy_(bounce[: end - start])

    _through_bounce(source, bounces, stream, land)


def _mmap_copy(path: Path, source: torch.Tensor, bounces: list[torch.Tensor],
               stream: torch.cuda.Stream, *, populate: bool) -> float:
    total = source.numel()
    began = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, total)
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        with mmap.mmap(fd, total, flags=flags) as mapped:
            _fill(mapped, source, bounces, stream)
    finally:
        os.close(fd)
    return time.perf_counter() - began


def _pwrite_copy(path: Path, source: torch.Tensor, bounces: list[torch.Tensor],
                 stream: torch.cuda.Stream) -> float:
    began = time.perf_counter()
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        def land(bounce: torch.Tensor, start: int, end: int) -> None:
            view = memoryview(bounce.numpy())[: end - start]
            done = 0
            while done < end - start:
                done += os.pwrite(fd, view[done:], start + done)

        _through_bounce(source, bounces, stream, land)
    finally:
        os.close(fd)
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--dir", default="/dev/shm/rtj-shmcopy")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    nbytes = int(args.gib * 2**30)
    source = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    results = []
    for mib in (64, 256):
        bounces = [torch.empty(mib * 2**20, dtype=torch.uint8).pin_memory() for _ in range(2)]
        path = folder / f"copy-{mib}.bin"
        path.unlink(missing_ok=True)
        for name, populate in (("mmap-fresh", False), ("mmap-reused", False),
                               ("mmap-populated", True)):
            seconds = _mmap_copy(path, source, bounces, stream, populate=populate)
            results.append({"way": name, "bounce_mib": mib, "seconds": round(seconds, 3),
                            "gb_per_s": round(nbytes / seconds / 1e9, 2)})
        path.unlink()
        for name in ("pwrite-fresh", "pwrite-reused"):
            seconds = _pwrite_copy(path, source, bounces, stream)
            results.append({"way": name, "bounce_mib": mib, "seconds": round(seconds, 3),
                            "gb_per_s": round(nbytes / seconds / 1e9, 2)})
        path.unlink()
        del bounces
    for row in results:
        print("[shmcopy]", json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps({"bytes": nbytes, "torch_threads": torch.get_num_threads(),
                                          "results": results}, indent=1))


if __name__ == "__main__":
    main()
