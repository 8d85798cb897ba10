"""NVRx's persistent async checkpoint writer, as the trainer's checkpointer uses it.

Runs in the training worker (rtj_trainer.checkpoint.checkpointer): `spawn` starts one writer
process per rank (`AsyncCallsQueue(persistent=True, cpu_shm_mode=True)`: the writer only ever
sees host memory, and polling it with `no_dist=True` needs no CUDA tensor; the only NVRx async
path that works unpatched on CPU, docs/nvrx.md C1); `request` wraps a write for it. The writer
process runs what the request names (rtj_trainer.checkpoint.writer). Public API only, apart from
the writer's process handle (`persistent_caller.process`), which `alive` reads.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

from .guards import Patch, Target

PATCHES = (
    Patch("the writer's process handle",
          "whether a kept writer still runs is read from its process handle",
          (Target("nvidia_resiliency_ext.checkpointing.async_ckpt.core:PersistentAsyncCaller",
                  "aa0fc9f109d5bde8"),)),
)

log = logging.getLogger("rtj_trainer.checkpoint")


def spawn(rank: int, arm: Callable[..., Any]) -> Any:
    """A new persistent writer: its queue, the process spawned and its first request sent
    (`arm(os.getpid())` in the writer: e.g. die with this trainer)."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import (
        AsyncCallsQueue,
        AsyncRequest,
        PersistentAsyncCaller,
    )

    queue = AsyncCallsQueue(persistent=True, cpu_shm_mode=True)
    # NVRx asks torch.distributed for the rank (for its log lines) unless told: a warm spare
    # starts its writer before any process group exists.
    queue.persistent_caller = PersistentAsyncCaller(cpu_shm_mode=True)
    queue.persistent_caller.rank = rank
    queue.schedule_async_request(AsyncRequest(arm, (os.getpid(),), []))
    log.info("checkpoint writer process %d started", queue.persistent_caller.process.pid,
             extra={"rank": rank})
    return queue


def alive(queue: Any) -> bool:
    """Whether the writer process of `queue` runs."""
    caller = queue.persistent_caller
    process = caller.process if caller is not None else None
    return process is not None and process.is_alive()


def request(fn: Callable[..., Any], args: Sequence[Any],
            finalize: Sequence[Callable[[], None]]) -> Any:
    """A write for the writer: `fn(*args)` there, then `finalize` here when it is done."""
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

    return AsyncRequest(fn, tuple(args), list(finalize))


def died(queue: Any) -> bool:
    """Whether the writer process of `queue` was started and has ended."""
    caller = queue.persistent_caller
    process = caller.process if caller is not None else None
    return process is not None and not process.is_alive()
