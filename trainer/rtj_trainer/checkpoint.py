"""The one adapter around NVRx async checkpointing, with an atomic, validated commit on top.

Why this shape:

- **Per-rank shards, one writer per rank.** Each rank stages its state (its FSDP slices, optimizer
  and scheduler state, RNG, data position, NVRx rank-monitor state) into ONE flat host buffer, then
  hands it to NVRx's persistent writer process (`AsyncCallsQueue(persistent=True,
  cpu_shm_mode=True)`). The step loop is blocked only for the device-to-host copy. One flat buffer
  (not hundreds of tensors) crosses the process boundary, and because it is allocated in shared
  memory once and reused, nothing is copied again on the way; on CUDA it is also page-locked
  (`cudaHostRegister`) so the copy runs at DMA speed.
- **Device differences live here only.** `cpu_shm_mode=True` keeps the writer process away from
  CUDA on every device (the writer only ever sees host memory), and the queue is polled with
  `no_dist=True`, which needs no CUDA tensor. That is the only NVRx async path that works
  unpatched on CPU (docs/nvrx.md, C1); on CUDA the staging copy is the one extra step.
- **A fast writer.** A shard is a small pickled header (skeleton, tensor layout) followed by the
  raw bytes of the staged buffer, no `torch.save` copy. The writer splits it into chunks that
  several threads hash (sha256 per chunk; hashlib and `os.pwrite` release the GIL) and write with
  `os.pwrite` at their offsets in one file, starting the kernel's writeback per chunk; one fsync
  at the end. Per-chunk digests go into the shard record and the manifest, so a resume verifies
  the chunks in parallel too.
- **Commit = manifest.** A writer fsyncs its shard, renames it into place, then writes a shard
  record (size, chunk digests, its own timings). Rank 0 polls (a few `stat`s per step, no
  collectives) and, once every rank's record exists, writes `manifest.json` through tmp + fsync +
  rename. Only directories with a manifest count. Resume walks committed checkpoints newest
  first, validates each (world size, shard count, sizes, chunk checksums) on every rank, agrees
  with an all-reduce, and falls back to the previous one if any rank finds a problem. The last
  `keep` committed checkpoints are kept.
- **A synchronous mode for comparison** writes in the training process, then barriers and commits.

A writer process dies with its trainer (`PR_SET_PDEATHSIG`), so a killed rank cannot leave a
writer behind that later completes a stale shard.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import os
import pickle
import queue
import re
import shutil
import signal
import struct
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from .config import CheckpointConfig

log = logging.getLogger(__name__)

FORMAT_VERSION = 2
"""2: raw shard file, per-chunk sha256 (1: one torch.save pickle, one whole-file sha256)."""
MANIFEST = "manifest.json"
_DIR_PATTERN = re.compile(r"^step-(\d{9})\.(.+)$")
_ALIGN = 64
_SHARD_MAGIC = b"RTJSHRD2"
_DATA_ALIGN = 4096
WRITE_CHUNK_BYTES = 256 << 20
"""Unit of hashing and parallel writing: an 11 GB shard is ~45 chunks over the writer threads."""
WRITE_THREADS = 8
"""Writer threads per rank (8 ranks per p5 node: 64 of its 192 vCPUs at most)."""
_SLICE_BYTES = 8 << 20
"""Inside a chunk, hash then write this much at a time, so the write reads cache-warm bytes."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or no usable checkpoint could be loaded."""


# ---------------------------------------------------------------------------------------------
# Files: names, atomic writes, manifest


def checkpoint_dir_name(step: int, identity: str) -> str:
    """`step-000000010.a0-l1-i0`: the step, then which attempt wrote it (never reused)."""
    return f"step-{step:09d}.{identity}"


def step_of(name: str) -> int | None:
    match = _DIR_PATTERN.match(name)
    return int(match.group(1)) if match else None


def shard_file_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.bin"


def shard_record_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.json"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """tmp + fsync + rename + fsync(dir): readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        json.dump(data, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


@dataclass(frozen=True, slots=True)
class ChunkDigest:
    """sha256 of the bytes [offset, offset + bytes) of a shard file."""

    offset: int
    bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class ShardRecord:
    rank: int
    file: str
    bytes: int
    chunks: tuple[ChunkDigest, ...]
    writer: dict[str, float] = field(default_factory=dict, compare=False)
    """The writer's own timings (seconds, write_seconds, fsync_seconds, threads); informative."""

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "file": self.file, "bytes": self.bytes,
                "chunks": [[c.offset, c.bytes, c.sha256] for c in self.chunks],
                "writer": dict(self.writer)}

    @classmethod
    def from_json(cls, data: Any) -> ShardRecord:
        """Raises KeyError/TypeError/ValueError on a malformed record."""
        chunks = tuple(ChunkDigest(int(o), int(n), str(h)) for o, n, h in data["chunks"])
        writer = {str(k): float(v) for k, v in dict(data.get("writer") or {}).items()}
        record = cls(int(data["rank"]), str(data["file"]), int(data["bytes"]), chunks, writer)
        if (problem := chunk_tiling_problem(record.chunks, record.bytes)) is not None:
            raise ValueError(f"shard {record.file}: {problem}")
        return record


def chunk_tiling_problem(chunks: Sequence[ChunkDigest], total: int) -> str | None:
    """The chunks must cover [0, total) exactly, in order, so that no byte goes unchecked."""
    offset = 0
    for chunk in chunks:
        if chunk.offset != offset or chunk.bytes <= 0:
            return f"chunk at offset {chunk.offset} ({chunk.bytes} bytes), expected offset {offset}"
        offset += chunk.bytes
    if offset != total:
        return f"chunks cover {offset} bytes of {total}"
    return None


@dataclass(frozen=True, slots=True)
class Manifest:
    step: int
    world_size: int
    shards: tuple[ShardRecord, ...]
    committed_at: float
    identity: str
    format: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "step": self.step,
            "world_size": self.world_size,
            "committed_at": self.committed_at,
            "identity": self.identity,
            "shards": [shard.to_json() for shard in self.shards],
        }

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """Parse and check the structure; raises CheckpointError naming what is wrong."""
        try:
            if int(data.get("format", 0)) != FORMAT_VERSION:
                raise CheckpointError(
                    f"manifest format {data.get('format', 0)}, expected {FORMAT_VERSION}")
            shards = tuple(ShardRecord.from_json(s) for s in data["shards"])
            manifest = cls(
                step=int(data["step"]),
                world_size=int(data["world_size"]),
                shards=shards,
                committed_at=float(data["committed_at"]),
                identity=str(data.get("identity", "")),
                format=int(data.get("format", 0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"malformed manifest: {exc!r}") from None
        if sorted(s.rank for s in shards) != list(range(manifest.world_size)):
            raise CheckpointError(
                f"manifest lists ranks {sorted(s.rank for s in shards)} "
                f"for world size {manifest.world_size}"
            )
        return manifest


def read_manifest(ckpt_dir: Path) -> Manifest:
    try:
        data = json.loads((ckpt_dir / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt_dir.name}: no manifest (never committed)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{ckpt_dir.name}: unreadable manifest: {exc}") from None
    return Manifest.from_json(data)


def _digest_range(fd: int, offset: int, nbytes: int) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(min(_SLICE_BYTES, max(nbytes, 1)))
    view = memoryview(buffer)
    done = 0
    while done < nbytes:
        want = min(len(buffer), nbytes - done)
        got = os.preadv(fd, [view[:want]], offset + done)
        if got <= 0:
            break  # the file is shorter than the range: the digest will not match
        digest.update(view[:got])
        done += got
    return digest.hexdigest()


def digest_ranges(path: Path, ranges: Sequence[tuple[int, int]],
                  threads: int = WRITE_THREADS) -> list[str]:
    """sha256 of each (offset, bytes) range of `path`, several ranges at a time."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if len(ranges) <= 1 or threads <= 1:
            return [_digest_range(fd, offset, nbytes) for offset, nbytes in ranges]
        with ThreadPoolExecutor(max_workers=min(threads, len(ranges))) as pool:
            return list(pool.map(lambda r: _digest_range(fd, r[0], r[1]), ranges))
    finally:
        os.close(fd)


def checksum_problems(path: Path, shard: ShardRecord) -> list[str]:
    """Which chunks of `path` do not match the digests recorded for `shard`."""
    actual = digest_ranges(path, [(c.offset, c.bytes) for c in shard.chunks])
    return [f"chunk {i} at offset {c.offset}" for i, (c, got) in
            enumerate(zip(shard.chunks, actual, strict=True)) if got != c.sha256]


def validation_problems(
    ckpt_dir: Path, *, world_size: int, verify_ranks: tuple[int, ...] | None, verify_checksums: bool
) -> list[str]:
    """Why `ckpt_dir` cannot be resumed at `world_size` (empty list: it can).

    Sizes of all shards are always checked; chunk checksums only for `verify_ranks` (None: all),
    so each rank can hash just its own shard.
    """
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError as exc:
        return [str(exc)]
    problems = []
    if manifest.world_size != world_size:
        problems.append(
            f"{ckpt_dir.name}: written by {manifest.world_size} ranks, this job has {world_size}"
        )
    if step_of(ckpt_dir.name) != manifest.step:
        problems.append(f"{ckpt_dir.name}: manifest says step {manifest.step}")
    for shard in manifest.shards:
        path = ckpt_dir / shard.file
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            problems.append(f"{ckpt_dir.name}: shard {shard.file} is missing")
            continue
        if size != shard.bytes:
            problems.append(f"{ckpt_dir.name}: shard {shard.file} has {size} bytes, "
                            f"manifest says {shard.bytes}")
            continue
        wanted = verify_ranks is None or shard.rank in verify_ranks
        if verify_checksums and wanted and (bad := checksum_problems(path, shard)):
            problems.append(f"{ckpt_dir.name}: shard {shard.file} fails its sha256 "
                            f"({len(bad)} of {len(shard.chunks)} chunks: {', '.join(bad[:3])})")
    return problems


def committed_checkpoints(root: Path) -> list[Path]:
    """Directories with a manifest, newest step first (ties: newest manifest first)."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = step_of(entry.name)
        manifest = entry / MANIFEST
        if step is not None and manifest.is_file():
            found.append((step, manifest.stat().st_mtime, entry))
    found.sort(key=lambda item: (item[0], item[1]), reverse=True)
    return [entry for _, _, entry in found]


def newest_valid_checkpoint(
    root: Path, *, world_size: int, verify_checksums: bool = True
) -> tuple[Path | None, list[str]]:
    """Single-process view (tools, tests): the checkpoint a resume would pick, and the rejects."""
    rejected: list[str] = []
    for ckpt_dir in committed_checkpoints(root):
        problems = validation_problems(
            ckpt_dir, world_size=world_size, verify_ranks=None, verify_checksums=verify_checksums
        )
        if not problems:
            return ckpt_dir, rejected
        rejected.extend(problems)
    return None, rejected


def commit(ckpt_dir: Path, *, step: int, world_size: int, identity: str) -> Manifest | None:
    """Rank 0: write the manifest if every rank's shard record is there; else None."""
    records = []
    for rank in range(world_size):
        path = ckpt_dir / shard_record_name(rank, world_size)
        if not path.is_file():
            return None
        record = ShardRecord.from_json(json.loads(path.read_text()))
        if record.rank != rank:
            raise CheckpointError(f"{path} is rank {record.rank}'s record")
        records.append(record)
    manifest = Manifest(step=step, world_size=world_size, shards=tuple(records),
                        committed_at=time.time(), identity=identity)
    write_json_atomic(ckpt_dir / MANIFEST, manifest.to_json())
    return manifest


_TRASH_PREFIX = ".deleting-"


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def prune(root: Path, *, keep: int, delete: Callable[[Path], object] = _remove_tree) -> list[Path]:
    """Delete committed checkpoints beyond the newest `keep`, and abandoned uncommitted ones
    (older than the newest committed). Returns what was deleted.

    Each doomed directory is first renamed to `.deleting-<name>` (instant; resume no longer sees
    it), then handed to `delete`, which may be slow (unlinking an 11 GB shard took ~4 s on an
    ext4 volume with `discard`), so the Checkpointer passes a background deleter. Leftover
    `.deleting-*` directories (a process died mid-delete) are handed to `delete` again."""
    committed = committed_checkpoints(root)
    doomed = committed[keep:]
    leftovers = []
    if committed:
        newest = step_of(committed[0].name) or 0
        for entry in root.iterdir():
            step = step_of(entry.name)
            if step is not None and step <= newest and not (entry / MANIFEST).exists():
                doomed.append(entry)
            elif entry.name.startswith(_TRASH_PREFIX):
                leftovers.append(entry)
    for entry in doomed:
        trash = entry.with_name(_TRASH_PREFIX + entry.name)
        try:
            os.rename(entry, trash)
        except OSError:
            trash = entry  # e.g. a leftover of the same name: delete it where it is
        delete(trash)
    for entry in leftovers:
        delete(entry)
    return doomed


class _BackgroundDeleter:
    """Deletes directories one after another on a daemon thread, off the step loop."""

    def __init__(self) -> None:
        self._queue: queue.Queue[Path] = queue.Queue()
        self._thread: threading.Thread | None = None

    def __call__(self, path: Path) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="rtj-checkpoint-deleter",
                                            daemon=True)
            self._thread.start()
        self._queue.put(path)

    def _run(self) -> None:
        while True:
            path = self._queue.get()
            try:
                _remove_tree(path)
            finally:
                self._queue.task_done()

    def drain(self) -> None:
        """Wait until everything handed over so far is deleted."""
        self._queue.join()


# ---------------------------------------------------------------------------------------------
# Payload: a nested state with tensors -> (skeleton, layout) + one flat byte buffer


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Placeholder for the index-th tensor of the flat buffer inside the saved skeleton."""

    index: int


@dataclass(frozen=True, slots=True)
class TensorLayout:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def flatten_state(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, torch.Tensor):
        tensors.append(tree.detach())
        return TensorSlot(len(tensors) - 1)
    if isinstance(tree, dict):
        return {key: flatten_state(value, tensors) for key, value in tree.items()}
    if isinstance(tree, list):
        return [flatten_state(value, tensors) for value in tree]
    if isinstance(tree, tuple):
        return tuple(flatten_state(value, tensors) for value in tree)
    return tree


def unflatten_state(tree: Any, tensors: list[torch.Tensor]) -> Any:
    if isinstance(tree, TensorSlot):
        return tensors[tree.index]
    if isinstance(tree, dict):
        return {key: unflatten_state(value, tensors) for key, value in tree.items()}
    if isinstance(tree, list):
        return [unflatten_state(value, tensors) for value in tree]
    if isinstance(tree, tuple):
        return tuple(unflatten_state(value, tensors) for value in tree)
    return tree


def plan_layout(tensors: list[torch.Tensor]) -> tuple[list[TensorLayout], int]:
    layout, offset = [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        layout.append(TensorLayout(offset, nbytes, tensor.dtype, tuple(tensor.shape)))
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return layout, max(offset, _ALIGN)


def tensor_views(blob: torch.Tensor, layout: list[TensorLayout]) -> list[torch.Tensor]:
    return [
        blob[item.offset : item.offset + item.nbytes].view(item.dtype).view(item.shape)
        for item in layout
    ]


class _HostStaging:
    """One reusable flat host buffer in shared memory (page-locked on CUDA)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self._registered = False

    def ensure(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() != nbytes:
            self.release()
            # Measured on an H200 host (docs/benchmarks.md): for 11.3 GB this private-then-copy
            # route + register took 3.3-3.5 s, allocating in shared memory directly
            # (`UntypedStorage._new_shared`) + register 5.6-6.4 s (registering faults the pages).
            self.buffer = torch.empty(nbytes, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
            if device.type == "cuda":
                # Page-lock the shared buffer in place: D2H copies then run at DMA speed and the
                # writer process still maps the very same memory.
                try:
                    result = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                        self.buffer.data_ptr(), nbytes, 0)
                    self._registered = int(result) == 0
                except Exception as exc:  # staging still works, only slower
                    result, self._registered = exc, False
                if not self._registered:
                    log.warning("cudaHostRegister failed (%s): staging copies are pageable", result)
        return self.buffer

    def release(self) -> None:
        if self.buffer is not None and self._registered:
            torch.cuda.cudart().cudaHostUnregister(  # type: ignore[no-untyped-call]
                self.buffer.data_ptr())
        self.buffer, self._registered = None, False


def stage_to_host(
    state: dict[str, Any], device: torch.device, staging: _HostStaging
) -> tuple[Any, list[TensorLayout], torch.Tensor]:
    """Copy every tensor of `state` into the staging buffer; returns (skeleton, layout, buffer).

    This is the whole stall of an async checkpoint: one device-to-host copy per tensor and, on
    CUDA, one synchronize.
    """
    tensors: list[torch.Tensor] = []
    skeleton = flatten_state(state, tensors)
    layout, total = plan_layout(tensors)
    buffer = staging.ensure(total, device)
    for view, tensor in zip(tensor_views(buffer, layout), tensors, strict=True):
        view.copy_(tensor, non_blocking=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return skeleton, layout, buffer


# ---------------------------------------------------------------------------------------------
# The writer (runs inside NVRx's persistent worker process, or inline in sync mode)


def _die_with_parent() -> None:
    """Make the kernel SIGKILL this writer when its trainer dies (Linux prctl)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def arm_writer(trainer_pid: int) -> None:
    """First request to a fresh NVRx writer: die with the trainer from now on."""
    _die_with_parent()
    if os.getppid() != trainer_pid:
        os._exit(0)


def encode_header(skeleton: Any, layout: list[TensorLayout], blob_bytes: int) -> bytes:
    """Magic, pickled (skeleton, layout) and zero padding up to the page-aligned data offset."""
    meta = pickle.dumps({"format": FORMAT_VERSION, "skeleton": skeleton, "layout": layout,
                         "blob_bytes": blob_bytes}, protocol=5)
    head = _SHARD_MAGIC + struct.pack("<Q", len(meta)) + meta
    return head + bytes(-len(head) % _DATA_ALIGN)


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


def _write_chunk(fd: int, data: memoryview, offset: int,
                 start_writeback: Callable[[int, int, int], object] | None) -> str:
    """Hash and pwrite one chunk (slice by slice, so the write reads cache-warm bytes)."""
    digest = hashlib.sha256()
    for begin in range(0, len(data), _SLICE_BYTES):
        piece = data[begin : begin + _SLICE_BYTES]
        digest.update(piece)
        done = 0
        while done < len(piece):
            done += os.pwrite(fd, piece[done:], offset + begin + done)
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
) -> None:
    """Write one rank's shard durably, then its record; failures leave a `.error` file instead.

    File = `encode_header(...)` then the blob's raw bytes. Chunk 0 is the header, then the blob
    in `chunk_bytes` pieces; `threads` threads hash and pwrite them; one fsync at the end.
    """
    if in_worker:
        _die_with_parent()
    if delay_seconds:
        time.sleep(delay_seconds)
    shard = Path(shard_path)
    tmp = shard.with_name(f".{shard.name}.tmp-{os.getpid()}")
    try:
        began = time.perf_counter()
        data = _byte_view(blob)
        header = encode_header(skeleton, layout, len(data))
        pieces = [(memoryview(header), 0)] + [
            (data[start : start + chunk_bytes], len(header) + start)
            for start in range(0, len(data), max(1, chunk_bytes))
        ]
        start_writeback = _start_writeback_function()
        workers = max(1, min(threads, len(pieces)))
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        try:
            if workers == 1:
                digests = [_write_chunk(fd, view, at, start_writeback) for view, at in pieces]
            else:
                with ThreadPoolExecutor(max_workers=workers) as pool:
                    digests = list(pool.map(
                        lambda item: _write_chunk(fd, item[0], item[1], start_writeback), pieces))
            written = time.perf_counter()
            os.fsync(fd)
        finally:
            os.close(fd)
        synced = time.perf_counter()
        os.replace(tmp, shard)
        _fsync_dir(shard.parent)
        total = len(header) + len(data)
        record = ShardRecord(
            rank, shard.name, total,
            tuple(ChunkDigest(at, len(view), digest)
                  for (view, at), digest in zip(pieces, digests, strict=True)),
            {"seconds": round(time.perf_counter() - began, 4),
             "write_seconds": round(written - began, 4),
             "fsync_seconds": round(synced - written, 4),
             "threads": float(workers)},
        )
        write_json_atomic(Path(record_path), record.to_json())
    except Exception as exc:  # keep the persistent worker alive; the checkpoint never commits
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            Path(record_path + ".error").write_text(repr(exc))
        if not in_worker:
            raise


def read_shard(path: Path) -> Any:
    """The state saved by `write_shard`; tensors are views of a private memory map of the file."""
    with open(path, "rb") as handle:
        head = handle.read(len(_SHARD_MAGIC) + 8)
        if len(head) < len(_SHARD_MAGIC) + 8 or head[: len(_SHARD_MAGIC)] != _SHARD_MAGIC:
            raise CheckpointError(f"{path}: not a format-{FORMAT_VERSION} shard")
        (meta_bytes,) = struct.unpack("<Q", head[len(_SHARD_MAGIC) :])
        meta = pickle.loads(handle.read(meta_bytes))
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: shard format {meta.get('format')}")
    data_offset = len(head) + meta_bytes
    data_offset += -data_offset % _DATA_ALIGN
    blob_bytes = int(meta["blob_bytes"])
    size = path.stat().st_size
    if size != data_offset + blob_bytes:
        raise CheckpointError(f"{path}: {size} bytes, expected {data_offset + blob_bytes}")
    whole = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    blob = whole[data_offset:]
    return unflatten_state(meta["skeleton"], tensor_views(blob, meta["layout"]))


# ---------------------------------------------------------------------------------------------
# The per-rank checkpointer used by the step loop


@dataclass(slots=True)
class _Pending:
    step: int
    directory: Path
    started_at: float
    stall_seconds: float
    written: bool = False
    wait_seconds: float = 0.0
    """Of the stall: waiting for this rank's previous write to finish (buffer reuse)."""
    copy_seconds: float = 0.0
    """Of the stall: staging the state into the host buffer."""


@dataclass(slots=True)
class CheckpointStats:
    """What metrics and the summary need; updated by `save` and `poll`."""

    last_stall_seconds: float = 0.0
    last_wait_seconds: float = 0.0
    last_copy_seconds: float = 0.0
    last_write_seconds: float = 0.0
    committed_step: int = -1
    committed_at: float = 0.0
    commits_this_attempt: int = 0
    newly_committed: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    directory: Path
    manifest: Manifest
    state: dict[str, Any]
    rejected: tuple[str, ...]


class Checkpointer:
    """Save/poll/load for one rank. All ranks call `save` at the same steps and `load` together;
    `poll` is local (no collectives) and is called every step."""

    def __init__(
        self,
        cfg: CheckpointConfig,
        *,
        root: Path,
        rank: int,
        world_size: int,
        device: torch.device,
        identity: str,
        on_commit: Callable[[Manifest], None] | None = None,
        keepalive: Callable[[], object] | None = None,
    ) -> None:
        self.cfg = cfg
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.identity = identity
        self.on_commit = on_commit
        self.keepalive = keepalive
        self._last_keepalive = 0.0
        """Called while the step loop is blocked waiting on I/O (heartbeats keep flowing)."""
        self.stats = CheckpointStats()
        self._pending: list[_Pending] = []
        self._staging = _HostStaging()
        self._deleter = _BackgroundDeleter()
        self._queue: Any = None
        root.mkdir(parents=True, exist_ok=True)
        newest = committed_checkpoints(root)
        if newest:
            with contextlib.suppress(CheckpointError):
                manifest = read_manifest(newest[0])
                self.stats.committed_step = manifest.step
                self.stats.committed_at = manifest.committed_at
        if cfg.mode == "async" and cfg.interval_steps:
            self._async_queue()  # spawn the writer now, not at the first save

    # -- saving ---------------------------------------------------------------------------

    def _async_queue(self) -> Any:
        if self._queue is None:
            from nvidia_resiliency_ext.checkpointing.async_ckpt.core import (
                AsyncCallsQueue,
                AsyncRequest,
            )

            self._queue = AsyncCallsQueue(persistent=True, cpu_shm_mode=True)
            # Spawn the writer now (not at the first save) and tie its life to ours at once.
            self._queue.schedule_async_request(AsyncRequest(arm_writer, (os.getpid(),), []))
        return self._queue

    def _keep_alive(self) -> None:
        now = time.monotonic()
        if self.keepalive is not None and now - self._last_keepalive > 0.5:
            self._last_keepalive = now
            self.keepalive()

    def _wait_for_local_write(self) -> None:
        """Block until this rank's in-flight writes are finalized (before reusing the buffer).
        The writer's start-up request is not waited for: a write simply queues behind it."""
        while self._queue is not None and any(not p.written for p in self._pending):
            self._queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
            if all(p.written for p in self._pending):
                break
            caller = self._queue.persistent_caller if self._queue is not None else None
            process = caller.process if caller is not None else None
            if process is not None and not process.is_alive():
                raise CheckpointError("the NVRx checkpoint writer process died")
            self._keep_alive()
            time.sleep(0.005)

    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate (and page-lock) the staging buffer for a state shaped like `state` now, so
        that the first save's stall is the copy, not a multi-GB allocation."""
        tensors: list[torch.Tensor] = []
        flatten_state(state, tensors)
        self._staging.ensure(plan_layout(tensors)[1], self.device)

    def save(self, step: int, state: dict[str, Any]) -> float:
        """Start saving `state` for `step`; returns the seconds the step loop was blocked."""
        began = time.perf_counter()
        self._wait_for_local_write()
        waited = time.perf_counter()
        directory = self.root / checkpoint_dir_name(step, self.identity)
        directory.mkdir(parents=True, exist_ok=True)
        skeleton, layout, blob = stage_to_host(state, self.device, self._staging)
        copied = time.perf_counter()
        args = (
            str(directory / shard_file_name(self.rank, self.world_size)),
            str(directory / shard_record_name(self.rank, self.world_size)),
            skeleton,
            layout,
            blob,
            self.rank,
        )
        pending = _Pending(step, directory, time.time(), 0.0,
                           wait_seconds=waited - began, copy_seconds=copied - waited)
        if self.cfg.mode == "async":
            from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

            def finalize() -> None:
                pending.written = True

            request = AsyncRequest(
                write_shard, (*args, True, self.cfg.test_write_delay_seconds), [finalize]
            )
            self._async_queue().schedule_async_request(request)
            self._pending.append(pending)
        else:
            write_shard(*args, False, self.cfg.test_write_delay_seconds)
            pending.written = True
            self._pending.append(pending)
            pending.stall_seconds = time.perf_counter() - began  # so far; the commit logs it
            dist.barrier()
            self.poll()
        pending.stall_seconds = time.perf_counter() - began
        self.stats.last_stall_seconds = pending.stall_seconds
        self.stats.last_wait_seconds = pending.wait_seconds
        self.stats.last_copy_seconds = pending.copy_seconds
        return pending.stall_seconds

    def poll(self) -> CheckpointStats:
        """Finalize finished local writes; rank 0 commits complete checkpoints; everyone notices
        commits. Cheap: a queue poll and a few stats, no collectives."""
        self.stats.newly_committed = []
        if self._queue is not None and self._queue.get_num_unfinalized_calls():
            self._queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
        while self._pending:
            pending = self._pending[0]
            manifest_path = pending.directory / MANIFEST
            if self.rank == 0:
                manifest = commit(pending.directory, step=pending.step,
                                  world_size=self.world_size, identity=self.identity)
                if manifest is None:
                    break
                self._after_commit(manifest, pending)
            elif manifest_path.exists():
                with contextlib.suppress(CheckpointError):
                    self._note_commit(read_manifest(pending.directory))
            else:
                break
            self.stats.last_write_seconds = time.time() - pending.started_at
            self._pending.pop(0)
        return self.stats

    def _note_commit(self, manifest: Manifest) -> None:
        self.stats.committed_step = manifest.step
        self.stats.committed_at = manifest.committed_at
        self.stats.commits_this_attempt += 1
        self.stats.newly_committed.append(manifest.step)

    def _after_commit(self, manifest: Manifest, pending: _Pending) -> None:
        self._note_commit(manifest)
        writers = [shard.writer for shard in manifest.shards]
        line = {
            "step": manifest.step,
            "identity": manifest.identity,
            "committed_at": manifest.committed_at,
            "bytes": sum(shard.bytes for shard in manifest.shards),
            "save_to_commit_seconds": round(manifest.committed_at - pending.started_at, 4),
            "rank0_stall": {"seconds": round(pending.stall_seconds, 4),
                            "wait_seconds": round(pending.wait_seconds, 4),
                            "copy_seconds": round(pending.copy_seconds, 4)},
            "slowest_writer": max(writers, key=lambda w: w.get("seconds", 0.0), default={}),
            "shard_bytes_max": max(shard.bytes for shard in manifest.shards),
        }
        with open(self.root / "commits.jsonl", "a") as handle:
            handle.write(json.dumps(line) + "\n")
        # ft_launcher's progress tracker reads this (--ft-checkpoint-iteration-file).
        tmp = self.root / f".latest-committed-step.tmp-{os.getpid()}"
        tmp.write_text(f"{manifest.step}\n")
        os.replace(tmp, self.root / "latest-committed-step")
        prune(self.root, keep=self.cfg.keep, delete=self._deleter)
        if self.on_commit is not None:
            self.on_commit(manifest)

    def wait_until_committed(self, timeout_seconds: float = 600.0) -> None:
        """Block until every save of this rank is committed (used at the end of training)."""
        deadline = time.monotonic() + timeout_seconds
        self._wait_for_local_write()
        while self._pending:
            self.poll()
            if not self._pending:
                break
            if time.monotonic() > deadline:
                raise CheckpointError(f"checkpoint step {self._pending[0].step} never committed")
            self._keep_alive()
            time.sleep(0.01)

    # -- loading --------------------------------------------------------------------------

    def _agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32,
                            device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def load_latest(self) -> LoadedCheckpoint | None:
        """Collective: the newest checkpoint that every rank finds valid, or None."""
        names = [[p.name for p in committed_checkpoints(self.root)]]
        dist.broadcast_object_list(names, src=0)
        rejected: list[str] = []
        for name in names[0]:
            directory = self.root / name
            problems = validation_problems(
                directory,
                world_size=self.world_size,
                verify_ranks=(self.rank,),
                verify_checksums=self.cfg.verify_checksums,
            )
            if not self._agree(not problems):
                rejected.extend(problems or [f"{name}: rejected by another rank"])
                log.warning("not resuming from %s: %s", name, problems or "another rank's shard")
                continue
            manifest = read_manifest(directory)
            state = read_shard(directory / shard_file_name(self.rank, self.world_size))
            return LoadedCheckpoint(directory, manifest, state, tuple(rejected))
        return None

    def close(self, *, abort: bool = False) -> None:
        if self._queue is not None:
            if abort:
                self._queue.close(abort=True)
            else:
                self._wait_for_local_write()
                self._queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
                self._queue.close()
            self._queue = None
        self._staging.release()
        if not abort:
            self._deleter.drain()
