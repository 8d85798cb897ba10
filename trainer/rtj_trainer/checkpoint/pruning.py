"""Pruning the checkpoint directory (rank 0, after each commit): the last `keep` committed
checkpoints of this job are kept (`prune`), and the slow delete runs off the step loop
(`BackgroundDeleter`). Prune deletes only this job's directories: a committed one names its job
in its manifest, one still being written in its owner record (`owner.json`, written by rank 0's
commit thread when the save is handed to it: `mark_owner`); a directory whose owner cannot be told
is deleted only when nothing was written in it for a long time (`UNOWNED_AFTER_SECONDS`).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path

from ..files import write_json_atomic
from .format import MANIFEST, CheckpointError, read_manifest, step_of
from .store import ABANDONED, committed_checkpoints, is_abandoned

OWNER = "owner.json"
"""Written by rank 0's commit thread into each save directory it is handed, before anything else
(`mark_owner`): which job a directory without a manifest belongs to (prune)."""
UNOWNED_AFTER_SECONDS = 3600.0
"""A directory with no manifest and no owner record (rank 0 had not marked it yet, or a trainer
before owner records wrote it) counts as given up once nothing in it changed for this long; until
then prune leaves it, since it may be another job's save in flight."""


def mark_owner(ckpt_dir: Path, *, job: str, identity: str) -> None:
    """Rank 0 (the commit thread): record that `job` (attempt `identity`) owns `ckpt_dir`."""
    write_json_atomic(ckpt_dir / OWNER, {"job": job, "identity": identity})


def uncommitted_owner(ckpt_dir: Path) -> str | None:
    """The job that owns a directory without a manifest: its owner record's, else the one that
    abandoned it; None when neither says (it cannot be told)."""
    for name in (OWNER, ABANDONED):
        try:
            data = json.loads((ckpt_dir / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and isinstance(data.get("job"), str):
            return str(data["job"])
    return None


def _last_change(ckpt_dir: Path) -> float:
    """When anything in `ckpt_dir` last changed (its own mtime and its entries')."""
    try:
        newest = ckpt_dir.stat().st_mtime
        for entry in os.scandir(ckpt_dir):
            with contextlib.suppress(OSError):
                newest = max(newest, entry.stat(follow_symlinks=False).st_mtime)
    except OSError:
        return time.time()
    return newest


_TRASH_PREFIX = ".deleting-"


def _remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)


def _identity_of(name: str) -> str:
    return name.split(".", 1)[1] if "." in name else ""


def prune(
    root: Path,
    *,
    keep: int,
    delete: Callable[[Path], object] = _remove_tree,
    protect: Path | None = None,
    current_identity: str | None = None,
    job: str | None = None,
    owners: dict[str, str] | None = None,
    unowned_after_seconds: float = UNOWNED_AFTER_SECONDS,
    now: float | None = None,
) -> list[Path]:
    """Delete this job's committed checkpoints beyond the `keep` most recently committed, and its
    uncommitted ones that can never be committed. Returns what was deleted.

    - Recency is the manifest's commit time, not the step: after a fallback (a corrupt newest
      checkpoint) or at a new world size, the checkpoints this run commits have lower steps than
      older ones, and must not be the ones deleted.
    - `protect` (the checkpoint this attempt resumed from) is never deleted.
    - An uncommitted directory of `current_identity` (this attempt's, still being written by
      some rank) is kept unless rank 0 gave it up (`abandoned`); one of another attempt (its
      writers are gone) is deleted once a newer step is committed.
    - With `job` (what the Checkpointer passes), only `job`'s directories are deleted: another
      job's committed checkpoints (their manifest names it) and saves in flight (their owner
      record names it) are left alone and do not count towards `keep`. A directory whose owner
      cannot be told (an unreadable manifest; no owner record yet) is deleted only when nothing
      in it changed for `unowned_after_seconds`. `owners` caches the manifests' jobs by
      directory name across calls (a manifest never changes). `job=None`: every directory is
      taken for this job's (tools and tests of one job's directory).

    Each doomed directory is first renamed to `.deleting-<name>` (instant; resume no longer sees
    it), then handed to `delete`, which may be slow (unlinking an 11 GB shard took ~4 s on an
    ext4 volume with `discard`), so the Checkpointer passes a background deleter. Leftover
    `.deleting-*` directories (a process died mid-delete) are handed to `delete` again."""
    now = time.time() if now is None else now
    cache = owners if owners is not None else {}

    def committed_owner(ckpt_dir: Path) -> str | None:
        if job is None:
            return None
        if ckpt_dir.name not in cache:
            try:
                cache[ckpt_dir.name] = read_manifest(ckpt_dir).job
            except CheckpointError:
                return None  # looked at again next time (it may be a transient read error)
        return cache[ckpt_dir.name]

    def forgotten(ckpt_dir: Path, since: float) -> bool:
        return now - since >= unowned_after_seconds

    committed = []
    for ckpt_dir in committed_checkpoints(root):
        owner = committed_owner(ckpt_dir)
        if job is None or owner == job or owner is None:  # another job's: not ours to count
            committed.append((ckpt_dir, owner, (ckpt_dir / MANIFEST).stat().st_mtime))
    by_commit_time = sorted(committed, key=lambda c: (c[2], step_of(c[0].name) or 0),
                            reverse=True)
    doomed = [d for d, owner, committed_at in by_commit_time[keep:]
              if (protect is None or d != protect)
              and (job is None or owner == job or forgotten(d, committed_at))]
    leftovers = []
    if committed:
        newest = max(step_of(d.name) or 0 for d, _, _ in committed)
        for entry in root.iterdir():
            step = step_of(entry.name)
            if step is not None and not (entry / MANIFEST).exists():
                current = (current_identity is not None
                           and _identity_of(entry.name) == current_identity)
                if current or job is None:
                    if is_abandoned(entry) or (not current and step <= newest):
                        doomed.append(entry)
                    continue
                owner = uncommitted_owner(entry)
                if owner == job:
                    if is_abandoned(entry) or step <= newest:
                        doomed.append(entry)
                elif owner is None and step <= newest and forgotten(entry, _last_change(entry)):
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


class BackgroundDeleter:
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
