"""Resuming: which checkpoint every rank loads, from where (`Resumable`, a part of
rtj_trainer.checkpoint.Checkpointer).

Rank 0 alone reads the manifests and scatters to each rank its own shard record per candidate
(one collective); each rank checks only its own shard, and they agree with one all-reduce per
candidate, falling back to the previous checkpoint if any rank finds a problem. Before the shared
store it tries the two fast sources: the save every rank still holds in its staging buffer (after
an in-process restart) and the newest node-local copy every rank holds.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..config import CheckpointConfig
from ..errors import ForeignCheckpointError, WorldSizeChangedError
from ..keeper import client as keeper
from . import devicecopy, reshard
from .committer import CheckpointStats
from .format import (
    DEVICE_VIEW_BYTES,
    CheckpointError,
    ShardRecord,
    checkpoint_dir_name,
    read_manifest,
    read_shard,
    shard_file_name,
    step_of,
)
from .local import LocalCopy, common_newest, drop_copies_after, local_copies
from .lock import DirectoryLock
from .staging import HostStaging, tensor_views, unflatten_state
from .store import (
    ReshardPlan,
    ResumePlan,
    other_world_sizes,
    read_committed,
    refuse_foreign_checkpoints,
    reshard_plan,
    resume_plans,
    shard_problems,
)

log = logging.getLogger("rtj_trainer.checkpoint.checkpointer")


@dataclass(frozen=True, slots=True)
class LoadedCheckpoint:
    directory: Path
    """The checkpoint's directory on the shared store (it need not exist for a local copy)."""
    committed: bool
    """False for a node-local copy of a step not (yet) committed."""
    state: dict[str, Any]
    rejected: tuple[str, ...]
    source: str = "store"
    """"store" (the shared store), "resharded" (the shared store, written at another world
    size), "local" (every rank's node-local copy), "device" (the same, a snapshot every rank's
    device keeper holds: rtj_trainer.keeper), "memory" (every
    rank's staging buffer, after an in-process restart) or "live" (the same, holding the training
    state the interrupted attempt had reached: `stage_live`)."""


class Resumable:
    """The loading half of a rank's checkpointer (mixed into `Checkpointer`, which sets these)."""

    cfg: CheckpointConfig
    root: Path
    rank: int
    world_size: int
    device: torch.device
    job: str
    accepted_jobs: tuple[str, ...]
    stats: CheckpointStats
    _local: Path | None
    _staging: HostStaging
    _resumed_from: Path | None
    identity: str
    _lock: DirectoryLock | None

    def _agree(self, ok: bool) -> bool:
        flag = torch.tensor([1 if ok else 0], dtype=torch.int32,
                            device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        return bool(flag.item())

    def load_latest(self) -> LoadedCheckpoint | None:
        """Collective: the newest checkpoint that every rank finds valid, or None.

        Rank 0 first takes the directory's lock (one job per directory: rtj_trainer.checkpoint.
        lock), then alone lists the store and reads the manifests (`store.resume_plans`), then
        scatters to each rank the candidates and its own shard records (one collective); each
        rank checks only its own shard, and one all-reduce per candidate agrees. The fatal
        refusals (another job's lock or checkpoints, another world size) reach every rank
        through the same scatter."""
        plans: list[Any] | None = None
        if self.rank == 0:
            lock = None
            try:
                if self._lock is None:
                    lock = DirectoryLock(self.root, job=self.job, identity=self.identity,
                                         accepted=self.accepted_jobs)
                    lock.take()
                committed = read_committed(self.root)  # every manifest read once
                refuse_foreign_checkpoints(self.root, job=self.job, accepted=self.accepted_jobs,
                                           committed=committed)
                if other_world_sizes(self.root, world_size=self.world_size, committed=committed):
                    plans = [reshard_plan(self.root, world_size=self.world_size,
                                          committed=committed)] * self.world_size
                else:
                    plans = resume_plans(self.root, world_size=self.world_size,
                                         committed=committed)
            except (ForeignCheckpointError, WorldSizeChangedError) as exc:
                plans = [(type(exc).__name__, str(exc))] * self.world_size
                if lock is not None:
                    lock.release()  # a job that cannot start does not hold the directory
                    lock = None
            if lock is not None:
                self._lock = lock
                lock.keep_alive()
        received: list[Any] = [None]
        dist.scatter_object_list(received, plans, src=0)
        plan = received[0]
        if isinstance(plan, ReshardPlan):
            return self.load_resharded(plan)
        if not isinstance(plan, ResumePlan):
            kind, message = plan
            if kind == ForeignCheckpointError.__name__:
                raise ForeignCheckpointError(message)
            raise WorldSizeChangedError(message)
        return self.load_from_plan(plan)

    def load_resharded(self, plan: ReshardPlan) -> LoadedCheckpoint:
        """Collective: this rank's state at its world size from a checkpoint written at another
        (rtj_trainer.checkpoint.reshard): old rank 0's shard (the structure and every entry that
        is not sliced), then the old shards holding this rank's rows; each checked against its
        record first, and every rank must succeed."""
        directory = self.root / plan.name
        old: dict[int, dict[str, Any]] = {}
        problem = ""
        try:
            old[0] = self._read_old_shard(directory, plan, 0)
            needed = reshard.needed_ranks(reshard.sharding_of(old[0]),
                                          old_world_size=plan.world_size, rank=self.rank,
                                          world_size=self.world_size)
            for old_rank in needed:
                if old_rank not in old:
                    old[old_rank] = self._read_old_shard(directory, plan, old_rank)
            state = reshard.reshard(old, old_world_size=plan.world_size, rank=self.rank,
                                    world_size=self.world_size)
        except (CheckpointError, OSError, ValueError, KeyError) as exc:
            problem = f"{plan.name}: {exc}"
        if not self._agree(not problem):
            raise WorldSizeChangedError(
                f"{problem or 'another rank could not reshard the checkpoint'} (written by "
                f"{plan.world_size} ranks, this job has {self.world_size})")
        if self.stats.committed_step < 0:
            self.stats.committed_step, self.stats.committed_at = plan.committed
        self._resumed_from = directory
        log.info("resharded %s from %d ranks to %d", plan.name, plan.world_size,
                 self.world_size, extra={"rank": self.rank})
        return LoadedCheckpoint(directory, True, state, (), source="resharded")

    def _read_old_shard(self, directory: Path, plan: ReshardPlan,
                        old_rank: int) -> dict[str, Any]:
        record = ShardRecord.from_json(plan.records[old_rank])
        problems = shard_problems(directory, record, verify_checksums=self.cfg.verify_checksums)
        if problems:
            raise CheckpointError("; ".join(problems))
        state: dict[str, Any] = read_shard(directory / shard_file_name(old_rank,
                                                                       plan.world_size))
        return state

    def load_from_plan(self, plan: ResumePlan) -> LoadedCheckpoint | None:
        """This rank's part of `load_latest` once it holds its plan (all ranks call it
        together: one all-gather of what each rank holds in memory and on its node, then one
        all-reduce per candidate tried). This rank's node-local copies of later steps than the
        one resumed are then deleted: they belong to a line of training given up, and a later
        resume must never pair one of them with another rank's copy of the new line."""
        copies = local_copies(self._local) if self._local is not None else []
        kept = self._kept_copy()
        if kept is not None and self._local is not None:  # tried first for its step
            record = kept[0]
            copies.insert(0, LocalCopy(record.step, record.identity,
                                       devicecopy.record_path(self._local)))
        loaded = self._load_from_plan(plan, copies, kept)
        resumed = (step_of(loaded.directory.name) if loaded is not None else None) or 0
        drop_copies_after(copies, resumed)
        return loaded

    def _kept_copy(self) -> tuple[devicecopy.DeviceCopy, torch.Tensor] | None:
        """The snapshot this rank's device keeper holds (its record and the buffer, opened
        here), if the record names the buffer the keeper holds now."""
        if self._local is None or not keeper.configured():
            return None
        record = devicecopy.read(self._local)
        if record is None:
            return None
        lease = keeper.lease(record.nbytes, self.device, allocate=False)
        if lease is None or lease.generation != record.generation:
            return None
        return record, lease.tensor

    def _load_from_plan(self, plan: ResumePlan, copies: list[LocalCopy],
                        kept: tuple[devicecopy.DeviceCopy, torch.Tensor] | None = None,
                        ) -> LoadedCheckpoint | None:
        if plan.committed is not None and self.stats.committed_step < 0:
            self.stats.committed_step, self.stats.committed_at = plan.committed
        records = dict(zip((name for name, _ in plan.candidates), plan.records, strict=True))
        newest_committed = max((step_of(n) or -1 for n, _ in plan.candidates), default=-1)
        # One all-gather for both fast sources: what each rank holds in memory and on its node.
        held: list[Any] = [None] * self.world_size
        dist.all_gather_object(held, (self._staged_here(), [(c.step, c.identity)
                                                            for c in copies]))
        staged = self._load_staged(newest_committed, records, [h[0] for h in held])
        if staged is not None:
            return staged
        if self._local is not None:
            local = self._load_local(newest_committed, records, [h[1] for h in held], copies,
                                     kept)
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
                # On CUDA read onto the device as the node-local copies are (format.upload);
                # with checksums verified (the default) the file is in the page cache by now.
                state: dict[str, Any] | None = read_shard(
                    directory / shard_file_name(self.rank, self.world_size), device=self.device)
                problem = ""
            except CheckpointError as exc:
                state, problem = None, str(exc)
            if not self._agree(state is not None):
                rejected.append(problem or f"{name}: another rank could not read its shard")
                log.warning("not resuming from %s: %s", name, rejected[-1])
                continue
            assert state is not None
            self._resumed_from = directory
            if rejected:
                self._note_fallback(directory)
            return LoadedCheckpoint(directory, True, state, tuple(rejected))
        return None

    def _note_fallback(self, directory: Path) -> None:
        """Newer committed checkpoints were rejected and the job resumed from `directory`: the
        newest checkpoint the job stands on is this one now, so the rank reports it (its
        `committed_step`, which the operator's status.lastCheckpoint follows down: review-2
        F14), not the rejected one, until its next commit."""
        step = step_of(directory.name)
        if step is None or step >= self.stats.committed_step:
            return
        try:
            committed_at = read_manifest(directory).committed_at
        except CheckpointError:
            committed_at = 0.0
        self.stats.committed_step, self.stats.committed_at = step, committed_at
        self.stats.committed_dir = directory

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
        kept: tuple[devicecopy.DeviceCopy, torch.Tensor] | None = None,
    ) -> LoadedCheckpoint | None:
        """Collective (one agreement): the newest node-local copy every rank holds (`held`:
        every rank's copies, `mine`: this rank's), if not older than the newest commit (and,
        for a committed step, the size its manifest records), or None."""
        chosen = common_newest(held, at_least=max(newest_committed, 0))
        if chosen is None:
            return None
        step, identity = chosen
        mine_copy = next(c for c in mine if (c.step, c.identity) == chosen)
        directory = self.root / checkpoint_dir_name(step, identity)
        state: dict[str, Any] | None = None
        problem = ""
        committed = False
        on_device = kept is not None and mine_copy.path.name == devicecopy.RECORD_NAME
        try:
            size = kept[0].total_bytes if on_device and kept else mine_copy.path.stat().st_size
            if (data := records.get(directory.name)) is not None:
                committed = True
                expected = int(data["bytes"])
                if size != expected:
                    raise CheckpointError(f"{mine_copy.path.name}: {size} bytes, "
                                          f"the manifest records {expected}")
            if on_device and kept:  # the keeper's buffer, which the next snapshot overwrites:
                record, buffer = kept  # large device tensors are views (loading copies them),
                state = unflatten_state(copy.deepcopy(record.skeleton), [  # the rest copies
                    view if item.nbytes >= DEVICE_VIEW_BYTES and view.device.type != "cpu"
                    else view.clone() if view.device.type == "cpu"
                    else view.cpu()  # as read_shard: an RNG state, Adam's `step` on the host
                    for item, view in zip(record.layout, tensor_views(buffer, record.layout),
                                          strict=True)])
            else:
                state = read_shard(mine_copy.path, device=self.device)  # RAM -> device, DMA speed
        except (CheckpointError, OSError) as exc:
            problem = str(exc)
        if not self._agree(state is not None):
            log.warning("not resuming from the node-local copies of step %d: %s", step,
                        problem or "another rank could not read its copy")
            return None
        assert state is not None
        self._resumed_from = directory
        source = "local"
        if on_device and kept:
            source = "live" if kept[0].live else "device"
        return LoadedCheckpoint(directory, committed, state, (), source=source)
