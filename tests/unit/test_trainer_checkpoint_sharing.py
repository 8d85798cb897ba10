"""One job per checkpoint directory (review-2 F12): rank 0 takes `<checkpoint.dir>/.rtj-lock` at
the start of every attempt (rtj_trainer.checkpoint.lock), and prune deletes only its own job's
directories (rtj_trainer.checkpoint.pruning.prune), so two jobs given one explicit
`checkpoint.path` can no longer delete each other's checkpoints."""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoint_helpers import save_checkpoint
from rtj_trainer import checkpoint as ck
from rtj_trainer.checkpoint.tracking import PendingSave
from rtj_trainer.config import CheckpointConfig
from rtj_trainer.errors import FatalError, ForeignCheckpointError

pytestmark = pytest.mark.unit

JOB_A, JOB_B = "team-a/llama", "team-b/llama"


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


def _checkpointer(root: Path, job: str, identity: str, *, rank: int = 0, world_size: int = 1,
                  accepted: tuple[str, ...] = (), **cfg: object) -> ck.Checkpointer:
    config = CheckpointConfig(dir=str(root), interval_steps=0, **cfg)  # no NVRx writer process
    return ck.Checkpointer(config, root=root, rank=rank, world_size=world_size,
                           device=torch.device("cpu"), identity=identity, job=job,
                           accepted_jobs=accepted)


def _holder(root: Path) -> ck.lock.Holder:
    holder = ck.read_holder(root)
    assert holder is not None
    return holder


def _age(path: Path, seconds: float) -> None:
    moment = time.time() - seconds
    os.utime(path, (moment, moment))


# -- the lock ----------------------------------------------------------------------------------


def test_a_second_job_on_the_same_checkpoint_path_refuses_to_start(
        tmp_path: Path, one_rank_group: None) -> None:
    # Neither job has committed anything yet: the check of committed checkpoints sees nothing,
    # and before the lock both jobs trained and pruned each other's saves.
    first = _checkpointer(tmp_path, JOB_A, "a0-l0-i0-1")
    assert first.load_latest() is None
    assert _holder(tmp_path).job == JOB_A
    with pytest.raises(ForeignCheckpointError) as refused:
        _checkpointer(tmp_path, JOB_B, "a0-l0-i0-2").load_latest()
    assert isinstance(refused.value, FatalError) and refused.value.reason == "ForeignCheckpoint"
    message = str(refused.value)
    assert f"checkpoint.path {tmp_path} is in use by another job: {JOB_A}" in message
    assert f"this job is {JOB_B}" in message and "spec.checkpoint.resumeFromJobs" in message
    assert _holder(tmp_path).job == JOB_A  # the refused job left the lock alone
    first.close(abort=True)


def test_the_same_job_restarting_takes_its_own_lock_over(
        tmp_path: Path, one_rank_group: None) -> None:
    # Attempt 1's pod was killed (its lock is fresh and nobody released it); attempt 2 of the
    # same job, on another pod, takes it over at once.
    killed = _checkpointer(tmp_path, JOB_A, "a0-l0-i0-1")
    killed.load_latest()
    killed.close(abort=True)  # stops refreshing; the lock stays
    assert _holder(tmp_path).identity == "a0-l0-i0-1"
    again = _checkpointer(tmp_path, JOB_A, "a1-l0-i0-2")
    assert again.load_latest() is None
    holder = _holder(tmp_path)
    assert (holder.job, holder.identity) == (JOB_A, "a1-l0-i0-2")
    assert time.time() - holder.refreshed_at < 60
    again.close(abort=True)


def test_a_stale_lock_of_another_job_is_taken_over_with_a_warning(
        tmp_path: Path, one_rank_group: None, caplog: pytest.LogCaptureFixture) -> None:
    gone = _checkpointer(tmp_path, JOB_A, "a0-l0-i0-1")
    gone.load_latest()
    gone.close(abort=True)
    _age(tmp_path / ck.LOCK, ck.lock.STALE_AFTER_SECONDS + 60)
    with caplog.at_level(logging.WARNING):
        taker = _checkpointer(tmp_path, JOB_B, "a0-l0-i0-2")
        assert taker.load_latest() is None
    assert _holder(tmp_path).job == JOB_B
    assert f"taking over the lock of {JOB_A}" in caplog.text
    taker.close(abort=True)


def test_a_job_named_in_resume_from_jobs_takes_its_lock_over(
        tmp_path: Path, one_rank_group: None) -> None:
    # Continuing another job's run on purpose (it was deleted a minute ago: its lock is fresh).
    save_checkpoint(tmp_path, 5, world_size=1, job=JOB_A)
    old = _checkpointer(tmp_path, JOB_A, "a0-l0-i0-1")
    old.load_latest()
    old.close(abort=True)
    loaded = _checkpointer(tmp_path, JOB_B, "a0-l0-i0-2", accepted=(JOB_A,)).load_latest()
    assert loaded is not None and loaded.state["step"] == 5
    assert _holder(tmp_path).job == JOB_B


def test_a_job_refused_for_another_jobs_checkpoints_does_not_keep_the_lock(
        tmp_path: Path, one_rank_group: None) -> None:
    save_checkpoint(tmp_path, 5, world_size=1, job=JOB_A)  # A's run, its lock released
    with pytest.raises(ForeignCheckpointError):
        _checkpointer(tmp_path, JOB_B, "a0-l0-i0-2").load_latest()
    assert ck.read_holder(tmp_path) is None  # A can come back at once


def test_a_finished_job_releases_the_lock_and_a_lost_lock_stops_the_job(
        tmp_path: Path, one_rank_group: None) -> None:
    done = _checkpointer(tmp_path, JOB_A, "a0-l0-i0-1")
    done.load_latest()
    done.release_lock()
    assert ck.read_holder(tmp_path) is None
    # A job whose lock another job took over (it had not refreshed it in time) stops at its
    # next poll with the same fatal error.
    running = _checkpointer(tmp_path, JOB_A, "a0-l0-i0-3")
    running.load_latest()
    _age(tmp_path / ck.LOCK, ck.lock.STALE_AFTER_SECONDS + 60)
    ck.DirectoryLock(tmp_path, job=JOB_B, identity="b").take()
    assert running._lock is not None and not running._lock.refresh()
    with pytest.raises(ForeignCheckpointError, match=JOB_B):
        running.poll()
    running.close(abort=True)


def test_the_lock_is_created_once_when_two_jobs_race_for_it(tmp_path: Path) -> None:
    first = ck.DirectoryLock(tmp_path, job=JOB_A, identity="a")
    second = ck.DirectoryLock(tmp_path, job=JOB_B, identity="b")
    assert first._create() and not second._create()  # a hard link: exactly one wins
    with pytest.raises(ForeignCheckpointError):
        second.take()
    assert json.loads((tmp_path / ck.LOCK).read_text())["job"] == JOB_A
    assert [p.name for p in tmp_path.iterdir()] == [ck.LOCK]  # no temporary file left


# -- prune ------------------------------------------------------------------------------------


def _as(directory: Path, identity: str) -> Path:
    """`directory` renamed to the attempt `identity` (the helper names every save alike)."""
    step = ck.step_of(directory.name)
    assert step is not None
    return directory.rename(directory.with_name(ck.checkpoint_dir_name(step, identity)))


def _commit_at(directory: Path, moment: float) -> None:
    os.utime(directory / ck.MANIFEST, (moment, moment))


def test_prune_of_one_job_leaves_another_jobs_committed_and_in_flight_directories_alone(
        tmp_path: Path) -> None:
    # Job B committed steps 1-3 and is writing step 4 (its commit thread marked the directory);
    # job A, on the same path, commits steps 10 and 20 with keep=1. Before the fix A's prune
    # deleted B's committed checkpoints beyond `keep` and B's save in flight ("not ours, step
    # <= newest"), which also blocked B's commit thread.
    b_committed = [_as(save_checkpoint(tmp_path, step, job=JOB_B), "b0-l0-i0-7")
                   for step in (1, 2, 3)]
    for n, directory in enumerate(b_committed):
        _commit_at(directory, 1000.0 + n)
    b_in_flight = _as(save_checkpoint(tmp_path, 4, commit=False), "b0-l0-i0-7")
    (b_in_flight / ck.shard_record_name(1, 2)).unlink()  # rank 1 still writing
    ck.mark_owner(b_in_flight, job=JOB_B, identity="b0-l0-i0-7")
    mine = {step: _as(save_checkpoint(tmp_path, step, commit=False), "a0-l0-i0-1")
            for step in (10, 20)}
    leader = _checkpointer(tmp_path, JOB_A, "a0-l0-i0-1", world_size=2, keep=1)
    leader._pending = [PendingSave(step, directory, time.time(), 0.0)
                       for step, directory in sorted(mine.items())]
    leader.wait_until_committed(timeout_seconds=20)  # rank 0's commit thread commits and prunes
    leader.close(abort=True)
    assert leader.stats.committed_step == 20
    left = {p.name for p in tmp_path.iterdir() if ck.step_of(p.name) is not None}
    assert left == {d.name for d in (*b_committed, b_in_flight, mine[20])}
    assert all(ck.read_manifest(d).job == JOB_B for d in b_committed)
    assert json.loads((mine[20] / ck.OWNER).read_text())["job"] == JOB_A


def test_prune_deletes_a_directory_of_unknown_owner_only_when_it_is_long_forgotten(
        tmp_path: Path) -> None:
    ours = _as(save_checkpoint(tmp_path, 30, job=JOB_A), "a1-l0-i0-2")
    # No owner record: rank 0 had not marked them yet (another job's save just started?), or
    # a trainer before owner records left them.
    fresh = _as(save_checkpoint(tmp_path, 10, commit=False), "x0-l0-i0-1")
    forgotten = _as(save_checkpoint(tmp_path, 20, commit=False), "x0-l0-i0-2")
    for entry in [forgotten, *forgotten.iterdir()]:
        _age(entry, 2 * ck.pruning.UNOWNED_AFTER_SECONDS)
    # Ours, of an earlier attempt: its writers are gone, a newer step is committed.
    earlier = _as(save_checkpoint(tmp_path, 25, commit=False), "a0-l0-i0-1")
    ck.mark_owner(earlier, job=JOB_A, identity="a0-l0-i0-1")
    deleted = ck.prune(tmp_path, keep=1, job=JOB_A, current_identity="a1-l0-i0-2")
    assert sorted(d.name for d in deleted) == sorted([forgotten.name, earlier.name])
    assert fresh.is_dir() and ours.is_dir()


def test_another_jobs_checkpoints_do_not_count_towards_keep(tmp_path: Path) -> None:
    a_old, a_new = (_as(save_checkpoint(tmp_path, step, job=JOB_A), "a0-l0-i0-1")
                    for step in (10, 20))
    b_newer = _as(save_checkpoint(tmp_path, 30, job=JOB_B), "b0-l0-i0-1")
    for n, directory in enumerate((a_old, a_new, b_newer)):
        _commit_at(directory, 1000.0 + n)
    owners: dict[str, str] = {}
    assert ck.prune(tmp_path, keep=2, job=JOB_A, owners=owners) == []
    assert owners == {a_old.name: JOB_A, a_new.name: JOB_A, b_newer.name: JOB_B}
    assert [d.name for d in ck.prune(tmp_path, keep=1, job=JOB_A, owners=owners)] == [a_old.name]
    assert b_newer.is_dir() and a_new.is_dir()
