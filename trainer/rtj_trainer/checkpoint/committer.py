"""Rank 0's commit thread (`CommitWorker`) and the other ranks' view of it
(`CommitProgressReader`, through `commit-progress.json`): the commit protocol of
rtj_trainer.checkpoint.store, run off the step loop.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..files import write_json_atomic
from .format import MANIFEST, CheckpointError, Manifest
from .pruning import mark_owner
from .store import abandon, commit, failed_writes, missing_records, record_listing


@dataclass(slots=True)
class CheckpointStats:
    """What metrics and the summary need; updated by `save` and `poll`."""

    last_stall_seconds: float = 0.0
    last_wait_seconds: float = 0.0
    last_copy_seconds: float = 0.0
    last_write_seconds: float = 0.0
    committed_step: int = -1
    committed_at: float = 0.0
    committed_dir: Path | None = None
    """The directory of `committed_step` when this attempt committed it (None for a checkpoint
    an earlier attempt committed)."""
    commits_this_attempt: int = 0
    saves_through_device_copy: int = 0
    """This attempt's saves staged through the snapshots' device copy (`save_device_copy`)."""
    abandoned: int = 0
    """Checkpoints given up because a rank's shard write failed (later ones still commit)."""
    newly_committed: list[int] = field(default_factory=list)
    last_commit: dict[str, float] = field(default_factory=dict)
    """Rank 0: the newest commit's phases (`tracking.commit_phases`)."""


COMMIT_PROGRESS = "commit-progress.json"
"""Rank 0's commit progress for the other ranks: how they learn of a commit (one `stat` per step,
one small read when it changed) instead of reading the manifest (O(world size)) every commit."""
_RECENT_OUTCOMES = 64


def write_commit_progress(
    root: Path, *, identity: str, outcomes: dict[int, tuple[bool, float]]
) -> None:
    """Rank 0 (the commit thread): the outcome of this attempt's newest resolved saves, step ->
    (committed, commit time); a step not committed was abandoned."""
    recent = sorted(outcomes)[-_RECENT_OUTCOMES:]
    write_json_atomic(root / COMMIT_PROGRESS, {
        "identity": identity,
        "newest": max(outcomes, default=-1),
        "outcomes": {str(step): list(outcomes[step]) for step in recent},
    })


@dataclass(slots=True)
class CommitProgressReader:
    """A non-zero rank's view of `commit-progress.json` for its own attempt (`identity`)."""

    root: Path
    identity: str
    newest: int = -1
    outcomes: dict[int, tuple[bool, float]] = field(default_factory=dict)
    _seen: tuple[int, int, int] | None = None

    def refresh(self) -> None:
        """One `stat`; the file is read only when it was replaced since the last look."""
        path = self.root / COMMIT_PROGRESS
        try:
            info = path.stat()
        except FileNotFoundError:
            return
        key = (info.st_ino, info.st_mtime_ns, info.st_size)
        if key == self._seen:
            return
        self._seen = key
        try:
            data = json.loads(path.read_text())
            if data.get("identity") != self.identity:
                return  # a previous attempt's progress: this attempt has resolved nothing yet
            self.newest = int(data["newest"])
            self.outcomes = {int(step): (bool(done), float(at))
                             for step, (done, at) in dict(data["outcomes"]).items()}
        except (OSError, ValueError, TypeError, KeyError, AttributeError):
            self._seen = None  # unreadable (not written by rank 0's writer): look again later

    def outcome(self, ckpt_dir: Path, step: int) -> tuple[bool, float] | None:
        """(committed, commit time) once rank 0 resolved `step`, else None. A step older than
        the recent outcomes the file keeps is looked up by its manifest (one `stat`)."""
        if step in self.outcomes:
            return self.outcomes[step]
        if step > self.newest:
            return None
        try:
            return True, (ckpt_dir / MANIFEST).stat().st_mtime
        except FileNotFoundError:
            return False, 0.0


@dataclass(frozen=True, slots=True)
class CommitOutcome:
    step: int
    manifest: Manifest | None
    """None: the save was abandoned (`errors`) or the commit failed (`failure`)."""
    errors: tuple[str, ...] = ()
    failure: Exception | None = None


class CommitWorker:
    """Rank 0's commits on a daemon thread, off the step loop.

    Saves are resolved one at a time in the order submitted (step order): the thread first
    records that this job owns the save's directory (`pruning.mark_owner`: prune never deletes
    another job's save in flight), then lists the directory (one `readdir`) until every rank's
    record is there, then reads each record once and writes the manifest (`commit`), runs
    `after_commit` (commit log, `latest-committed-step`, prune), and writes
    `commit-progress.json`. A save with an error record is abandoned instead,
    so it never blocks later ones; so is one still missing a record `timeout_seconds` after it
    was submitted (a write that failed without leaving its error record). The step loop only
    drains `outcomes()`: no file access."""

    def __init__(
        self,
        root: Path,
        *,
        world_size: int,
        identity: str,
        job: str,
        after_commit: Callable[[Manifest, Any], object],
        interval_seconds: float = 0.05,
        timeout_seconds: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.root = root
        self.world_size = world_size
        self.identity = identity
        self.job = job
        self.after_commit = after_commit
        self.interval_seconds = interval_seconds
        self.timeout_seconds = timeout_seconds
        self.clock = clock
        self._jobs: queue.Queue[tuple[Path, int, Any, float]] = queue.Queue()
        self._outcomes: queue.Queue[CommitOutcome] = queue.Queue()
        self._stop = threading.Event()
        self._resolved: dict[int, tuple[bool, float]] = {}
        self._thread = threading.Thread(target=self._run, name="rtj-checkpoint-commit",
                                        daemon=True)
        self._thread.start()

    def submit(self, directory: Path, step: int, context: Any = None) -> None:
        self._jobs.put((directory, step, context, self.clock()))

    def outcomes(self) -> list[CommitOutcome]:
        """The saves resolved since the last call, in submission order (never blocks)."""
        done = []
        while True:
            try:
                done.append(self._outcomes.get_nowait())
            except queue.Empty:
                return done

    def stop(self, timeout_seconds: float = 10.0) -> None:
        self._stop.set()
        self._thread.join(timeout_seconds)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                directory, step, context, submitted = self._jobs.get(timeout=0.2)
            except queue.Empty:
                continue
            with contextlib.suppress(OSError):  # best effort: prune then goes by its age
                mark_owner(directory, job=self.job, identity=self.identity)
            outcome = None
            while outcome is None and not self._stop.is_set():
                outcome = self._resolve(directory, step, context)
                if outcome is None and self.clock() - submitted > self.timeout_seconds:
                    outcome = self._give_up(directory, step)
                if outcome is None:
                    self._stop.wait(self.interval_seconds)
            if outcome is not None:
                self._outcomes.put(outcome)

    def _resolve(self, directory: Path, step: int, context: Any) -> CommitOutcome | None:
        try:
            missing, error_records = record_listing(directory, world_size=self.world_size)
            if missing and not error_records:
                return None
            if error_records:
                errors = failed_writes(directory, world_size=self.world_size)
                abandon(directory, "; ".join(errors), job=self.job)
                outcome = CommitOutcome(step, None, tuple(errors))
                self._resolved[step] = (False, 0.0)
            else:
                manifest = commit(directory, step=step, world_size=self.world_size,
                                  identity=self.identity, job=self.job)
                if manifest is None:  # a record vanished between the listing and the read
                    return None
                self.after_commit(manifest, context)
                outcome = CommitOutcome(step, manifest)
                self._resolved[step] = (True, manifest.committed_at)
            self._publish()
            return outcome
        except Exception as exc:  # handed to the step loop, which raises it (poll)
            return CommitOutcome(step, None, failure=exc)

    def _give_up(self, directory: Path, step: int) -> CommitOutcome:
        """The save of `step` is past its deadline with records missing and no error record:
        abandoned (the marker is best effort: the store may be what failed), and the other ranks
        told through `commit-progress.json`; when even that cannot be written the step loop
        raises (an attempt that cannot tell its ranks about commits restarts)."""
        ranks = missing_records(directory, world_size=self.world_size)
        reason = (f"no shard record from rank(s) {', '.join(map(str, ranks))} and no error "
                  f"record {self.timeout_seconds:g} s after the save (the write failed and "
                  "could not say so)")
        with contextlib.suppress(OSError):
            abandon(directory, reason, job=self.job)
        self._resolved[step] = (False, 0.0)
        try:
            self._publish()
        except Exception as exc:
            return CommitOutcome(step, None, (reason,), failure=exc)
        return CommitOutcome(step, None, (reason,))

    def _publish(self) -> None:
        write_commit_progress(self.root, identity=self.identity, outcomes=self._resolved)
        for old in sorted(self._resolved)[:-_RECENT_OUTCOMES]:
            del self._resolved[old]


class CommitTimeoutError(CheckpointError):
    """A wait for commits (or for this rank's own write) ran past its deadline."""


def barrier_until(deadline: float | None, step: int, *, pause: float = 0.01) -> None:
    """The synchronous save's barrier; with a stop's `deadline` (time.monotonic), given up at it
    with CommitTimeoutError: a peer SIGKILLed during the stop never comes, and every rank must
    give up within the stop's budget as the async path does (review-2 F5), not at the collective
    timeout."""
    if deadline is None:
        dist.barrier()
        return
    work = dist.barrier(async_op=True)
    assert work is not None
    while not work.is_completed():
        if time.monotonic() >= deadline:
            raise CommitTimeoutError(f"the synchronous save of step {step}: not every rank wrote "
                                     "its shard within the stop's budget")
        time.sleep(pause)
    work.wait()
