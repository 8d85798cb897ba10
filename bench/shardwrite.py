"""How fast the checkpoint writer puts one shard on a disk, through the page cache or with
O_DIRECT (`checkpoint.direct_io`): `write_shard` exactly as a save calls it (8 threads, 256 MiB
chunks, sha256, one fsync), a staged-like page-aligned shared buffer of GIB GiB, a new file each
time (a save's file is new), the two ways in turn, REPEATS pairs, for each writer thread count in
THREADS (default the writer's 8).

    python bench/shardwrite.py --gib 4 --repeats 3 --threads 8,16 --dir /tmp/shardwrite \
        --out $OUT/shardwrite.json

Prints one JSON line per write and the medians; the same on a GPU machine through the device
tool, where the final save's wait is the disk (docs/benchmarks.md, issue #32).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch
from rtj_trainer.checkpoint import write_shard
from rtj_trainer.checkpoint.format import WRITE_THREADS
from rtj_trainer.checkpoint.staging import TensorSlot, plan_layout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default="/tmp/shardwrite")
    parser.add_argument("--out", default="")
    parser.add_argument("--threads", default=str(WRITE_THREADS),
                        help="comma-separated writer thread counts to try (each both ways)")
    args = parser.parse_args()
    thread_counts = [int(t) for t in args.threads.split(",")]
    nbytes = int(args.gib * 2**30)
    blob = torch.empty(nbytes, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
    blob.random_(0, 256, generator=torch.Generator().manual_seed(0))
    layout, _ = plan_layout([blob])
    folder = Path(args.dir)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rows = []
    for repeat in range(args.repeats):
        for threads, direct in [(t, d) for t in thread_counts for d in (False, True)]:
            shard, record = folder / f"shard-{repeat}-{direct}.bin", folder / f"rec-{repeat}.json"
            began = time.perf_counter()
            write_shard(str(shard), str(record), {"t": TensorSlot(0)}, layout, blob, 0, False, 0.0,
                        threads=threads, direct=direct)
            seconds = time.perf_counter() - began
            writer = json.loads(record.read_text())["writer"]
            row = {"direct": direct, "repeat": repeat, "seconds": round(seconds, 3),
                   "gb_per_s": round(nbytes / seconds / 1e9, 3), **writer}
            rows.append(row)
            print(json.dumps(row), flush=True)
            os.unlink(shard)
    medians = {f"{way}-{threads}": statistics.median(
                   r["seconds"] for r in rows if r["direct"] == direct and r["threads"] == threads)
               for threads in thread_counts for way, direct in (("cache", False), ("direct", True))}
    summary = {"gib": args.gib, "dir": str(folder), "median_seconds": medians, "rows": rows}
    print(json.dumps({"median_seconds": medians}))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=1))
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
