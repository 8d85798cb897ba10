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
- **Commits happen off the step loop** (rtj_trainer.checkpoint.store.CommitWorker): rank 0's
  `poll` only hands saves to its commit thread and picks up what it resolved; the other ranks
  learn of a commit from rank 0's small `commit-progress.json` (one `stat` per step while a save
  is pending), never from the O(world size) manifest. No collectives.
- **Resume** (`load_latest`): rank 0 alone reads the manifests and scatters to each rank its own
  shard record per candidate (one collective); each rank checks only its own shard, and they
  agree with one all-reduce per candidate, falling back to the previous checkpoint if any rank
  finds a problem.
- **A node-local fast tier** (`checkpoint.local_dir`, off by default; rtj_trainer.checkpoint.local):
  the writer also keeps each save in RAM on the node, and `load_latest` first asks every rank
  which local copies it holds; the newest one they all hold (if not older than the newest commit)
  is loaded from RAM, without reading or hashing the shared store.
- **A synchronous mode for comparison** writes in the training process, then barriers and commits.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..carry import CarryOver
from ..config import CheckpointConfig
from ..errors import ForeignCheckpointError, WorldSizeChangedError
from ..nvrx import asyncwriter
from .format import (
    CheckpointError,
    Manifest,
    ShardRecord,
    checkpoint_dir_name,
    encode_skeleton,
    read_shard,
    shard_file_name,
    shard_record_name,
    step_of,
)
from .local import (
    LocalCopy,
    common_newest,
    discard_local_copies,
    local_copies,
    local_copy_dir,
    remove_partial_copies,
)
from .staging import (
    HostStaging,
    Staged,
    flatten_state,
    plan_layout,
    stage_to_host,
    tensor_views,
    unflatten_state,
)
from .store import (
    BackgroundDeleter,
    CommitOutcome,
    CommitProgressReader,
    CommitWorker,
    ResumePlan,
    append_commit_log,
    prune,
    read_committed,
    refuse_foreign_checkpoints,
    refuse_other_world_size,
    resume_plans,
    shard_problems,
    write_latest_committed_step,
)
from .writer import arm_writer, write_shard

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
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
    abandoned: int = 0
    """Checkpoints given up because a rank's shard write failed (later ones still commit)."""
    newly_committed: list[int] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    directory: Path
    """The checkpoint's directory on the shared store (it need not exist for a local copy)."""
    committed: bool
    """False for a node-local copy of a step not (yet) committed."""
    state: dict[str, Any]
    rejected: tuple[str, ...]
    source: str = "store"
    """"store" (the shared store), "local" (every rank's node-local copy), "memory" (every
    rank's staging buffer, after an in-process restart) or "live" (the same, holding the training
    state the interrupted attempt had reached: `stage_live`)."""


class ProcessWriter:
    """The process's one NVRx persistent writer (rtj_trainer.nvrx.asyncwriter), kept across
    in-process restarts while idle, in the process's `CarryOver` (rtj_trainer.carry).

    Why: NVRx's writer is a spawned Python process that imports torch, seconds of CPU. Every
    in-process restart used to kill each rank's writer (the wrapper's
    `AbortPersistentCheckpointProcesses`) and spawn a new one in the next attempt, so a warm
    spare's takeover put one such start-up per rank on the cores exactly while the new attempt
    built its process group and ran its first step (measured on the 2-core CPU benchmark: the
    first step took 2 s instead of 0.2 s, and once a gloo collective timed out and cost a
    second restart). Now an attempt that ends by an in-process restart hands its writer back
    when no write is in flight (`Checkpointer.close(abort=True)`: the next attempt stages into
    the same buffer, so a writer still reading it is killed as before), the next attempt takes
    it, and a process can start its writer before its first attempt (`prestart`: a warm spare
    does it while it waits)."""

    def __init__(self, carry: CarryOver) -> None:
        self.carry = carry

    def prestart(self, rank: int) -> None:
        """Spawn this process's writer now (once)."""
        if self.carry.writer is None:
            self.carry.writer = asyncwriter.spawn(rank, arm_writer)

    def stopped_busy(self, rank: int) -> None:
        """The writer of `rank` was stopped mid-write: replace it (`start_replacement`)."""
        self.carry.writer_to_replace = rank

    def start_replacement(self) -> None:
        """Start the replacement of a writer stopped mid-write, so that the next attempt's first
        save does not queue behind its start-up (seconds of imports: on two CPU cores a rank
        waited 5 s for it at its second save, its peer's gloo collective timed out, and the
        attempt restarted again). Called from the wrapper's finalize step."""
        rank, self.carry.writer_to_replace = self.carry.writer_to_replace, None
        if rank is not None:
            self.prestart(rank)

    def take(self, rank: int) -> Any:
        """The kept writer if it still runs, else a new one."""
        self.carry.writer_to_replace = None
        queue, self.carry.writer = self.carry.writer, None
        if queue is not None and asyncwriter.alive(queue):
            return queue
        if queue is not None:
            with contextlib.suppress(Exception):
                queue.close(abort=True)
        return asyncwriter.spawn(rank, arm_writer)

    def keep(self, queue: Any) -> None:
        """Hand back an idle writer for the next attempt of this process."""
        if self.carry.writer is not None and self.carry.writer is not queue:
            with contextlib.suppress(Exception):
                self.carry.writer.close(abort=True)
        self.carry.writer = queue


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
        self._pending: list[_Pending] = []
        self._resumed_from: Path | None = None
        """The checkpoint this attempt loaded: prune never deletes it."""
        self.carry = carry if carry is not None else CarryOver()
        """What this process's attempts hand on to each other (rtj_trainer.carry)."""
        self._writers = ProcessWriter(self.carry)
        self._staging = HostStaging.of(self.carry)
        self._deleter = BackgroundDeleter()
        self._queue: Any = None
        self._local: Path | None = None
        if cfg.local_dir:
            self._local = local_copy_dir(Path(cfg.local_dir), root, rank, world_size)
            remove_partial_copies(self._local)  # no writer of this rank runs yet
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
        if self._queue is None:
            return False
        try:
            self._queue.maybe_finalize_async_calls(blocking=False, no_dist=True)
        except Exception:  # a failed write, a writer gone: not one to keep
            return False
        return asyncwriter.alive(self._queue) and all(p.written for p in self._pending)

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
            if asyncwriter.died(self._queue):
                raise CheckpointError("the NVRx checkpoint writer process died")
            self._keep_alive()
            time.sleep(0.005)

    def prepare(self, state: dict[str, Any]) -> None:
        """Allocate (and page-lock) the staging buffer for a state shaped like `state` now, so
        that the first save's stall is the copy, not a multi-GB allocation."""
        tensors: list[torch.Tensor] = []
        # A state that is not plain data fails here, once, not in every writer (format docstring).
        encode_skeleton(flatten_state(state, tensors))
        self._staging.ensure(plan_layout(tensors)[1], self.device)

    def save(self, step: int, state: dict[str, Any], *, local_copy: bool = True) -> float:
        """Start saving `state` for `step`; returns the seconds the step loop was blocked.
        `local_copy=False`: write no node-local copy of this save (the run's last save: the
        copies are discarded once it is committed, so writing one only delays the commit)."""
        began = time.perf_counter()
        self._wait_for_local_write()
        waited = time.perf_counter()
        directory = self.root / checkpoint_dir_name(step, self.identity)
        directory.mkdir(parents=True, exist_ok=True)
        skeleton, layout, blob = stage_to_host(state, self.device, self._staging)
        self._staging.staged = Staged(step, self.identity, self.rank, self.world_size, skeleton,
                                      layout)
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
        writer = write_shard
        if self._local is not None and local_copy:
            writer = functools.partial(write_shard,
                                       local_copy=(str(self._local), step, self.identity))
        if self.cfg.mode == "async":

            def finalize() -> None:
                pending.written = True

            request = asyncwriter.request(
                writer, (*args, True, self.cfg.test_write_delay_seconds), [finalize])
            self._async_queue().schedule_async_request(request)
            self._pending.append(pending)
        else:
            writer(*args, False, self.cfg.test_write_delay_seconds)
            pending.written = True
            self._pending.append(pending)
            pending.stall_seconds = time.perf_counter() - began  # so far; the commit logs it
            dist.barrier()
            if self.rank == 0:
                self.wait_until_committed()  # sync mode: the commit is part of the save
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

    def stage_live(self, step: int, state: dict[str, Any]) -> None:
        """Stage `state` (no collective) into the staging buffer as the save of `step`, nothing
        written anywhere. Every rank that does so at the same step lets the next attempt resume
        from there (`_load_staged`), with no step computed again. A write still reading the
        buffer is stopped first (as `close(abort=True)` would stop it). Cut short, the buffer
        holds no save at all, and the next attempt resumes from a copy on disk."""
        if self._queue is not None and not self._writer_idle():
            self._stop_busy_writer()
        skeleton, layout, _ = stage_to_host(state, self.device, self._staging)
        self._staging.staged = Staged(step, self.identity, self.rank, self.world_size, skeleton,
                                      layout, live=True)

    def _stop_busy_writer(self) -> None:
        """Stop this rank's writer, which is still writing from the staging buffer; its
        replacement starts at the wrapper's finalize step (`ProcessWriter.start_replacement`).
        Said once the writer is stopped, right before the queue is dropped: a stop cut short by
        an in-process restart's exception is done again by `close_interrupted`, and said then
        (it was said twice when the line came first)."""
        with contextlib.suppress(Exception):
            self._queue.close(abort=True)
        self._writers.stopped_busy(self.rank)
        log.info("checkpoint writer stopped: a write was in flight", extra={"rank": self.rank})
        self._queue = None

    def poll(self) -> CheckpointStats:
        """Finalize finished local writes and notice commits. Cheap and local: on rank 0 a queue
        hand-over to the commit thread and a drain of its results (no file access); on the
        other ranks one `stat` of `commit-progress.json` while a save is pending."""
        self.stats.newly_committed = []
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
                                           after_commit=self._record_commit)
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

    def _abandoned(self, pending: _Pending, errors: list[str]) -> None:
        self.stats.abandoned += 1
        log.warning("checkpoint of step %d will not be committed (a shard write failed: %s); "
                    "later checkpoints still commit", pending.step, "; ".join(errors))

    def _note_commit(self, step: int, committed_at: float, directory: Path) -> None:
        self.stats.committed_step = step
        self.stats.committed_at = committed_at
        self.stats.committed_dir = directory
        self.stats.commits_this_attempt += 1
        self.stats.newly_committed.append(step)

    def _record_commit(self, manifest: Manifest, pending: _Pending) -> None:
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
              current_identity=self.identity)

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
        """Collective: the newest checkpoint that every rank finds valid, or None.

        Rank 0 alone lists the store and reads the manifests (`store.resume_plans`), then
        scatters to each rank the candidates and its own shard records (one collective); each
        rank checks only its own shard, and one all-reduce per candidate agrees."""
        plans: list[Any] | None = None
        if self.rank == 0:
            try:
                committed = read_committed(self.root)  # every manifest read once
                refuse_foreign_checkpoints(self.root, job=self.job, accepted=self.accepted_jobs,
                                           committed=committed)
                refuse_other_world_size(self.root, world_size=self.world_size,
                                        committed=committed)
                plans = resume_plans(self.root, world_size=self.world_size, committed=committed)
            except (ForeignCheckpointError, WorldSizeChangedError) as exc:
                plans = [(type(exc).__name__, str(exc))] * self.world_size
        received: list[Any] = [None]
        dist.scatter_object_list(received, plans, src=0)
        plan = received[0]
        if not isinstance(plan, ResumePlan):
            kind, message = plan
            if kind == ForeignCheckpointError.__name__:
                raise ForeignCheckpointError(message)
            raise WorldSizeChangedError(message)
        return self.load_from_plan(plan)

    def load_from_plan(self, plan: ResumePlan) -> LoadedCheckpoint | None:
        """This rank's part of `load_latest` once it holds its plan (all ranks call it
        together: one all-gather of what each rank holds in memory and on its node, then one
        all-reduce per candidate tried)."""
        if plan.committed is not None and self.stats.committed_step < 0:
            self.stats.committed_step, self.stats.committed_at = plan.committed
        records = dict(zip((name for name, _ in plan.candidates), plan.records, strict=True))
        newest_committed = max((step_of(n) or -1 for n, _ in plan.candidates), default=-1)
        # One all-gather for both fast sources: what each rank holds in memory and on its node.
        copies = local_copies(self._local) if self._local is not None else []
        held: list[Any] = [None] * self.world_size
        dist.all_gather_object(held, (self._staged_here(), [(c.step, c.identity)
                                                            for c in copies]))
        staged = self._load_staged(newest_committed, records, [h[0] for h in held])
        if staged is not None:
            return staged
        if self._local is not None:
            local = self._load_local(newest_committed, records, [h[1] for h in held], copies)
            if local is not None:
                return local
        rejected: list[str] = []
        for (name, verdict), data in zip(plan.candidates, plan.records, strict=True):
            directory = self.root / name
            if verdict:  # rank 0 refused the manifest: every rank knows, no agreement needed
                rejected.append(verdict)
                log.warning("not resuming from %s: %s", name, verdict)
                continue
            problems = self.own_shard_problems(directory, data)
            if not self._agree(not problems):
                rejected.extend(problems or [f"{name}: rejected by another rank"])
                log.warning("not resuming from %s: %s", name, problems or "another rank's shard")
                continue
            try:  # a shard whose header is not plain data (format docstring) is refused here
                state: dict[str, Any] | None = read_shard(
                    directory / shard_file_name(self.rank, self.world_size))
                problem = ""
            except CheckpointError as exc:
                state, problem = None, str(exc)
            if not self._agree(state is not None):
                rejected.append(problem or f"{name}: another rank could not read its shard")
                log.warning("not resuming from %s: %s", name, rejected[-1])
                continue
            assert state is not None
            self._resumed_from = directory
            return LoadedCheckpoint(directory, True, state, tuple(rejected))
        return None

    def own_shard_problems(self, directory: Path, data: dict[str, Any] | None) -> list[str]:
        """Check this rank's shard in `directory` against the record rank 0 sent (`data`)."""
        try:
            if data is None:
                raise CheckpointError(f"{directory.name}: no record for rank {self.rank}")
            record = ShardRecord.from_json(data)
            if record.rank != self.rank:
                raise CheckpointError(f"{directory.name}: rank {record.rank}'s record was sent")
        except (CheckpointError, KeyError, TypeError, ValueError) as exc:
            return [str(exc)]
        return shard_problems(directory, record, verify_checksums=self.cfg.verify_checksums)

    def _staged_here(self) -> list[tuple[int, str]]:
        """The save this rank holds in its staging buffer, as (step, identity), if any."""
        staged = self._staging.staged
        if staged is not None and (staged.rank, staged.world_size) == (self.rank,
                                                                      self.world_size):
            return [(staged.step, staged.identity)]
        return []

    def _load_staged(
        self, newest_committed: int, records: dict[str, dict[str, Any] | None],
        held: list[Any],
    ) -> LoadedCheckpoint | None:
        """The save every rank still holds in its staging buffer (this process's, kept across
        in-process restarts; `held`: every rank's `_staged_here`), if not older than the newest
        commit, or None. The state's tensors are views of the buffer: loading copies them into
        the model and the optimizer (parallel.load_local_state), and the buffer is not written
        again before the next save."""
        staged = self._staging.staged
        chosen = common_newest(held, at_least=max(newest_committed, 0))
        buffer = self._staging.buffer
        if chosen is None or staged is None or buffer is None:
            return None
        directory = self.root / checkpoint_dir_name(*chosen)
        state = unflatten_state(copy.deepcopy(staged.skeleton),
                                tensor_views(buffer, staged.layout))
        self._resumed_from = directory
        return LoadedCheckpoint(directory, records.get(directory.name) is not None, state, (),
                                source="live" if staged.live else "memory")

    def _load_local(
        self, newest_committed: int, records: dict[str, dict[str, Any] | None],
        held: list[Any], mine: list[LocalCopy],
    ) -> LoadedCheckpoint | None:
        """Collective (one agreement): the newest node-local copy every rank holds (`held`:
        every rank's copies, `mine`: this rank's), if not older than the newest commit (and,
        for a committed step, the size its manifest records), or None."""
        chosen = common_newest(held, at_least=max(newest_committed, 0))
        if chosen is None:
            return None
        step, identity = chosen
        copy = next(c for c in mine if (c.step, c.identity) == chosen)
        directory = self.root / checkpoint_dir_name(step, identity)
        state: dict[str, Any] | None = None
        problem = ""
        committed = False
        try:
            if (data := records.get(directory.name)) is not None:
                committed = True
                expected = int(data["bytes"])
                if copy.path.stat().st_size != expected:
                    raise CheckpointError(f"{copy.path.name}: {copy.path.stat().st_size} bytes, "
                                          f"the manifest records {expected}")
            state = read_shard(copy.path)
        except (CheckpointError, OSError) as exc:
            problem = str(exc)
        if not self._agree(state is not None):
            log.warning("not resuming from the node-local copies of step %d: %s", step,
                        problem or "another rank could not read its copy")
            return None
        assert state is not None
        self._resumed_from = directory
        return LoadedCheckpoint(directory, committed, state, (), source="local")

    def discard_local_copies(self) -> None:
        """The job finished: free this rank's node-local copies."""
        if self._local is not None:
            discard_local_copies(self._local)

    def close(self, *, abort: bool = False) -> None:
        """Stop the commit thread and the writer (`abort`: an in-process restart; an idle
        writer is kept for the next attempt, a busy one stopped) and, unless `abort`, release
        the staging buffer. Every step may run again: an in-process restart can interrupt it
        (NVRx's monitor thread raises into the main thread again and again once its soft
        timeout passed), and `close_interrupted` finishes it once nothing interrupts any more."""
        if self._committer is not None:
            self._committer.stop()
            self._committer = None
        if self._queue is not None:
            if abort and self._writer_idle():
                self._writers.keep(self._queue)  # the next attempt's (ProcessWriter)
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


def expect_offer(carry: CarryOver, offer: Callable[[], object] | None) -> None:
    """Register how the attempt now running offers its training state (it calls
    `Checkpointer.offer_live` when that state is intact), or withdraw it (None: the attempt ended
    cleanly or for good). `stage_offered` calls it when the attempt offered nothing itself.

    The attempt cannot be relied on to make the offer from its own exception handler: once NVRx's
    monitor thread has raised its restart into the main thread and the main thread has not reached
    the wrapper within the soft timeout (a rank stuck in one long C call, such as a slow step
    blocked past twice the soft timeout), the monitor raises again and again until it does, and one
    of those exceptions can land inside the handler and cut the offer short: the next attempt then
    went back to the last save and computed steps again."""
    carry.offer = offer


def stage_offered(carry: CarryOver) -> int | None:
    """Stage the training state an interrupted attempt offered (`Checkpointer.offer_live`, or the
    offer registered with `expect_offer`, made here), so that the next attempt can resume from
    it: called where no asynchronous exception of NVRx's monitor thread can land any more (the
    wrapper's finalize step, after `close_interrupted`), and before a new attempt builds its
    checkpointer. Returns the step staged, if any."""
    # Each entry is removed only once its work is done: a call cut short (an exception of NVRx's
    # that was already pending when its monitor thread stopped) leaves it to the next call,
    # which the next attempt makes before it builds its checkpointer (Trainer.__init__).
    if carry.offered is None and carry.offer is not None:
        try:
            carry.offer()
        except Exception as exc:  # the restart goes on: the next attempt resumes from a copy
            log.warning("could not offer the interrupted attempt's training state: %s", exc)
    carry.offer = None
    if carry.offered is None:
        return None
    checkpointer, step, state = carry.offered  # offer_live keeps at most one
    began = time.perf_counter()
    try:
        checkpointer.stage_live(step, state)
    except Exception as exc:  # the restart goes on: the next attempt resumes from a copy
        carry.offered = None
        log.warning("could not keep the training state after step %d in memory: %s", step, exc,
                    extra={"rank": checkpointer.rank})
        return None
    carry.offered = None
    log.info("kept the training state after step %d in memory for the next attempt (%.3f s)",
             step, time.perf_counter() - began, extra={"rank": checkpointer.rank})
    return step


def close_interrupted(carry: CarryOver) -> int:
    """Finish, as an abort, every close() an in-process restart interrupted (or never reached):
    keep an idle writer for the next attempt, stop a busy one, stop a commit thread. Called
    after NVRx's monitor thread stopped raising (the wrapper's finalize step) and before a new
    attempt builds its checkpointer. Returns how many there were."""
    unclosed = list(carry.unclosed)
    for checkpointer in unclosed:
        try:
            checkpointer.close(abort=True)
        except Exception as exc:  # the next one still gets closed
            log.warning("closing an interrupted checkpointer failed: %s", exc,
                        extra={"rank": checkpointer.rank})
            with contextlib.suppress(ValueError):
                carry.unclosed.remove(checkpointer)
    return len(unclosed)
