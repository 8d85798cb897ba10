"""Node-local snapshots between saves that do not stop training (`checkpoint.local_interval_steps`
with `checkpoint.snapshot_device_copy`, the default).

Why this shape:

- **A snapshot never waits for the writer process.** A save keeps that process busy for seconds
  (a 1B model's shard: 8-11 s to the shared store), and a snapshot that went through it was
  skipped meanwhile: on an H200 a SIGKILL still recomputed 40 and 70 steps with snapshots every
  10 (docs/benchmarks.md). Snapshots have their own thread in the trainer process instead.
- **The step loop pays one device-to-device copy.** `take` copies the rank's state into a
  second flat buffer in device memory, on the training stream, so the copy is of exactly this
  step whatever the next steps do to the parameters (an 11.3 GB shard: milliseconds at HBM
  speed; a few multi-tensor launches, not one per tensor), and records an event. The state it
  is given is read in place (rtj_trainer.trainer `Trainer.snapshot_state`), not a fresh
  state dict. On an H100 (1B model) a snapshot blocked the loop 42-44 ms before these two
  changes (a state dict, one copy launch per tensor, the header), about 25 ms after them.
- **The host copy overlaps compute.** The thread waits for that event on a side stream and
  copies the buffer in chunks through two small page-locked buffers (`bounce_bytes` each:
  the device-to-host copy of one chunk runs while the other is copied on into the file) into
  the memory map of the copy's file in `checkpoint.local_dir`
  (rtj_trainer.checkpoint.local.publish_local_copy), then renames it into place. Copying
  straight into the (pageable) map stalled training instead: on an H100 the steps during a
  snapshot's copy took 4.6 s more in all, every snapshot (docs/benchmarks.md). Only the two
  bounce buffers are page-locked: pinning GBs costs seconds in every new process, on the
  restart's critical path. The file of the rank's older copy is reused, so its pages are not
  faulted in again.
- **One snapshot at a time.** `ready` is False while the thread still copies (the step loop
  skips that snapshot, as before).
- **Saves use the same buffer** (`stage`, `checkpoint.save_device_copy`): the state is copied
  into it on the training stream as for a snapshot, and the thread copies it into the
  page-locked staging buffer on the side stream (one DMA); the Checkpointer requests the save's
  write once that is done. The step loop waited for that device-to-host copy before (~0.2 s
  for an 11.3 GB shard on an H100; 0.024 s with `stage`, docs/benchmarks.md). A save never
  reallocates the buffer: of another size, it is staged the old way.
- **With a device keeper** (rtj_trainer.keeper, `RTJ_DEVICE_KEEPER=1`) the buffer is the
  keeper's, lent through CUDA IPC: it outlives this process, so the thread only records the
  snapshot once its copy finished on the device (rtj_trainer.checkpoint.devicecopy; the record
  is removed before each copy into the buffer, a save's too) and copies nothing to the host.
- **Device memory is checked, not assumed**: `prepare` allocates the buffer only when the
  device has that much free plus `HEADROOM_BYTES` (after the first step, so activations are
  counted); otherwise `usable` is False and the Checkpointer stages snapshots like saves.
- **Cut short, a snapshot is simply not there.** `close` asks the thread to stop between chunks
  and waits for it (an in-process restart must not find a copy appearing while the ranks agree
  on one to resume from); a killed process leaves a temporary. Either file becomes the folder's
  spare (`local.SPARE_NAME`), which the next snapshot writes over: deleting it took about a
  second of the restart on /dev/shm (1B model), and a new file faults every page in again.

On CPU the same code runs with the "device" buffer in host memory and no event: the tests
exercise every part but the side stream (the `gpu` tier covers it).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..keeper import client as keeper
from . import devicecopy
from .format import WRITE_CHUNK_BYTES, encode_header
from .local import drop_spare, publish_local_copy
from .staging import FlatState, TensorLayout, tensor_views

log = logging.getLogger(__name__)

HEADROOM_BYTES = 2 << 30
"""Device memory left free after the snapshot buffer is allocated."""


class _Cancelled(Exception):
    pass


class SnapshotTaker:
    """One rank's snapshots through a device-memory copy and a thread (module docstring)."""

    def __init__(self, folder: Path, *, device: torch.device, rank: int,
                 bounce_bytes: int) -> None:
        """`bounce_bytes`: each of the two page-locked buffers the host copy goes through (CUDA;
        `checkpoint.snapshot_bounce_mib`, the one default)."""
        self.folder = folder
        self.device = device
        self.rank = rank
        self.bounce_bytes = bounce_bytes
        self._buffer: torch.Tensor | None = None
        self._lease: keeper.Lease | None = None
        """The device keeper's buffer (rtj_trainer.keeper), when `_buffer` is that."""
        self.usable: bool | None = None
        """None until `prepare`; False when the device had no room for the buffer."""
        self._thread: threading.Thread | None = None
        self._cancel = threading.Event()
        self._stream: Any = None
        self._bounce: list[torch.Tensor] = []
        self._staging_error: BaseException | None = None
        self._views: tuple[torch.Tensor, list[TensorLayout], list[torch.Tensor]] | None = None
        """(buffer, layout, views of the buffer in that layout): every snapshot of a run has the
        same layout, so its hundreds of views are made once."""
        self.copy_launch_seconds = 0.0
        """Host seconds in `_copy_in` (flatten, views, the copy's launch) for this taker's
        snapshots: the part of their stall that is not reading the state."""
        self.save_copy_launch_seconds = 0.0
        """The same for the saves staged through the buffer (`stage`)."""
        self.written = 0
        self.failed = 0
        self.last_write_seconds = 0.0
        """The thread's start to the rename, for the newest snapshot it finished."""
        self.max_write_seconds = 0.0
        """The same, the longest of this taker's snapshots: longer than the steps between two
        snapshots means some are skipped, and a SIGKILL within it finds the newest unfinished."""

    def prepare(self, nbytes: int) -> bool:
        """Allocate the device buffer for a state of `nbytes` (plan_layout) if there is room."""
        if self._buffer is not None and self._buffer.numel() == nbytes:
            return True
        self._buffer, self._lease, self._views = None, None, None
        if keeper.configured():
            self._lease = keeper.lease(nbytes, self.device, allocate=True,
                                       headroom=HEADROOM_BYTES)
        if self._lease is not None:
            self._buffer = self._lease.tensor
            if self.device.type == "cuda":
                self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            if free < nbytes + HEADROOM_BYTES:
                self._refuse(f"{free / 2**30:.1f} GiB free on {self.device}, "
                             f"{(nbytes + HEADROOM_BYTES) / 2**30:.1f} GiB needed")
                return False
            try:
                self._buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            except torch.OutOfMemoryError as exc:
                self._refuse(str(exc).splitlines()[0])
                return False
            self._stream = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            if not self._bounce:
                self._bounce = [torch.empty(self.bounce_bytes, dtype=torch.uint8,
                                            pin_memory=True) for _ in range(2)]
        else:
            self._buffer = torch.empty(nbytes, dtype=torch.uint8)
        self.usable = True
        return True

    def _refuse(self, why: str) -> None:
        self.usable = False
        drop_spare(self.folder)  # the writer process makes new files
        log.warning("node-local snapshots are staged like saves (no room for a copy in device "
                    "memory: %s)", why, extra={"rank": self.rank})

    def ready(self) -> bool:
        """Whether a snapshot can start now: no earlier one is still being copied."""
        return self._thread is None or not self._thread.is_alive()

    def _copy_in(self, state: dict[str, Any], *, save: bool = False
                 ) -> tuple[Any, list[TensorLayout], int, Any] | None:
        """Copy `state` into the device buffer on the training stream: (skeleton, layout, its
        bytes, the event after the copy (None on CPU)), or None when the device has no room
        for the buffer (`usable` is False) or, for a `save` (which never allocates), when the
        buffer is not there in that size (nothing copied, nothing freed, a keeper's record left
        as it was)."""
        if self.usable is False:
            return None
        if not self.ready():
            raise RuntimeError("a snapshot is still being written")
        began = time.perf_counter()
        try:
            return self._copy_state(state, allocate=not save)
        finally:
            if save:
                self.save_copy_launch_seconds += time.perf_counter() - began
            else:
                self.copy_launch_seconds += time.perf_counter() - began

    def _copy_state(self, state: dict[str, Any], allocate: bool
                    ) -> tuple[Any, list[TensorLayout], int, Any] | None:
        flat = FlatState.of(state)
        if not allocate and (self._buffer is None or self._buffer.numel() != flat.total):
            return None
        if not self.prepare(flat.total):
            return None
        assert self._buffer is not None
        self._forget_kept()  # only now: a state of another size leaves the record standing
        flat.copy_into(self._buffer, self._views_of(self._buffer, flat.layout))
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()  # the training stream: the copies above, nothing after them
        return flat.skeleton, flat.layout, flat.total, event

    def _views_of(self, buffer: torch.Tensor, layout: list[TensorLayout]) -> list[torch.Tensor]:
        cached = self._views
        if cached is None or cached[0] is not buffer or cached[1] != layout:
            cached = self._views = (buffer, layout, tensor_views(buffer, layout))
        return cached[2]

    @property
    def kept(self) -> bool:
        """Whether the buffer is a device keeper's (it outlives this process)."""
        return self._lease is not None

    def take(self, step: int, identity: str, state: dict[str, Any]) -> float | None:
        """Copy `state` into the device buffer and start the thread that writes it as this
        rank's local copy of `step` (with a keeper's buffer: that records the buffer as the
        snapshot of `step` once the copy finished, `devicecopy`); returns the seconds the
        caller was blocked, or None when the device has no room for the buffer (nothing taken:
        `usable` is False)."""
        began = time.perf_counter()
        copied = self._copy_in(state)
        if copied is None:
            return None
        skeleton, layout, total, event = copied
        header = encode_header(skeleton, layout, total)
        self._cancel.clear()
        if self._lease is not None:
            target: Callable[..., None] = self._record_kept
            args: tuple[Any, ...] = (step, identity, header, self._lease.generation, total, event)
        else:
            target, args = self._write, (step, identity, header, self._buffer, event)
        self._thread = threading.Thread(target=target, args=args, name=f"rtj-snapshot-{step}",
                                        daemon=True)
        self._thread.start()
        return time.perf_counter() - began

    def _forget_kept(self) -> None:
        """Before the buffer is written: a keeper's buffer holds no whole snapshot from now."""
        if self._lease is not None:
            devicecopy.forget(self.folder)

    def _record_kept(self, step: int, identity: str, header: bytes, generation: str,
                     total: int, event: Any) -> None:
        began = time.perf_counter()
        try:
            if event is not None:
                event.synchronize()
            devicecopy.publish(self.folder, step, identity, generation, total, header)
        except Exception as exc:  # the buffer is not trusted: the saves' copies stand
            self.failed += 1
            log.warning("recording the device copy of step %d failed: %s", step, exc,
                        extra={"rank": self.rank})
            return
        self.written += 1
        self.last_write_seconds = time.perf_counter() - began
        self.max_write_seconds = max(self.max_write_seconds, self.last_write_seconds)

    def stage(self, state: dict[str, Any], host: Callable[[int], torch.Tensor]
              ) -> tuple[Any, list[TensorLayout], torch.Tensor] | None:
        """A save's staging off the step loop: copy `state` into the device buffer (as `take`),
        then a thread copies that buffer into `host(nbytes)` (the staging buffer, page-locked:
        one DMA on the side stream, ~0.45 s for 11.3 GB. The step after a save is ~0.21 s slower
        than the median on one H100 (docs/benchmarks.md, eighteenth session); copying in 64 MiB
        pieces, two queued at a time, did not change that, so the copy engine's queue is not
        where it goes; the cause is open).
        Returns (skeleton, layout, host buffer) at once, or None when there is no device buffer
        of the state's size (nothing done: a save never reallocates the snapshots' buffer, whose
        old block the device would not count as free). The host buffer holds the state once
        `ready()` is True again and `staging_error()` is None."""
        copied = self._copy_in(state, save=True)
        if copied is None:
            return None
        skeleton, layout, total, event = copied
        assert self._buffer is not None
        target = host(total)
        self._staging_error = None
        self._thread = threading.Thread(target=self._to_host, args=(self._buffer, target, event),
                                        name="rtj-save-staging", daemon=True)
        self._thread.start()
        return skeleton, layout, target

    def _to_host(self, source: torch.Tensor, target: torch.Tensor, event: Any) -> None:
        try:
            if event is None:
                target.copy_(source)
                return
            with torch.cuda.device(self.device), torch.cuda.stream(self._stream):
                self._stream.wait_event(event)
                target.copy_(source, non_blocking=True)
                self._stream.synchronize()
        except Exception as exc:  # the save is not written (Checkpointer._flush_deferred)
            self._staging_error = exc

    def staging_error(self) -> BaseException | None:
        """Why the last `stage` copy failed (None: it did, or none ran); call once `ready()`."""
        return self._staging_error

    def _write(self, step: int, identity: str, header: bytes, source: torch.Tensor,
               event: Any) -> None:
        began = time.perf_counter()
        total = source.numel()

        def fill(view: memoryview) -> None:
            target = torch.frombuffer(view, dtype=torch.uint8, count=total)
            try:
                if event is None:
                    for start in range(0, total, WRITE_CHUNK_BYTES):
                        if self._cancel.is_set():
                            raise _Cancelled
                        end = min(total, start + WRITE_CHUNK_BYTES)
                        target[start:end].copy_(source[start:end])
                else:
                    self._copy_through_bounce(source, target)
            finally:
                del target

        try:
            with contextlib.ExitStack() as on_side_stream:
                if event is not None:
                    on_side_stream.enter_context(torch.cuda.device(self.device))
                    on_side_stream.enter_context(torch.cuda.stream(self._stream))
                    self._stream.wait_event(event)
                written = publish_local_copy(self.folder, step, identity, header, total, fill,
                                             keep=lambda: not self._cancel.is_set())
        except _Cancelled:
            return
        except Exception as exc:  # the previous copies stand, and the next snapshot comes
            self.failed += 1
            log.warning("node-local snapshot of step %d failed: %s", step, exc,
                        extra={"rank": self.rank})
            return
        if written is not None:
            self.written += 1
            self.last_write_seconds = time.perf_counter() - began
            self.max_write_seconds = max(self.max_write_seconds, self.last_write_seconds)

    def _copy_through_bounce(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Device buffer -> the two page-locked buffers (on the side stream, asynchronously)
        -> `target` (the file's map), one chunk copied on while the next one comes."""
        inflight: list[tuple[torch.Tensor, int, int, Any]] = []

        def land() -> None:
            bounce, start, end, done = inflight.pop(0)
            done.synchronize()
            target[start:end].copy_(bounce[: end - start])

        chunk = self._bounce[0].numel()
        for index, start in enumerate(range(0, source.numel(), chunk)):
            if self._cancel.is_set():
                raise _Cancelled
            if len(inflight) == len(self._bounce):
                land()
            end = min(source.numel(), start + chunk)
            bounce = self._bounce[index % len(self._bounce)]
            bounce[: end - start].copy_(source[start:end], non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(self._stream)
            inflight.append((bounce, start, end, done))
        while inflight:
            land()

    def wait(self, timeout: float | None = None) -> None:
        """Wait until the snapshot being written (if any) is in place or given up."""
        if self._thread is not None:
            self._thread.join(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Stop a snapshot still being written (it leaves no copy) and wait for the thread."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._cancel.set()
            thread.join(timeout)
            if thread.is_alive():
                log.warning("a node-local snapshot's thread did not stop in %.0f s", timeout,
                            extra={"rank": self.rank})
        self._thread = None
        self._buffer, self._lease, self._views = None, None, None
