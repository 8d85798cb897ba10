"""Where an in-process restart's teardown goes on a GPU: NVRx's AbortTorchDistributed (0.7.0) calls
`backend.abort()` on every NCCL process group (one thread each), then
`torch.distributed.destroy_process_group()`. The goodput runs measure both together (0.57-0.98 s
on one H100, the eighteenth session); this times each apart, ROUNDS times in one process, one rank:

    python3 bench/device/ncclabort.py --rounds 5 > $OUT/ncclabort.json

Each round: init_process_group (NCCL, a TCP store on 127.0.0.1), one all-reduce of BYTES (the
communicator is made at the first collective), then `abort()` of the default group's NCCL backend,
then `destroy_process_group()`. With `--with-subgroup` a second group is made too (FSDP's
hybrid-shard setups have several), as NVRx aborts them all.

The abort took 0.99-1.00 s in every round on one H100 (docs/benchmarks.md, nineteenth session).
NCCL's proxy threads poll with a 500 ms timeout and the abort waits for them (a reading of NCCL's
source, not measured); the next run to make, with no UDS proxy thread:

    NCCL_CUMEM_ENABLE=0 python3 bench/device/ncclabort.py --rounds 4
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bytes", type=int, default=64 << 20)
    parser.add_argument("--port", type=int, default=29541)
    parser.add_argument("--with-subgroup", action="store_true")
    args = parser.parse_args()
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    payload = torch.ones(args.bytes // 4, device=device)
    rounds = []
    for index in range(args.rounds):
        store = dist.TCPStore("127.0.0.1", args.port + index, 1, True,
                              timeout=timedelta(seconds=30))
        t0 = time.perf_counter()
        dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
        groups = [dist.group.WORLD]
        if args.with_subgroup:
            groups.append(dist.new_group([0]))
        t1 = time.perf_counter()
        for group in groups:
            dist.all_reduce(payload, group=group)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        for group in groups:
            backend = group._get_backend(device)  # type: ignore[union-attr]
            backend.abort()
        t3 = time.perf_counter()
        dist.destroy_process_group()
        t4 = time.perf_counter()
        rounds.append({"init": round(t1 - t0, 4), "first_collective": round(t2 - t1, 4),
                       "abort": round(t3 - t2, 4), "destroy": round(t4 - t3, 4)})
        del store
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    print(json.dumps({"torch": torch.__version__, "nccl": nccl,
                      "groups": 2 if args.with_subgroup else 1, "rounds": rounds,
                      "pid": os.getpid()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
