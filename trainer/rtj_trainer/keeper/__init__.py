"""Device keepers: one small process per local rank that holds the node-local snapshots' buffer
in device memory, so that a training worker killed on its node leaves its last snapshot where
the next worker finds it (`RTJ_DEVICE_KEEPER=1`; the launcher shim starts them,
rtj_trainer.launcher.shim).

Why: a snapshot is a device-to-device copy of the rank's state into a second buffer
(rtj_trainer.checkpoint.snapshots); milliseconds. Without a keeper that buffer belongs to the
worker and dies with it, so a snapshot only survives a SIGKILL once a thread has copied it on to
the host (`/dev/shm`: 1.2-3.7 s for an 11.3 GB shard, during which a kill finds the previous one,
and the copy slows the steps beside it), and the next worker reads it back onto the device
(0.7-1.1 s). A keeper allocates the buffer in its own process and lends it to the worker
through CUDA IPC: the worker's copy lands in memory that outlives the worker, a snapshot is
whole as soon as its copy finished on the device, and the next worker opens the same memory and
loads from it (docs/trainer.md, "Device keepers").

What a keeper cannot do: outlive its GPU, its pod or its launcher (it dies with the launcher,
PR_SET_PDEATHSIG). The saves' node-local copies and the shared store cover those.

The wire: one Unix SOCK_SEQPACKET socket per local rank (`socket_path`) in the shim's private
directory (`DIR_ENV`); one JSON request, one JSON reply per connection. A CPU buffer (the CPU
tests, a CPU job) is a memfd passed with the reply (SCM_RIGHTS); a CUDA buffer is the 8 values of
torch's `UntypedStorage._share_cuda_()` (bytes as base64). This module imports nothing heavy (the
shim reads it); the worker's side is rtj_trainer.keeper.client.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
from typing import Any

from rtj_wire import env as wire_env

SWITCH_ENV = wire_env.DEVICE_KEEPER
"""`1`: the launcher shim starts one keeper per local rank; `0` or unset: none (the operator
sets it from `faultTolerance.deviceKeepers`)."""
DIR_ENV = "RTJ_DEVICE_KEEPER_DIR"
"""The shim's private directory of the keepers' sockets and status files (the workers inherit
it); unset, a worker holds its snapshot buffer itself."""
CONTEXT_ALLOWANCE_MB = 1024
"""What a keeper's CUDA context is counted as, besides its buffer, when ft_launcher checks that
a dead worker's GPU memory was freed (rtj_trainer.nvrx.launcher)."""
REQUEST_TIMEOUT_SECONDS = 30.0
MESSAGE_BYTES = 1 << 16


def socket_path(directory: str, local_rank: int) -> str:
    return os.path.join(directory, f"keeper-{local_rank}.sock")


def status_path(directory: str, local_rank: int) -> str:
    """The keeper's own account of what it holds: {"pid", "cuda", "buffer_bytes", ...}."""
    return os.path.join(directory, f"keeper-{local_rank}.json")


def switched_on(env: Any) -> bool:
    """`RTJ_DEVICE_KEEPER`: `1` on, `0` or unset off; anything else is an error naming it."""
    value = str(env.get(SWITCH_ENV, "0")).strip()
    if value not in ("0", "1"):
        raise SystemExit(f"launcher: {SWITCH_ENV}={value!r}: expected 1 or 0")
    return value == "1"


def held_mb(directory: str) -> float:
    """The most GPU memory (MiB) one local rank's keeper holds: its buffer and, once it has a
    CUDA context, `CONTEXT_ALLOWANCE_MB`; 0 without keepers."""
    most = 0.0
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if not (name.startswith("keeper-") and name.endswith(".json")):
                continue
            try:
                with open(os.path.join(directory, name), encoding="utf-8") as handle:
                    status = json.load(handle)
            except (OSError, ValueError):
                continue
            if status.get("cuda"):
                held = int(status.get("cuda_buffer_bytes", 0)) / 2**20 + CONTEXT_ALLOWANCE_MB
                most = max(most, held)
    return most


def encode_cuda_share(share: tuple[Any, ...]) -> list[Any]:
    """`UntypedStorage._share_cuda_()`'s 8 values as JSON data (bytes as base64)."""
    return [base64.b64encode(v).decode() if isinstance(v, bytes) else v for v in share]


def decode_cuda_share(values: list[Any]) -> tuple[Any, ...]:
    """`encode_cuda_share` undone."""
    index, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = values
    return (int(index), base64.b64decode(handle), int(size), int(offset),
            base64.b64decode(ref_handle), int(ref_offset),
            base64.b64decode(event_handle) if event_handle else None, bool(event_sync))
