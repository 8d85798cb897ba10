"""Node-local copies of each rank's newest saves (e.g. in /dev/shm), the fast tier of a resume.

Why: a committed checkpoint on the shared store is seconds behind the save (a 1B model's shard
takes 5-10 s to write), and reading it back means reading and hashing GBs from that store. After
a restart in the same pod (in-process, or an ft_launcher restart of the workers) every rank's
node still holds what it staged. So the writer first copies the staged shard into a file in
`checkpoint.local_dir` (RAM on /dev/shm: about a second for GBs), then writes the shared store as
before. A resume uses the newest step that EVERY rank has a local copy of, written in the same
attempt (same checkpoint identity, hence the same step of the same training line), when that step
is at least the newest committed one; otherwise the shared store, as before. A rank that lost its
node (a replaced pod, a spare taking over) has no copy, so everyone falls back to the store.

A local copy is a shard file in the store's format (`format.read_shard` reads it), written to a
temporary name and renamed, so a copy that exists is complete; the newest `LOCAL_KEEP` are kept
per rank (two, so that a rank killed while writing its next copy still shares the previous one
with the others). Copies live under `<local_dir>/<scope>/rank-RRRRR-of-WWWWW/` where the scope is
derived from the shared store's path, so two jobs on one node never see each other's copies.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .format import WRITE_CHUNK_BYTES, WRITE_THREADS, checkpoint_dir_name

LOCAL_KEEP = 2
DEVICE_COPY_RECORD = "device-copy.json"
"""The record of the snapshot a device keeper holds (rtj_trainer.checkpoint.devicecopy)."""
_COPY_PATTERN = re.compile(r"^step-(\d{9})\.(.+)\.bin$")
SPARE_NAME = ".spare.bin"
"""A copy's file given up before it was whole (a snapshot cut short by an in-process restart,
a temporary left by a killed process), kept for the next snapshot to write over
(`publish_local_copy`): deleting an 11.3 GB file on /dev/shm takes about a second while the
kernel frees its pages, which sat on the restart's critical path (docs/benchmarks.md, issue
#32's table at one commit), and a new file's pages would all be faulted in again. Never a copy:
`local_copies` does not see it."""


@dataclass(frozen=True, slots=True, order=True)
class LocalCopy:
    step: int
    identity: str
    path: Path


def local_copy_dir(local_root: Path, store_root: Path, rank: int, world_size: int) -> Path:
    """This rank's folder of local copies for the checkpoints of `store_root`."""
    scope = hashlib.sha256(str(store_root.resolve()).encode()).hexdigest()[:16]
    return local_root / scope / f"rank-{rank:05d}-of-{world_size:05d}"


def local_copy_name(step: int, identity: str) -> str:
    return checkpoint_dir_name(step, identity) + ".bin"


def local_copies(directory: Path) -> list[LocalCopy]:
    """The complete local copies in `directory`, newest step first."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            match = _COPY_PATTERN.match(entry.name)
            if match:
                found.append(LocalCopy(int(match.group(1)), match.group(2), Path(entry.path)))
    return sorted(found, reverse=True)


def remove_partial_copies(directory: Path, *, keep_spare: bool = True) -> None:
    """Clear the temporaries left by a writer that died mid-copy (call while no writer runs):
    one is kept as the spare file (`SPARE_NAME`) unless there is one already, the others are
    deleted on a daemon thread, off the restart's critical path. `keep_spare=False` (the job
    finished, or no snapshot thread would write over a spare): every one, the spare too, is
    deleted before this returns."""
    spare = directory / SPARE_NAME
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            if not entry.name.startswith(".") or (keep_spare and entry.name == SPARE_NAME):
                continue
            with contextlib.suppress(OSError):
                if not keep_spare:
                    os.unlink(entry.path)
                elif ".tmp-" in entry.name and not spare.exists():
                    os.replace(entry.path, spare)
                else:
                    _delete_later(directory, Path(entry.path))


def drop_spare(directory: Path) -> None:
    """Delete the spare file on a daemon thread (no snapshot thread will write over it)."""
    if (directory / SPARE_NAME).exists():
        _delete_later(directory, directory / SPARE_NAME)


def _set_aside(directory: Path, tmp: Path) -> None:
    """Keep `tmp`, a temporary given up, as the spare file (an older spare is deleted on a
    daemon thread)."""
    spare = directory / SPARE_NAME
    with contextlib.suppress(OSError):
        if spare.exists():
            _delete_later(directory, spare)
        os.replace(tmp, spare)


def _delete_later(directory: Path, path: Path) -> None:
    """Rename `path` out of the way at once and delete it on a daemon thread: freeing a file of
    GBs on /dev/shm takes about a second. A process that exits first leaves it (its name starts
    with "."), and the next `remove_partial_copies` deletes it."""
    trash = directory / f".trash-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"
    try:
        os.replace(path, trash)
    except OSError:
        return
    threading.Thread(target=lambda: trash.unlink(missing_ok=True), name="rtj-local-delete",
                     daemon=True).start()


def write_local_copy(directory: Path, step: int, identity: str, header: bytes,
                     data: memoryview, *, threads: int = WRITE_THREADS) -> Path:
    """Write `header` + `data` as this rank's local copy of `step`, then drop older copies."""
    final, tmp = _names(directory, step, identity)
    pieces = [(memoryview(header), 0)] + [
        (data[start : start + WRITE_CHUNK_BYTES], len(header) + start)
        for start in range(0, len(data), WRITE_CHUNK_BYTES)
    ]
    with (_temporary(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC) as fd,
          ThreadPoolExecutor(max_workers=max(1, min(threads, len(pieces)))) as pool):
        list(pool.map(lambda piece: _put(fd, *piece), pieces))
    return _publish(directory, tmp, final)


def _names(directory: Path, step: int, identity: str) -> tuple[Path, Path]:
    """The final name of this rank's copy of `step`, and the temporary it is written under."""
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / local_copy_name(step, identity)
    return final, directory / f".{final.name}.tmp-{os.getpid()}"


@contextlib.contextmanager
def _temporary(tmp: Path, flags: int,
               give_up: Callable[[Path], None] | None = None) -> Iterator[int]:
    """An open descriptor of `tmp`; when the body fails the file is removed, or handed to
    `give_up`."""
    fd = os.open(tmp, flags | os.O_CLOEXEC, 0o600)
    try:
        yield fd
    except BaseException:
        os.close(fd)
        if give_up is not None:
            give_up(tmp)
        else:
            with contextlib.suppress(OSError):
                tmp.unlink()
        raise
    os.close(fd)


def _put(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _publish(directory: Path, tmp: Path, final: Path) -> Path:
    os.replace(tmp, final)
    _drop_old_copies(directory)
    return final


def _drop_old_copies(directory: Path) -> None:
    for old in local_copies(directory)[LOCAL_KEEP:]:
        with contextlib.suppress(OSError):
            old.path.unlink()


def _recycled(directory: Path, tmp: Path, size: int) -> bool:
    """Rename the spare file (`SPARE_NAME`), else this rank's oldest copy when it is not the
    newest, when it has the size wanted, to `tmp`: its pages are already in RAM, and
    overwriting them costs no page faults (a fresh file on /dev/shm of 11.3 GB: about 2.8
    million of them). The newest copy stays whole meanwhile, as it does while
    `write_local_copy` writes a new file. A spare of another size is deleted (daemon thread)."""
    spare = directory / SPARE_NAME
    with contextlib.suppress(OSError):
        if spare.stat().st_size == size:
            os.replace(spare, tmp)
            return True
        _delete_later(directory, spare)
    copies = local_copies(directory)
    if len(copies) < LOCAL_KEEP:
        return False
    oldest = copies[-1].path
    try:
        if oldest.stat().st_size != size:
            return False
        os.replace(oldest, tmp)
    except OSError:  # pruned by the writer process meanwhile
        return False
    return True


def publish_local_copy(directory: Path, step: int, identity: str, header: bytes, nbytes: int,
                       fill: Callable[[memoryview], None],
                       keep: Callable[[], bool] = lambda: True) -> Path | None:
    """Like `write_local_copy`, but `fill` writes the `nbytes` of data into the copy's memory
    map itself (a snapshot's device-to-host copy lands there directly,
    rtj_trainer.checkpoint.snapshots). `keep()` is asked before the rename: False leaves no copy
    (None). The spare's or the oldest copy's file is reused when it has the size
    (`_recycled`); a copy given up (`keep()` False, or `fill` raised) leaves its file as the
    spare."""
    final, tmp = _names(directory, step, identity)
    size = len(header) + nbytes
    recycled = _recycled(directory, tmp, size)
    flags = os.O_RDWR | os.O_CREAT | (0 if recycled else os.O_TRUNC)
    with _temporary(tmp, flags, lambda path: _set_aside(directory, path)) as fd:
        os.ftruncate(fd, size)
        _put(fd, memoryview(header), 0)
        with mmap.mmap(fd, size) as mapped:
            view = memoryview(mapped)[len(header):]
            try:
                fill(view)
            finally:
                view.release()
        kept = keep()
    if not kept:
        _set_aside(directory, tmp)
        return None
    return _publish(directory, tmp, final)


def common_newest(
    per_rank: list[list[tuple[int, str]]], *, at_least: int
) -> tuple[int, str] | None:
    """The newest (step, identity) that every rank holds, if its step is >= `at_least`."""
    if not per_rank:
        return None
    shared = set(per_rank[0]).intersection(*map(set, per_rank[1:]))
    best = max(shared, default=None)
    return best if best is not None and best[0] >= at_least else None


def drop_copies_after(copies: list[LocalCopy], step: int) -> None:
    """Delete the copies of steps after `step` (the step a resume started from)."""
    for copy in copies:
        if copy.step > step:
            with contextlib.suppress(OSError):
                copy.path.unlink()


def discard_local_copies(directory: Path) -> None:
    """Remove this rank's local copies (the job finished)."""
    for copy in local_copies(directory):
        with contextlib.suppress(OSError):
            copy.path.unlink()
    with contextlib.suppress(OSError):
        (directory / DEVICE_COPY_RECORD).unlink()  # rtj_trainer.checkpoint.devicecopy
    remove_partial_copies(directory, keep_spare=False)
    with contextlib.suppress(OSError):
        directory.rmdir()
