"""The per-rank checkpointer the step loop uses (NVRx's async writer is reached through
rtj_trainer.nvrx.asyncwriter).

Why this shape:

- **One writer per rank.** `save` stages the state into the rank's flat host buffer
  (rtj_trainer.checkpoint.staging) and hands it to NVRx's persistent writer process
  (`AsyncCallsQueue(persistent=True, cpu_shm_mode=True)`), which runs
  rtj_trainer.checkpoint.writer. The step loop is blocked only for the device-to-host copy.
- **Device differences live here only.** `cpu_shm_mode=True` keeps the writer process away from
  CUDA on every device (the writer only ever sees host memory), and the queue is polled with
  `no_dist=True`, which needs no CUDA tensor. That is the only NVRx async path that works
  unpatched on CPU (docs/nvrx.md, C1); on CUDA the staging copy is the one extra step.
- **Commits happen off the step loop** (rtj_trainer.checkpoint.committer.CommitWorker): rank 0's
  `poll` only hands saves to its commit thread and picks up what it resolved; the other ranks
  learn of a commit from rank 0's small `commit-progress.json` (one `stat` per step while a save
  is pending), never from the O(world size) manifest. No collectives. That half is
  rtj_trainer.checkpoint.tracking (`CommitTracking`, mixed in as `Resumable` is for loading).
- **Resume** (`load_latest`): rank 0 alone reads the manifests and scatters to each rank its own
  shard record per candidate (one collective); each rank checks only its own shard, and they
  agree with one all-reduce per candidate, falling back to the previous checkpoint if any rank
  finds a problem. Rank 0 first takes the directory's lock (rtj_trainer.checkpoint.lock): one
  job per `checkpoint.path`.
- **A stop's wait is bounded** (`wait_for_stop`): by the pod's termination budget, not the commit
  deadline, so a rank killed in the middle of a stop does not hold the others for 10 minutes.
- **A node-local fast tier** (`checkpoint.local_dir`, off by default; rtj_trainer.checkpoint.local):
  the writer also keeps each save in RAM on the node, and `load_latest` first asks every rank
  which local copies it holds; the newest one they all hold (if not older than the newest commit)
  is loaded from RAM, without reading or hashing the shared store.
- **Node-local snapshots between saves** (`checkpoint.local_interval_steps`, off by default):
  `snapshot` copies the state into a second buffer in device memory and a thread writes it to
  the node-local folder while training goes on (rtj_trainer.checkpoint.snapshots), never
  waiting for the writer process; with no room for that buffer (or
  `checkpoint.snapshot_device_copy` off) it stages the state like a save and the writer
  process writes only the node-local copy (writer.write_snapshot), when idle. Either way a
  snapshot never waits (`snapshot_ready`), and a resume takes it like any local copy, so a
  killed worker recomputes at most about that interval.
- **The staging buffer is allocated beside the step loop** (`prepare`, after an attempt's first
  step): allocating and page-locking GBs (3.3-3.5 s for an 11.3 GB shard on an H200 host) ran
  in the loop of every new process, after a SIGKILL's restart too, outside every recovery
  phase measured (docs/benchmarks.md). A thread does it now; the first use of the buffer (a
  save, a snapshot through the writer, an in-process restart's staging, `close`) waits for it.
- **A synchronous mode for comparison** writes in the training process, then barriers and commits.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..carry import CarryOver
from ..config import CheckpointConfig
from ..nvrx import asyncwriter
from .carried import ProcessWriter
from .committer import (
    CheckpointStats,
    CommitProgressReader,
    CommitTimeoutError,
    CommitWorker,
    barrier_until,
)
from .format import (
    CheckpointError,
    Manifest,
    checkpoint_dir_name,
    encode_skeleton,
    shard_file_name,
    shard_record_name,
)
from .loading import LoadedCheckpoint, Resumable
from .local import (
    discard_local_copies,
    local_copy_dir,
    remove_partial_copies,
)
from .lock import DirectoryLock
from .pruning import BackgroundDeleter
from .snapshots import SnapshotTaker
from .snapshotting import DeferredSave, Snapshotting, SnapshotWrite
from .staging import (
    FlatState,
    HostStaging,
    Staged,
    stage_to_host,
)
from .tracking import CommitTracking, PendingSave
from .writer import write_shard

log = logging.getLogger(__name__)


class Checkpointer(Snapshotting, CommitTracking, Resumable):
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
        job: str = "",
        accepted_jobs: tuple[str, ...] = (),
        on_commit: Callable[[Manifest], None] | None = None,
        keepalive: Callable[[], object] | None = None,
        carry: CarryOver | None = None,
    ) -> None:
        self.cfg = cfg
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.identity = identity
        self.job = job
        """This job (`format.job_identity`): every manifest it commits names it."""
        self.accepted_jobs = accepted_jobs
        """Other jobs whose checkpoints it may resume (`spec.checkpoint.resumeFromJobs`)."""
        self.on_commit = on_commit
        self.keepalive = keepalive
        self._last_keepalive = 0.0
        """Called while the step loop is blocked waiting on I/O (heartbeats keep flowing)."""
        self.stats = CheckpointStats()
        self._pending: list[PendingSave] = []
        self._resumed_from: Path | None = None
        """The checkpoint this attempt loaded: prune never deletes it."""
        self._lock: DirectoryLock | None = None
        """Rank 0's hold on the directory (taken by `load_latest`)."""
        self._owners: dict[str, str] = {}
        """The job of each committed checkpoint prune has looked at (a manifest never changes)."""
        self.carry = carry if carry is not None else CarryOver()
        """What this process's attempts hand on to each other (rtj_trainer.carry)."""
        self._writers = ProcessWriter(self.carry)
        self._staging = HostStaging.of(self.carry)
        self._deleter = BackgroundDeleter()
        self._queue: Any = None
        self._snapshot = SnapshotWrite()
        """The last snapshot's write (`snapshot`)."""
        self._deferred: DeferredSave | None = None
        """A save staged through the device copy, its write not requested yet (`save`)."""
        self._local: Path | None = None
        if cfg.local_dir:
            self._local = local_copy_dir(Path(cfg.local_dir), root, rank, world_size)
            remove_partial_copies(self._local, keep_spare=cfg.snapshots_by_thread)
        self._allocating: threading.Thread | None = None
        """The staging buffer's allocation, started by `prepare` (`_staging_allocated`)."""
        self._allocated_here = False
        """`prepare` started the staging buffer's allocation (not one carried from an earlier
        attempt of this process)."""
        self.prepare_seconds: dict[str, float] = {}
        """The newest `prepare`'s parts: `flatten` (and the skeleton's check), `snapshot_buffer`."""
        self._snapshots: SnapshotTaker | None = None
        """Snapshots through a device-memory copy and a thread (None: through the writer)."""
        if self._local is not None and cfg.snapshots_by_thread:
            self._snapshots = SnapshotTaker(self._local, device=device, rank=rank,
                                            bounce_bytes=cfg.snapshot_bounce_mib << 20)
        root.mkdir(parents=True, exist_ok=True)
        self._committer: CommitWorker | None = None
        """Rank 0's commit thread (started at the first save to commit)."""
        self._progress = CommitProgressReader(root, identity)
        """The other ranks' view of rank 0's commits."""
        self.carry.unclosed.append(self)  # until close() ran to its end (close_interrupted)
        if cfg.mode == "async" and cfg.interval_steps:
            self._async_queue()  # spawn the writer now, not at the first save

    # -- saving ---------------------------------------------------------------------------

    def _async_queue(self) -> Any:
        if self._queue is None:
            self._queue = self._writers.take(self.rank)
        return self._queue

    def _writer_idle(self) -> bool:
        """Whether this rank's writer runs and has no write of this attempt in flight (only its
        start-up request may still be unanswered: it touches no buffer)."""
        self._flush_deferred(wait=False)
        if self._queue is None or self._deferred is not None:
            return False
        try:
            self._queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
        except Exception:  # a failed write, a writer gone: not one to keep
            return False
        return asyncwriter.alive(self._queue) and self._writes_done()

    def _writes_done(self) -> bool:
        return self._snapshot.written and all(p.written for p in self._pending)

    def _keep_alive(self) -> None:
        now = time.monotonic()
        if self.keepalive is not None and now - self._last_keepalive > 0.5:
            self._last_keepalive = now
            self.keepalive()

    def _wait_for_local_write(self, deadline: float | None = None) -> None:
        """Block until this rank's in-flight writes are finalized (before reusing the buffer),
        or CommitTimeoutError past `deadline` (time.monotonic). The writer's start-up request is
        not waited for: a write simply queues behind it."""
        self._flush_deferred(wait=True)
        while self._queue is not None and not self._writes_done():
            self._queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
            if self._writes_done():
                break
            if asyncwriter.died(self._queue):
                raise CheckpointError("the NVRx checkpoint writer process died")
            if deadline is not None and time.monotonic() > deadline:
                step = next((p.step for p in self._pending if not p.written), self._snapshot.step)
                raise CommitTimeoutError(f"this rank's write of checkpoint step {step} did not "
                                         "finish in time")
            self._keep_alive()
            time.sleep(0.005)

    def prepare(self, state: dict[str, Any]) -> None:
        """Start allocating (and page-locking) the staging buffer for a state shaped like
        `state` in a thread, so that neither the step loop nor the first save's stall pays for
        a multi-GB allocation (`_staging_allocated` waits for it)."""
        began = time.perf_counter()
        flat = FlatState.of(state)
        # A state that is not plain data fails here, once, not in every writer (format docstring).
        encode_skeleton(flat.skeleton)
        total = flat.total
        flattened = time.perf_counter()
        if self._snapshots is not None:
            self._snapshots.prepare(total)
        self.prepare_seconds = {"flatten": round(flattened - began, 4),
                                "snapshot_buffer": round(time.perf_counter() - flattened, 4)}
        buffer = self._staging.buffer
        if self._allocating is None and (buffer is None or buffer.numel() != total):
            self._allocating = threading.Thread(target=self._allocate_staging, args=(total,),
                                                name="rtj-staging-allocation", daemon=True)
            self._allocating.start()
            self._allocated_here = True

    def _allocate_staging(self, total: int) -> None:
        try:
            if self.device.type == "cuda":  # page-locked for this rank's device, not device 0
                torch.cuda.set_device(self.device)
            self._staging.ensure(total, self.device)
        except Exception as exc:  # the first save allocates it again, and fails there if it must
            log.warning("allocating the staging buffer failed: %s", exc, extra={"rank": self.rank})

    def staging_seconds(self) -> dict[str, float]:
        """How long the staging buffer's allocation by `prepare` took, in its parts
        (`HostStaging.seconds`); empty when this checkpointer made none (the buffer came from an
        earlier attempt of the process) or it still runs."""
        if not self._allocated_here or (self._allocating is not None
                                        and self._allocating.is_alive()):
            return {}
        return {f"staging_{key}": value for key, value in self._staging.seconds.items()}

    def _staging_allocated(self) -> None:
        """Wait for `prepare`'s allocation (if one runs) before the staging buffer is used."""
        if self._allocating is not None:
            self._allocating.join()
            self._allocating = None

    def save(self, step: int, state: dict[str, Any], *, local_copy: bool = True,
             fail: str | None = None, deadline: float | None = None) -> float:
        """Start saving `state` for `step`; returns the seconds the step loop was blocked.
        `local_copy=False`: write no node-local copy of this save (the run's last save: the
        copies are discarded once it is committed, so writing one only delays the commit).
        `fail`: an injected write fault (rtj_trainer.faults.FaultInjector.write_fault).
        `deadline` (time.monotonic; a stop's): CommitTimeoutError when the previous write (or,
        in sync mode, the commit) is not done by then."""
        began = time.perf_counter()
        self._staging_allocated()
        self._wait_for_local_write(deadline)
        waited = time.perf_counter()
        directory = self.root / checkpoint_dir_name(step, self.identity)
        directory.mkdir(parents=True, exist_ok=True)
        deferred = None
        if self.defers_saves():
            assert self._snapshots is not None
            deferred = self._snapshots.stage(
                state, lambda total: self._staging.ensure(total, self.device))
        if deferred is not None:
            skeleton, layout, blob = deferred
            self._staging.staged = None  # until the thread's copy is there (_flush_deferred)
            self.stats.saves_through_device_copy += 1
        else:
            skeleton, layout, blob = stage_to_host(state, self.device, self._staging)
            self._staging.staged = Staged(step, self.identity, self.rank, self.world_size,
                                          skeleton, layout)
        copied = time.perf_counter()
        args = (
            str(directory / shard_file_name(self.rank, self.world_size)),
            str(directory / shard_record_name(self.rank, self.world_size)),
            skeleton,
            layout,
            blob,
            self.rank,
        )
        pending = PendingSave(step, directory, time.time(), 0.0,
                              wait_seconds=waited - began, copy_seconds=copied - waited)
        direct = self.cfg.direct_io
        if direct is None:
            direct = self.device.type == "cuda"
        writer: Callable[..., None] = functools.partial(write_shard, fail=fail, direct=direct)
        if self._local is not None and local_copy:
            writer = functools.partial(write_shard, fail=fail, direct=direct,
                                       local_copy=(str(self._local), step, self.identity))
        if deferred is not None:
            self._deferred = DeferredSave(pending, writer, args)
            self._pending.append(pending)
        elif self.cfg.mode == "async":
            self._request_write(writer, args, pending)
            self._pending.append(pending)
        else:
            pending.requested_at = time.time()
            writer(*args, False, self.cfg.test_write_delay_seconds)
            pending.written = True
            self._pending.append(pending)
            pending.stall_seconds = time.perf_counter() - began  # so far; the commit logs it
            barrier_until(deadline, step)
            if self.rank == 0:  # sync mode: the commit is part of the save
                self.wait_until_committed(
                    None if deadline is None else max(0.0, deadline - time.monotonic()))
            else:
                self.poll()
        pending.stall_seconds = time.perf_counter() - began
        self.stats.last_stall_seconds = pending.stall_seconds
        self.stats.last_wait_seconds = pending.wait_seconds
        self.stats.last_copy_seconds = pending.copy_seconds
        return pending.stall_seconds

    def offer_live(self, step: int, state: dict[str, Any]) -> None:
        """An in-process restart interrupted the attempt after `step` with the training state
        intact; `state` reads that state in place (parallel.live_views). Staged once nothing can
        interrupt any more (`stage_offered`, from the wrapper's finalize step)."""
        self.carry.offered = (self, step, state)

    def stage_live(self, step: int, state: dict[str, Any]) -> str:
        """Stage `state` (no collective) into the staging buffer as the save of `step`, nothing
        written anywhere. Every rank that does so at the same step lets the next attempt resume
        from there (`_load_staged`), with no step computed again. A write still reading the
        buffer is stopped first (as `close(abort=True)` would stop it). Cut short, the buffer
        holds no save at all, and the next attempt resumes from a copy on disk. With a device
        keeper holding a buffer of the state's size the state goes there instead, device to
        device (`_stage_live_on_device`). Returns where it was kept (for the log)."""
        self._staging_allocated()
        self._discard_deferred()
        if self._queue is not None and not self._writer_idle():
            self._stop_busy_writer()
        if self._stage_live_on_device(step, state):
            self._staging.staged = None  # the staging buffer's save is older: not offered
            return "in the device keeper's memory"
        skeleton, layout, _ = stage_to_host(state, self.device, self._staging)
        self._staging.staged = Staged(step, self.identity, self.rank, self.world_size, skeleton,
                                      layout, live=True)
        return "in memory"

    def _stop_busy_writer(self) -> None:
        """Stop this rank's writer, which is still writing from the staging buffer; its
        replacement starts at the wrapper's finalize step (`ProcessWriter.start_replacement`).
        Said once the writer is stopped, right before the queue is dropped: a stop cut short by
        an in-process restart's exception is done again by `close_interrupted`, and said then
        (it was said twice when the line came first)."""
        with contextlib.suppress(Exception):
            self._queue.close(abort=True)
        self._writers.stopped_busy(self.rank)
        self._snapshot.finish()  # a snapshot cut short is simply not there
        log.info("checkpoint writer stopped: a write was in flight", extra={"rank": self.rank})
        self._queue = None

    def wait_until_committed(self, timeout_seconds: float | None = None) -> None:
        """Block until every save of this rank is resolved: committed, or abandoned (the caller
        compares `stats.committed_step` with the step it needs). By default rank 0's commit
        deadline (`commit_timeout_seconds`) comes first, with a minute for the other ranks to
        read its verdict; past that, CommitTimeoutError (a CheckpointError)."""
        if timeout_seconds is None:
            timeout_seconds = self.cfg.commit_timeout_seconds + 60.0
        deadline = time.monotonic() + timeout_seconds
        self._wait_for_local_write(deadline)
        while self._pending:
            self.poll()
            if not self._pending:
                break
            if time.monotonic() > deadline:
                raise CommitTimeoutError(
                    f"checkpoint step {self._pending[0].step} never committed")
            self._keep_alive()
            time.sleep(0.01)

    def wait_for_stop(self, step: int | None, deadline: float) -> bool:
        """A stop's wait (rtj_trainer.stop): `wait_until_committed` until `deadline`
        (time.monotonic; every rank has the same one: `StopAgreement.common_budget`), not the
        commit deadline. True when every save is resolved and the stop's save of `step` (None:
        the stop saved nothing) is committed. False when it is not: a rank's shard never came
        by then (its pod was killed in the middle of the stop, a write is stuck) or the save was
        abandoned; the stop then goes on without it, and the caller must neither claim the step
        committed nor wait for it (or a peer that may be gone) again. A commit thread or writer
        that failed still raises."""
        try:
            self.wait_until_committed(max(0.0, deadline - time.monotonic()))
        except CommitTimeoutError as exc:
            log.error("the stop checkpoint of step %s was not committed in time (%s): stopping "
                      "without it; the next attempt resumes from step %d", step, exc,
                      self.stats.committed_step, extra={"rank": self.rank})
            return False
        if step is not None and self.stats.committed_step < step:
            log.error("the stop checkpoint of step %d was abandoned: stopping without it; the "
                      "next attempt resumes from step %d", step, self.stats.committed_step,
                      extra={"rank": self.rank})
            return False
        return True

    def wait_until_kept(self, step: int) -> None:
        """`wait_until_committed`, then CheckpointError unless the save of `step` is committed:
        for a save the run cannot end without (its last one), whose loss must fail the attempt
        so that a restart computes and saves it again, not end the job one interval behind."""
        self.wait_until_committed()
        if self.stats.committed_step < step:
            raise CheckpointError(
                f"the checkpoint of step {step} was abandoned (a shard write failed; newest "
                f"commit: step {self.stats.committed_step}): this attempt fails so that a "
                "restart saves it again")

    # -- loading --------------------------------------------------------------------------

    def discard_local_copies(self) -> None:
        """The job finished: free this rank's node-local copies."""
        if self._local is not None:
            if self._snapshots is not None:
                self._snapshots.close()  # none may appear after the others are gone
            discard_local_copies(self._local)

    def release_lock(self) -> None:
        """The job finished: rank 0 gives the directory's lock up (another job may use the
        directory at once, not only once the lock is stale)."""
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def close(self, *, abort: bool = False) -> None:
        """Stop the commit thread and the writer (`abort`: an in-process restart; an idle
        writer is kept for the next attempt, a busy one stopped) and, unless `abort`, release
        the staging buffer. Every step may run again: an in-process restart can interrupt it
        (NVRx's monitor thread raises into the main thread again and again once its soft
        timeout passed), and `close_interrupted` finishes it once nothing interrupts any more."""
        if abort:
            self._discard_deferred()
        else:
            self._flush_deferred(wait=True)  # its write is waited for below
        if self._snapshots is not None:
            self._snapshots.close()  # a snapshot cut short leaves no copy
        self._staging_allocated()  # never released (or kept) while being allocated
        if self._committer is not None:
            self._committer.stop()
            self._committer = None
        if self._lock is not None:
            self._lock.stop()  # the lock stays: this job's next attempt takes it over
        if self._queue is not None:
            if abort and self._writer_idle():
                self._writers.keep(self._queue)  # the next attempt's (ProcessWriter)
                # Dropped before it is said: a close cut short by an in-process restart's
                # exception after this line is not done (and said) again by close_interrupted.
                self._queue = None
                log.info("checkpoint writer kept for the next attempt (idle)",
                         extra={"rank": self.rank})
            elif abort:
                # A write may still read the staging buffer, which the next attempt reuses.
                self._stop_busy_writer()
            else:
                self._wait_for_local_write()
                self._queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
                self._queue.close()
            self._queue = None
        if not abort:
            # An aborted attempt (in-process restart) leaves the buffer to the next attempt:
            # unpinning and re-allocating GBs cost seconds on the restart's critical path.
            self._staging.release()
            self._deleter.drain()
        with contextlib.suppress(ValueError):
            self.carry.unclosed.remove(self)


__all__ = ["CheckpointStats", "Checkpointer", "CommitTimeoutError", "LoadedCheckpoint",
           "ProcessWriter"]
