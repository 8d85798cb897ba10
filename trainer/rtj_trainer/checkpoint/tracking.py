"""The commit half of a rank's checkpointer (mixed into `Checkpointer`, which sets the fields):
which of this rank's saves are written, committed or abandoned.

Rank 0 hands each written save to its commit thread (rtj_trainer.checkpoint.committer.
CommitWorker) and picks up what it resolved; the commit thread also appends the commit log,
writes ft_launcher's step file and prunes. The other ranks learn of each verdict from rank 0's
`commit-progress.json` (`CommitProgressReader`). No collectives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import CheckpointConfig
from .committer import CheckpointStats, CommitOutcome, CommitProgressReader, CommitWorker
from .format import CheckpointError, Manifest
from .lock import DirectoryLock
from .pruning import UNOWNED_AFTER_SECONDS, BackgroundDeleter, prune
from .store import append_commit_log, write_latest_committed_step

log = logging.getLogger(__name__)


@dataclass(slots=True)
class PendingSave:
    """One save of this rank, from its start until it is committed or abandoned."""

    step: int
    directory: Path
    started_at: float
    stall_seconds: float
    written: bool = False
    submitted: bool = False
    """Rank 0: handed to the commit thread."""
    wait_seconds: float = 0.0
    """Of the stall: waiting for this rank's previous write to finish (buffer reuse)."""
    copy_seconds: float = 0.0
    """Of the stall: staging the state into the host buffer."""
    requested_at: float = 0.0
    """When the write was handed to the writer (time.time()); a save staged through the device
    copy is handed over once the thread's copy into the staging buffer is done."""


def commit_phases(pending: PendingSave, manifest: Manifest, noticed_at: float) -> dict[str, float]:
    """Where a committed save's seconds went, from its start to the step loop noticing the
    commit: `staging` (until the write was handed to the writer), `queued` (until rank 0's writer
    began it), `write` and `fsync` (rank 0's shard), `record` (the rest of rank 0's write: the
    rename, the record), `commit` (until rank 0's commit thread wrote the manifest: the other
    ranks' shards and its polling), `noticed` (until the step loop read the outcome); `total`."""
    writer = next((shard.writer for shard in manifest.shards if shard.rank == 0), {})
    began = writer.get("started_at", pending.requested_at)
    seconds = writer.get("seconds", 0.0)
    phases = {
        "step": float(manifest.step),
        "staging": pending.requested_at - pending.started_at,
        "queued": began - pending.requested_at,
        "write": writer.get("write_seconds", 0.0),
        "fsync": writer.get("fsync_seconds", 0.0),
        "record": seconds - writer.get("write_seconds", 0.0) - writer.get("fsync_seconds", 0.0),
        "commit": manifest.committed_at - (began + seconds),
        "noticed": noticed_at - manifest.committed_at,
        "total": noticed_at - pending.started_at,
    }
    return {key: round(value, 4) for key, value in phases.items()}


class CommitTracking:
    """Polling this rank's saves to their verdicts (mixed into `Checkpointer`)."""

    cfg: CheckpointConfig
    root: Path
    rank: int
    world_size: int
    identity: str
    job: str
    stats: CheckpointStats
    on_commit: Callable[[Manifest], None] | None
    _pending: list[PendingSave]
    _queue: Any
    _lock: DirectoryLock | None
    _committer: CommitWorker | None
    _progress: CommitProgressReader
    _deleter: BackgroundDeleter
    _resumed_from: Path | None
    _owners: dict[str, str]

    def _flush_deferred(self, *, wait: bool) -> None:
        """Request the write of a save still being staged (Checkpointer: its saves through the
        device copy); here: none."""

    def poll(self) -> CheckpointStats:
        """Finalize finished local writes and notice commits. Cheap and local: on rank 0 a queue
        hand-over to the commit thread and a drain of its results (no file access); on the
        other ranks one `stat` of `commit-progress.json` while a save is pending."""
        self.stats.newly_committed = []
        self._flush_deferred(wait=False)
        if self._lock is not None and (lost := self._lock.lost_error()) is not None:
            raise lost  # another job took the directory over (fatal)
        if self._queue is not None and self._queue.get_num_unfinalized_calls():
            self._queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
        if not self._pending:
            return self.stats
        if self.rank == 0:
            self._poll_commits()
        else:
            self._poll_progress()
        return self.stats

    def _commit_worker(self) -> CommitWorker:
        if self._committer is None:
            self._committer = CommitWorker(self.root, world_size=self.world_size,
                                           identity=self.identity, job=self.job,
                                           after_commit=self._record_commit,
                                           timeout_seconds=self.cfg.commit_timeout_seconds)
        return self._committer

    def _poll_commits(self) -> None:
        for pending in self._pending:
            if not pending.submitted:
                self._commit_worker().submit(pending.directory, pending.step, pending)
                pending.submitted = True
        outcomes: list[CommitOutcome] = (
            self._committer.outcomes() if self._committer is not None else [])
        for outcome in outcomes:
            pending = self._pending.pop(0)
            assert pending.step == outcome.step, (pending.step, outcome.step)
            self.stats.last_write_seconds = time.time() - pending.started_at
            if outcome.failure is not None:
                raise CheckpointError(f"committing checkpoint step {outcome.step} failed: "
                                      f"{outcome.failure}") from outcome.failure
            if outcome.manifest is None:
                self._abandoned(pending, list(outcome.errors))
                continue
            self._note_commit(outcome.manifest.step, outcome.manifest.committed_at,
                              pending.directory)
            self.stats.last_commit = commit_phases(pending, outcome.manifest, time.time())
            if self.on_commit is not None:
                self.on_commit(outcome.manifest)

    def _poll_progress(self) -> None:
        self._progress.refresh()
        while self._pending:
            pending = self._pending[0]
            resolved = self._progress.outcome(pending.directory, pending.step)
            if resolved is None:
                break
            committed, committed_at = resolved
            if committed:
                self._note_commit(pending.step, committed_at, pending.directory)
            else:
                self._abandoned(pending, ["rank 0 gave this checkpoint up"])
            self.stats.last_write_seconds = time.time() - pending.started_at
            self._pending.pop(0)

    def _abandoned(self, pending: PendingSave, errors: list[str]) -> None:
        self.stats.abandoned += 1
        log.warning("checkpoint of step %d will not be committed (a shard write failed: %s); "
                    "later checkpoints still commit", pending.step, "; ".join(errors))

    def _note_commit(self, step: int, committed_at: float, directory: Path) -> None:
        self.stats.committed_step = step
        self.stats.committed_at = committed_at
        self.stats.committed_dir = directory
        self.stats.commits_this_attempt += 1
        self.stats.newly_committed.append(step)

    def _record_commit(self, manifest: Manifest, pending: PendingSave) -> None:
        """Rank 0's commit thread, right after the manifest: the commit log, the ft_launcher
        step file, and prune (the checkpoint this attempt resumed from is protected)."""
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
        append_commit_log(self.root, line)
        write_latest_committed_step(self.root, manifest.step)
        prune(self.root, keep=self.cfg.keep, delete=self._deleter, protect=self._resumed_from,
              current_identity=self.identity, job=self.job, owners=self._owners,
              unowned_after_seconds=max(UNOWNED_AFTER_SECONDS,
                                        2 * self.cfg.commit_timeout_seconds))
