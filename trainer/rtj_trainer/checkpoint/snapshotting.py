"""Node-local snapshots and saves staged through the snapshots' device copy: the part of the
Checkpointer (rtj_trainer.checkpoint.checkpointer) that uses `SnapshotTaker`'s buffer in device
memory (rtj_trainer.checkpoint.snapshots), mixed in as `CommitTracking` and `Resumable` are.

- `snapshot` / `snapshot_ready`: a node-local copy between saves, through the device copy and
  the snapshot thread, or (no room for the buffer) staged like a save for the writer process.
- `defers_saves` / `_flush_deferred`: a save copies its state into the same device buffer and
  returns; the thread copies it on into the page-locked staging buffer, and the save's write is
  requested once it is there (`checkpoint.save_device_copy`; docs/trainer.md).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import CheckpointConfig
from ..keeper import client as keeper
from ..nvrx import asyncwriter
from . import devicecopy
from .committer import CheckpointStats
from .format import encode_header
from .snapshots import SnapshotTaker
from .staging import (
    FlatState,
    HostStaging,
    Staged,
    stage_to_host,
)
from .tracking import PendingSave
from .writer import record_failure, write_snapshot

log = logging.getLogger(__name__)


@dataclass(slots=True)
class SnapshotWrite:
    """A node-local snapshot's write in this rank's writer (`Checkpointer.snapshot`)."""

    step: int | None = None
    written: bool = True

    def finish(self) -> None:
        self.written = True


@dataclass(slots=True)
class DeferredSave:
    """A save whose state a thread is still copying into the staging buffer
    (`SnapshotTaker.stage`); its write is requested once the copy is there
    (`Checkpointer._flush_deferred`)."""

    pending: PendingSave
    writer: Callable[..., None]
    args: tuple[Any, ...]
    """`write_shard`'s: (shard path, record path, skeleton, layout, buffer, rank)."""


class Snapshotting:
    """Snapshots and saves through the device copy (mixed into `Checkpointer`)."""

    cfg: CheckpointConfig
    rank: int
    world_size: int
    identity: str
    device: torch.device
    stats: CheckpointStats
    _pending: list[PendingSave]
    _queue: Any
    _snapshots: SnapshotTaker | None
    _staging: HostStaging
    _snapshot: SnapshotWrite
    _deferred: DeferredSave | None
    _local: Path | None
    _async_queue: Callable[[], Any]
    _writer_idle: Callable[[], bool]
    _staging_allocated: Callable[[], None]

    def defers_saves(self) -> bool:
        """Whether the next save is staged through the snapshots' device copy
        (`checkpoint.save_device_copy`): async mode, a usable device buffer that no snapshot
        is using now. The trainer then reads its state in place for the save, as for a
        snapshot."""
        taker = self._snapshots
        wanted = self.cfg.save_device_copy
        if wanted is None:
            wanted = self.device.type == "cuda"
        return bool(wanted and self.cfg.mode == "async" and taker is not None
                    and taker.usable is not False and taker.ready())

    def _flush_deferred(self, *, wait: bool) -> None:
        """Request the write of a save staged through the device copy once the thread's copy
        into the staging buffer is done (`wait`: wait for it). A copy that failed leaves the
        save's `.error` record, as a failed write does: it never commits."""
        deferred = self._deferred
        if deferred is None or self._snapshots is None:
            return
        if not wait and not self._snapshots.ready():
            return
        self._snapshots.wait()
        self._deferred = None
        error = self._snapshots.staging_error()
        if error is not None:
            log.error("staging the checkpoint of step %d failed: %s", deferred.pending.step,
                      error, extra={"rank": self.rank})
            record_failure(str(deferred.args[1]), error)
            deferred.pending.written = True
            return
        _, _, skeleton, layout, _, _ = deferred.args
        self._staging.staged = Staged(deferred.pending.step, self.identity, self.rank,
                                      self.world_size, skeleton, layout)
        self._request_write(deferred.writer, deferred.args, deferred.pending)

    def _request_write(self, writer: Callable[..., None], args: tuple[Any, ...],
                       pending: PendingSave) -> None:
        """Hand a save's write to this rank's writer process; `pending.written` once done."""

        def finalize() -> None:
            pending.written = True

        pending.requested_at = time.time()

        request = asyncwriter.request(
            writer, (*args, True, self.cfg.test_write_delay_seconds), [finalize])
        self._async_queue().schedule_async_request(request)

    def _discard_deferred(self) -> None:
        """An aborted attempt: a save still being staged through the device copy is given up
        (its thread joined: it writes the staging buffer, which the next attempt reuses)."""
        deferred = self._deferred
        if deferred is None:
            return
        if self._snapshots is not None:
            self._snapshots.wait()
        self._deferred = None
        with contextlib.suppress(ValueError):
            self._pending.remove(deferred.pending)

    def _stage_live_on_device(self, step: int, state: dict[str, Any]) -> bool:
        """`stage_live` into the device keeper's buffer (rtj_trainer.keeper) when it holds one
        of the state's size: a device-to-device copy, recorded as the live state of `step`
        (`devicecopy`), instead of a device-to-host copy into the staging buffer, which the next
        attempt would then copy back (together ~0.5 s for 11.3 GB on an H200). False: not
        staged (no keeper, no buffer of that size)."""
        if self._local is None or not keeper.configured():
            return False
        flat = FlatState.of(state)
        lease = keeper.lease(flat.total, self.device, allocate=False)
        if lease is None:
            return False
        if self._snapshots is not None:
            self._snapshots.wait()  # no snapshot's record may land after this one
        devicecopy.forget(self._local)
        flat.copy_into(lease.tensor)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        devicecopy.publish(self._local, step, self.identity, lease.generation, flat.total,
                           encode_header(flat.skeleton, flat.layout, flat.total), live=True)
        return True

    def snapshot_ready(self) -> bool:
        """Whether a snapshot (`snapshot`) can start now without waiting: a node-local folder,
        and this rank's writer idle (sync mode: always)."""
        if self._local is None:
            return False
        if self._snapshots is not None and self._snapshots.usable is not False:
            return self._snapshots.ready()
        if self.cfg.mode == "sync":
            return True
        self._async_queue()
        return self._writer_idle()

    def snapshot_copies(self) -> dict[str, float]:
        """What the snapshot thread (`SnapshotTaker`) did in this process: copies written, the
        newest one's and the longest one's seconds (start to rename), and the host seconds of
        launching the copies into the device buffer, the snapshots' and the saves' apart; empty
        without it."""
        if (t := self._snapshots) is None or not t.usable:
            return {}
        return {"thread_copies": t.written, "thread_copy_seconds_last": t.last_write_seconds,
                "thread_copy_seconds_max": t.max_write_seconds,
                "copy_launch_seconds": t.copy_launch_seconds,
                "save_copy_launch_seconds": t.save_copy_launch_seconds}

    def snapshot(self, step: int, state: dict[str, Any]) -> float:
        """Stage `state` and write it as this rank's node-local copy of `step` alone, nothing
        on the shared store (`checkpoint.local_interval_steps`; only when `snapshot_ready`);
        returns the seconds the step loop was blocked (the staging copy, in sync mode the
        write too). The staged state also serves an in-process restart (`_load_staged`); a
        snapshot through the device copy (`SnapshotTaker`) blocks only for that copy."""
        assert self._local is not None
        if self._snapshots is not None and self._snapshots.usable is not False:
            stall = self._snapshots.take(step, self.identity, state)
            if stall is not None:
                return stall
        began = time.perf_counter()
        self._staging_allocated()
        skeleton, layout, blob = stage_to_host(state, self.device, self._staging)
        self._staging.staged = Staged(step, self.identity, self.rank, self.world_size, skeleton,
                                      layout)
        args = (str(self._local), step, self.identity, skeleton, layout, blob)
        if self.cfg.mode == "async":
            done = self._snapshot = SnapshotWrite(step, written=False)
            request = asyncwriter.request(write_snapshot, (*args, True), [done.finish])
            self._async_queue().schedule_async_request(request)
        else:
            write_snapshot(*args, False)
        return time.perf_counter() - began
