"""The shard writer: runs inside NVRx's persistent worker process (async mode) or inline (sync).

Why this shape:

- **A fast writer.** The shard (`format.encode_header` then the staged buffer's raw bytes) is
  split into chunks that several threads hash (sha256 per chunk; hashlib and `os.pwrite` release
  the GIL) and write with `os.pwrite` at their offsets in one file, starting the kernel's
  writeback per chunk; one fsync at the end, then the rename into place and the shard record.
- **A writer dies with its trainer** (`PR_SET_PDEATHSIG`, armed by `arm_writer` as the first
  request to a fresh NVRx worker), so a killed rank cannot leave a writer behind that later
  completes a stale shard.
- **The node-local copy first** (`local_copy`, see rtj_trainer.checkpoint.local): the same
  bytes go to a file in RAM (/dev/shm) before the shared store, so a restart in the same pod has
  them about a second after the save instead of after the commit. A failed local copy is only
  recorded (`local_seconds` -1); the shared write goes on.
- **Snapshots go to RAM alone** (`write_snapshot`, `checkpoint.local_interval_steps`): between
  saves the same local copy is written with no shared write and no record, so a worker killed
  on its node resumes from a few steps back.
- **Failures never kill the persistent worker:** a failed write leaves `<record>.error` and no
  shard record, so the checkpoint simply never commits.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import mmap
import os
import signal
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from ..files import fsync_dir, write_json_atomic
from ..lifeline import die_with_parent
from .format import (
    SLICE_BYTES,
    WRITE_CHUNK_BYTES,
    WRITE_THREADS,
    CheckpointError,
    ChunkDigest,
    ShardRecord,
    encode_header,
)
from .hostmem import libc_madvise
from .local import write_local_copy
from .staging import TensorLayout

WRITER_PROCESS_NAME = b"rtj-ckpt-writer"
"""The writer's process name (`ps`, /proc/<pid>/comm): operators and fault drills find it."""


def _exit_now(signum: int, frame: object) -> None:
    os._exit(128 + signum)


def arm_writer(trainer_pid: int) -> None:
    """First request to a fresh NVRx writer: die with the trainer from now on, and at once on
    SIGTERM. NVRx's abort (`close(abort=True)`, also the in-process wrapper's) sends SIGTERM and
    waits; its own handler raises SystemExit, which waits for our writer threads to finish their
    chunks: about a second on a fault's critical path, seen on two H200s. This writer holds only
    host memory (no CUDA handles to release), so exiting at once is safe; a half-written shard
    or local copy keeps its temporary name and is never committed or offered."""
    die_with_parent(WRITER_PROCESS_NAME)
    signal.signal(signal.SIGTERM, _exit_now)
    if os.getppid() != trainer_pid:
        os._exit(0)


def _byte_view(blob: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU uint8 tensor's bytes (no numpy needed)."""
    if blob.device.type != "cpu" or blob.dtype != torch.uint8 or not blob.is_contiguous():
        raise CheckpointError("the staged blob must be a contiguous CPU uint8 tensor")
    array = (ctypes.c_ubyte * blob.numel()).from_address(blob.data_ptr())
    return memoryview(array).cast("B")


_SYNC_FILE_RANGE_WRITE = 2


def _start_writeback_function() -> Callable[[int, int, int], object] | None:
    """Linux `sync_file_range(..., SYNC_FILE_RANGE_WRITE)`: start writing a range to disk now
    without waiting, so the final fsync finds little left to do. None where unavailable."""
    try:
        function = ctypes.CDLL("libc.so.6", use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return lambda fd, offset, nbytes: function(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


_MADV_DONTNEED = 4


def _page_releaser() -> Callable[[memoryview], None] | None:
    """madvise(MADV_DONTNEED) over the whole pages inside a buffer, for the writer process and
    only for a staging buffer in SHARED memory (rtj_trainer.checkpoint.hostmem's memfd,
    received from the trainer): it drops this process's page-table entries of those pages, not
    the pages (they stay in the shared memory, the trainer's map is untouched, and reading them
    again maps them again). Why: a process that mapped the whole 11.3 GB buffer took ~1 s to
    exit (its page tables torn down; `bench/device/killexit.py`), and a SIGKILLed trainer's
    restart waits for its writer's exit. Dropped slice by slice as they are written, the writer
    exits at once. On a private mapping this would lose the data: never call it on one. None
    without libc."""
    madvise = libc_madvise()
    if madvise is None:
        return None
    page = mmap.PAGESIZE

    def release(view: memoryview) -> None:
        address = _address(view)
        if address is None:
            return
        start, end = -(-address // page) * page, (address + len(view)) // page * page
        if end > start:
            madvise(start, end - start, _MADV_DONTNEED)

    return release


def _releases(blob: torch.Tensor, in_worker: bool) -> Callable[[memoryview], None] | None:
    """The page releaser for `blob` when this is the writer process and `blob` is shared."""
    shared = blob.is_shared()  # type: ignore[no-untyped-call]
    return _page_releaser() if in_worker and shared else None


DIRECT_ALIGN = 4096
"""Offsets, lengths and memory addresses of writes through O_DIRECT are multiples of this."""


def _address(view: memoryview) -> int | None:
    """The memory address of a writable buffer's first byte (None: read-only, e.g. bytes)."""
    try:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    except (TypeError, ValueError):
        return None


def _write_chunk(fd: int, data: memoryview, offset: int,
                 start_writeback: Callable[[int, int, int], object] | None,
                 direct_fd: int | None = None, direct_bytes: list[int] | None = None,
                 release: Callable[[memoryview], None] | None = None) -> str:
    """Hash and pwrite one chunk (slice by slice, so the write reads cache-warm bytes). With
    `direct_fd` (the file opened with O_DIRECT) each slice whose offset, length and address are
    aligned goes through it, past the page cache; the rest (the header, the last slice), or a
    slice the filesystem refuses, through `fd`. `direct_bytes[0]` counts what went direct.
    `release` (`_page_releaser`): called with each slice once it is written."""
    digest = hashlib.sha256()
    for begin in range(0, len(data), SLICE_BYTES):
        piece = data[begin : begin + SLICE_BYTES]
        digest.update(piece)
        at = offset + begin
        target = fd
        if (direct_fd is not None and at % DIRECT_ALIGN == 0 and len(piece) % DIRECT_ALIGN == 0
                and (address := _address(piece)) is not None and address % DIRECT_ALIGN == 0):
            target = direct_fd
        done = 0
        while done < len(piece):
            try:
                wrote = os.pwrite(target, piece[done:], at + done)
            except OSError as exc:
                if target == fd or exc.errno != errno.EINVAL:
                    raise
                target = fd  # this filesystem refuses the direct write: through the cache
                continue
            if target != fd and direct_bytes is not None:
                direct_bytes[0] += wrote
            done += wrote
            if done % DIRECT_ALIGN:
                target = fd  # a short direct write: the rest is not aligned any more
        if release is not None:
            release(piece)
    if start_writeback is not None:
        start_writeback(fd, offset, len(data))
    return digest.hexdigest()


def write_shard(
    shard_path: str,
    record_path: str,
    skeleton: Any,
    layout: list[TensorLayout],
    blob: torch.Tensor,
    rank: int,
    in_worker: bool,
    delay_seconds: float,
    chunk_bytes: int = WRITE_CHUNK_BYTES,
    threads: int = WRITE_THREADS,
    *,
    local_copy: tuple[str, int, str] | None = None,
    fail: str | None = None,
    direct: bool = False,
) -> None:
    """Write one rank's shard durably, then its record; failures leave a `.error` file instead.

    File = `encode_header(...)` then the blob's raw bytes. Chunk 0 is the header, then the blob
    in `chunk_bytes` pieces; `threads` threads hash and pwrite them; one fsync at the end.
    `local_copy` = (folder, step, identity): also write the same bytes as this rank's node-local
    copy there, in a thread alongside the store write (memory-bound against disk-bound: a save
    takes about the longer of the two, not their sum, so the writer keeps up with saves that
    come faster); this returns once both are done, as the staging buffer is reused after it.
    `fail` (fault injection, rtj_trainer.faults.WRITE_FAULTS): "error" fails the write with EIO
    (the `.error` record is left as for any failure); "lost" leaves nothing at all. `direct`
    (`checkpoint.direct_io`): the blob's aligned slices are written with O_DIRECT.
    """
    if in_worker:
        die_with_parent(WRITER_PROCESS_NAME)
    if delay_seconds:
        time.sleep(delay_seconds)
    shard = Path(shard_path)
    tmp = shard.with_name(f".{shard.name}.tmp-{os.getpid()}")
    if fail == "lost":
        return  # the write and its `.error` record both failed: nothing tells rank 0
    try:
        if fail == "error":
            raise OSError(errno.EIO, "injected shard write failure (fault write-error)", shard_path)
        began, started_at = time.perf_counter(), time.time()
        data = _byte_view(blob)
        release = _releases(blob, in_worker)
        header = encode_header(skeleton, layout, len(data))
        local_seconds = [0.0]
        local_thread: threading.Thread | None = None
        if local_copy is not None:
            folder, step, identity = local_copy

            def copy_locally() -> None:
                try:
                    write_local_copy(Path(folder), step, identity, header, data, threads=threads)
                    local_seconds[0] = time.perf_counter() - began
                except Exception:  # no copy: a resume reads the store instead
                    local_seconds[0] = -1.0

            local_thread = threading.Thread(target=copy_locally, name="rtj-local-copy",
                                            daemon=True)
            local_thread.start()
        try:
            pieces = [(memoryview(header), 0)] + [
                (data[start : start + chunk_bytes], len(header) + start)
                for start in range(0, len(data), max(1, chunk_bytes))
            ]
            digests, written, synced, direct_bytes = _write_file(tmp, pieces, threads, direct,
                                                                 release)
        finally:
            if local_thread is not None:
                local_thread.join()  # it reads the staging buffer, which is reused after this
            if release is not None:
                release(data)  # what the local copy mapped again
        os.replace(tmp, shard)
        fsync_dir(shard.parent)
        total = len(header) + len(data)
        record = ShardRecord(
            rank, shard.name, total,
            tuple(ChunkDigest(at, len(view), digest)
                  for (view, at), digest in zip(pieces, digests, strict=True)),
            {"seconds": round(time.perf_counter() - began, 4),
             "write_seconds": round(written - began, 4),
             "fsync_seconds": round(synced - written, 4),
             "threads": float(max(1, min(threads, len(pieces)))),
             "local_seconds": round(local_seconds[0], 4),
             "direct_bytes": float(direct_bytes),
             "started_at": round(started_at, 4)},
        )
        write_json_atomic(Path(record_path), record.to_json())
    except Exception as exc:  # keep the persistent worker alive; the checkpoint never commits
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        record_failure(record_path, exc)
        if not in_worker:
            raise


def record_failure(record_path: str, exc: BaseException) -> None:
    """Leave `<record>.error` for a save that failed (its write, or staging it): rank 0's
    commit sees it, and the checkpoint never commits."""
    with contextlib.suppress(OSError):
        Path(record_path + ".error").write_text(repr(exc))


def write_snapshot(
    folder: str,
    step: int,
    identity: str,
    skeleton: Any,
    layout: list[TensorLayout],
    blob: torch.Tensor,
    in_worker: bool,
    threads: int = WRITE_THREADS,
) -> None:
    """Write the staged state as this rank's node-local copy of `step` only: a snapshot between
    saves (`checkpoint.local_interval_steps`), nothing on the shared store, nothing to commit.
    A failed snapshot is no error: the previous copies stand, and the next one comes."""
    if in_worker:
        die_with_parent(WRITER_PROCESS_NAME)
    release = _releases(blob, in_worker)
    try:
        data = _byte_view(blob)
        header = encode_header(skeleton, layout, len(data))
        try:
            write_local_copy(Path(folder), step, identity, header, data, threads=threads)
        finally:
            if release is not None:
                release(data)
    except Exception:
        if not in_worker:
            raise


def _write_file(tmp: Path, pieces: list[tuple[memoryview, int]], threads: int,
                direct: bool = False, release: Callable[[memoryview], None] | None = None
                ) -> tuple[list[str], float, float, int]:
    """pwrite `pieces` ((bytes, offset)) into `tmp`, hashing each, with `threads` threads, then
    fsync: (digests, written at, synced at in perf_counter seconds, bytes written with O_DIRECT).
    `direct`: aligned slices go through a second descriptor opened with O_DIRECT when the
    filesystem allows it (not tmpfs: then every byte goes through the page cache, as without)."""
    start_writeback = _start_writeback_function()
    workers = max(1, min(threads, len(pieces)))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    direct_fd = None
    if direct and hasattr(os, "O_DIRECT"):
        with contextlib.suppress(OSError):
            direct_fd = os.open(tmp, os.O_WRONLY | os.O_CLOEXEC | os.O_DIRECT)
    counted = [0]
    try:
        def write(item: tuple[memoryview, int]) -> str:
            return _write_chunk(fd, item[0], item[1], start_writeback, direct_fd, counted,
                                release)

        if workers == 1:
            digests = [write(item) for item in pieces]
        else:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                digests = list(pool.map(write, pieces))
        written = time.perf_counter()
        os.fsync(fd)  # the page cache's part, the file's size and the device's write cache
    finally:
        if direct_fd is not None:
            os.close(direct_fd)
        os.close(fd)
    return digests, written, time.perf_counter(), counted[0]


