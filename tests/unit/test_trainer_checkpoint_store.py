"""The checkpoint directory: commit (manifest), validation and fallback, pruning."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from checkpoint_helpers import save_checkpoint
from rtj_trainer import checkpoint as ck

pytestmark = pytest.mark.unit


def test_manifest_lists_every_shard_with_size_and_chunk_sha256s(tmp_path: Path) -> None:
    directory = save_checkpoint(tmp_path, 5)
    manifest = ck.read_manifest(directory)
    assert manifest.step == 5 and manifest.world_size == 2
    for shard in manifest.shards:
        path = directory / shard.file
        assert shard.bytes == path.stat().st_size and len(shard.chunks) > 2
        assert ck.chunk_tiling_problem(shard.chunks, shard.bytes) is None
        ranges = [(chunk.offset, chunk.bytes) for chunk in shard.chunks]
        assert [chunk.sha256 for chunk in shard.chunks] == ck.digest_ranges(path, ranges)


def test_no_manifest_is_written_until_every_rank_has_a_shard(tmp_path: Path) -> None:
    directory = save_checkpoint(tmp_path, 5, commit=False)
    (directory / ck.shard_record_name(1, 2)).unlink()  # rank 1 still writing
    assert ck.commit(directory, step=5, world_size=2, identity="a0") is None
    assert not (directory / ck.MANIFEST).exists()
    assert ck.committed_checkpoints(tmp_path) == []


def test_resume_picks_the_newest_committed_checkpoint(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 5)
    newest = save_checkpoint(tmp_path, 10)
    save_checkpoint(tmp_path, 15, commit=False)  # a writer killed mid-save: never committed
    chosen, rejected = ck.newest_valid_checkpoint(tmp_path, world_size=2)
    assert chosen == newest and rejected == []


@pytest.mark.parametrize(
    ("damage", "needle"),
    [
        ("truncate", "has"),
        ("flip", "fails its sha256"),
        ("flip-last", "fails its sha256"),
        ("delete", "is missing"),
        ("manifest", "unreadable manifest"),
    ],
)
def test_an_invalid_newest_checkpoint_falls_back_to_the_previous(
    tmp_path: Path, damage: str, needle: str
) -> None:
    previous = save_checkpoint(tmp_path, 5)
    newest = save_checkpoint(tmp_path, 10)
    shard = newest / ck.shard_file_name(1, 2)
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-7])
    elif damage in ("flip", "flip-last"):
        data = bytearray(shard.read_bytes())
        data[len(data) // 2 if damage == "flip" else -1] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "delete":
        shard.unlink()
    else:
        (newest / ck.MANIFEST).write_text("{not json")
    chosen, rejected = ck.newest_valid_checkpoint(tmp_path, world_size=2)
    assert chosen == previous
    assert any(needle in problem for problem in rejected), rejected


def test_a_checkpoint_from_another_world_size_is_rejected(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 5, world_size=2)
    chosen, rejected = ck.newest_valid_checkpoint(tmp_path, world_size=4)
    assert chosen is None and "written by 2 ranks, this job has 4" in rejected[0]


def test_a_manifest_with_missing_ranks_is_malformed(tmp_path: Path) -> None:
    directory = save_checkpoint(tmp_path, 5)
    data = json.loads((directory / ck.MANIFEST).read_text())
    data["shards"] = data["shards"][:1]
    (directory / ck.MANIFEST).write_text(json.dumps(data))
    assert "manifest lists ranks [0] for world size 2" in ck.validation_problems(
        directory, world_size=2, verify_ranks=None, verify_checksums=False)[0]


def test_a_manifest_whose_chunks_leave_bytes_unchecked_is_malformed(tmp_path: Path) -> None:
    directory = save_checkpoint(tmp_path, 5)
    data = json.loads((directory / ck.MANIFEST).read_text())
    data["shards"][1]["chunks"] = data["shards"][1]["chunks"][:-1]
    (directory / ck.MANIFEST).write_text(json.dumps(data))
    (problem,) = ck.validation_problems(directory, world_size=2, verify_ranks=None,
                                        verify_checksums=True)
    assert "malformed manifest" in problem and "chunks cover" in problem


def test_a_manifest_of_the_old_format_is_rejected(tmp_path: Path) -> None:
    directory = save_checkpoint(tmp_path, 5)
    data = json.loads((directory / ck.MANIFEST).read_text())
    data["format"] = 1
    (directory / ck.MANIFEST).write_text(json.dumps(data))
    chosen, rejected = ck.newest_valid_checkpoint(tmp_path, world_size=2)
    assert chosen is None and f"manifest format 1, expected {ck.FORMAT_VERSION}" in rejected[0]


def test_pruning_keeps_the_last_k_and_drops_abandoned_partial_saves(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        save_checkpoint(tmp_path, step)
    abandoned = save_checkpoint(tmp_path, 12, commit=False)
    in_flight = save_checkpoint(tmp_path, 20, commit=False)
    deleted = ck.prune(tmp_path, keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [ck.step_of(n) for n in names] == [10, 15, 20]
    assert abandoned in deleted and in_flight.exists()


def test_pruning_hides_doomed_checkpoints_at_once_and_defers_the_slow_delete(
    tmp_path: Path,
) -> None:
    for step in (5, 10, 15):
        save_checkpoint(tmp_path, step)
    handed_over: list[Path] = []
    ck.prune(tmp_path, keep=2, delete=handed_over.append)  # a background deleter, not yet run
    assert [p.name for p in handed_over] == [".deleting-" + ck.checkpoint_dir_name(5, "a0-l0-i0-1")]
    assert handed_over[0].is_dir()  # still on disk, but no longer a checkpoint
    assert [ck.step_of(p.name) for p in ck.committed_checkpoints(tmp_path)] == [15, 10]
    ck.prune(tmp_path, keep=2)  # a later prune finishes what a dead process left behind
    assert not handed_over[0].exists()


def test_a_failed_shard_write_does_not_block_later_commits(tmp_path: Path) -> None:
    # review T1: rank 1's step-10 write failed (an `.error` record instead of its record);
    # steps 20 and 30 were written by both ranks. Step 10 is given up, 20 and 30 commit.
    import time

    from rtj_trainer.checkpoint.checkpointer import Checkpointer
    from rtj_trainer.checkpoint.tracking import PendingSave
    from rtj_trainer.config import CheckpointConfig

    directories = {step: save_checkpoint(tmp_path, step, commit=False) for step in (10, 20, 30)}
    record = directories[10] / ck.shard_record_name(1, 2)
    record.unlink()
    record.with_name(record.name + ".error").write_text("OSError('disk full')")

    def checkpointer(rank: int) -> Checkpointer:
        # interval 0: no NVRx writer process; the shards above are already written
        made = Checkpointer(CheckpointConfig(dir=str(tmp_path), keep=10, interval_steps=0),
                            root=tmp_path,
                            rank=rank, world_size=2, device=torch.device("cpu"), identity="a0")
        made._pending = [PendingSave(step, directories[step], time.time(), 0.0)
                         for step in (10, 20, 30)]
        return made

    leader = checkpointer(0)
    leader.wait_until_committed(timeout_seconds=60)  # the commits run on rank 0's commit thread
    stats = leader.stats
    assert stats.committed_step == 30 and stats.abandoned == 1
    # Given up, then pruned with the other uncommitted directories once step 30 committed.
    assert not directories[10].exists()
    assert [d.name for d in ck.committed_checkpoints(tmp_path)] == [
        directories[30].name, directories[20].name]
    follower = checkpointer(1).poll()  # rank 1 skips the given-up step too
    assert follower.committed_step == 30 and follower.abandoned == 1
    leader.close(abort=True)



def _checkpointers(tmp_path: Path, directories: dict[int, Path], **cfg: object) -> list:
    """Rank 0 and rank 1 of a 2-rank job with the saves of `directories` pending (interval 0: no
    NVRx writer process; the shards are written already)."""
    import time

    from rtj_trainer.checkpoint.checkpointer import Checkpointer
    from rtj_trainer.checkpoint.tracking import PendingSave
    from rtj_trainer.config import CheckpointConfig

    made = []
    for rank in (0, 1):
        one = Checkpointer(CheckpointConfig(dir=str(tmp_path), keep=10, interval_steps=0, **cfg),
                           root=tmp_path, rank=rank, world_size=2, device=torch.device("cpu"),
                           identity="a0")
        one._pending = [PendingSave(step, directory, time.time(), 0.0)
                        for step, directory in sorted(directories.items())]
        made.append(one)
    return made


def test_a_write_that_left_neither_record_nor_error_is_abandoned_at_its_deadline(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    # review F2: rank 1's step-10 write failed and could not leave its `.error` either (EIO,
    # ENOSPC, the directory gone); steps 20 and 30 are complete. Before the fix the commit
    # thread waited for the missing record for ever, in order, and nothing after step 10 ever
    # committed.
    directories = {step: save_checkpoint(tmp_path, step, commit=False) for step in (10, 20, 30)}
    (directories[10] / ck.shard_record_name(1, 2)).unlink()
    leader, follower = _checkpointers(tmp_path, directories, commit_timeout_seconds=0.5)
    leader.wait_until_committed(timeout_seconds=30)
    assert leader.stats.committed_step == 30 and leader.stats.abandoned == 1
    # Reported with the rank that never answered (the directory itself was pruned with the
    # other uncommitted ones once step 30 committed).
    assert "step 10 will not be committed" in caplog.text and "rank(s) 1" in caplog.text
    assert not directories[10].exists()
    assert [d.name for d in ck.committed_checkpoints(tmp_path)] == [
        directories[30].name, directories[20].name]
    follower.wait_until_committed(timeout_seconds=30)  # rank 1 reads rank 0's verdict
    assert follower.stats.committed_step == 30 and follower.stats.abandoned == 1
    leader.close(abort=True)


def test_an_abandoned_last_save_fails_the_wait_on_every_rank(tmp_path: Path) -> None:
    # review F1: the run's last save (step 100) has rank 1's `.error`; step 90 is complete.
    # Before the fix the wait returned normally with step 90 committed and the job ended
    # Succeeded one interval behind. Now every rank raises, so the attempt restarts.
    directories = {step: save_checkpoint(tmp_path, step, commit=False) for step in (90, 100)}
    record = directories[100] / ck.shard_record_name(1, 2)
    record.unlink()
    record.with_name(record.name + ".error").write_text("OSError(5, 'Input/output error')")
    leader, follower = _checkpointers(tmp_path, directories)
    for rank in (leader, follower):
        with pytest.raises(ck.CheckpointError, match=r"step 100 was abandoned.*step 90"):
            rank.wait_until_kept(100)
        assert rank.stats.committed_step == 90 and rank.stats.abandoned == 1
    leader.close(abort=True)


def _commit_at(directory: Path, moment: float) -> None:
    import os

    os.utime(directory / ck.MANIFEST, (moment, moment))


def test_pruning_after_a_world_size_change_keeps_the_new_runs_checkpoints(tmp_path: Path) -> None:
    # review T2 (a): old checkpoints at higher steps (another world size), the new run commits
    # step 100 and writes step 200. Recency is commit time, and in-flight saves of this attempt
    # stay.
    for n, step in enumerate((4800, 4900, 5000)):
        _commit_at(save_checkpoint(tmp_path, step), 1000.0 + n)
    new = tmp_path / ck.checkpoint_dir_name(100, "a1-l0-i0-9")
    save_checkpoint(tmp_path, 100).rename(new)
    _commit_at(new, 2000.0)
    in_flight = tmp_path / ck.checkpoint_dir_name(200, "a1-l0-i0-9")
    save_checkpoint(tmp_path, 200, commit=False).rename(in_flight)
    ck.prune(tmp_path, keep=3, current_identity="a1-l0-i0-9")
    kept = sorted(ck.step_of(p.name) or 0 for p in tmp_path.iterdir()
                  if not p.name.startswith("."))
    assert kept == [100, 200, 4900, 5000]


def test_pruning_never_deletes_the_checkpoint_resumed_from_or_a_save_in_flight(
    tmp_path: Path,
) -> None:
    # review T2 (b): committed 100, 200, 300 (300 is corrupt: the attempt fell back to 200),
    # then this attempt committed 210 and is writing 220.
    steps = {step: save_checkpoint(tmp_path, step) for step in (100, 200, 300)}
    for n, step in enumerate((100, 200, 300)):
        _commit_at(steps[step], 1000.0 + n)
    ours = "a2-l0-i0-7"
    committed = tmp_path / ck.checkpoint_dir_name(210, ours)
    save_checkpoint(tmp_path, 210).rename(committed)
    _commit_at(committed, 2000.0)
    in_flight = tmp_path / ck.checkpoint_dir_name(220, ours)
    save_checkpoint(tmp_path, 220, commit=False).rename(in_flight)
    ck.prune(tmp_path, keep=2, protect=steps[200], current_identity=ours)
    kept = sorted(ck.step_of(p.name) or 0 for p in tmp_path.iterdir()
                  if not p.name.startswith("."))
    assert kept == [200, 210, 220, 300]


def test_checkpoints_only_at_another_world_size_are_refused_naming_both(tmp_path: Path) -> None:
    from rtj_trainer.checkpoint.store import other_world_sizes, refuse_other_world_size
    from rtj_trainer.errors import FatalError, WorldSizeChangedError

    refuse_other_world_size(tmp_path, world_size=4)  # nothing committed: a fresh start is fine
    save_checkpoint(tmp_path, 5, world_size=2)
    save_checkpoint(tmp_path, 10, world_size=2)
    assert other_world_sizes(tmp_path, world_size=4) == [2]
    with pytest.raises(WorldSizeChangedError) as refused:
        refuse_other_world_size(tmp_path, world_size=4)
    assert isinstance(refused.value, FatalError)
    assert refused.value.reason == "WorldSizeChanged"
    text = str(refused.value)
    assert "written by 2 ranks, this job has 4" in text and str(tmp_path) in text
    assert "not resharded" in text
    refuse_other_world_size(tmp_path, world_size=2)  # the same world size resumes


def test_one_checkpoint_at_this_world_size_is_enough_to_start(tmp_path: Path) -> None:
    from rtj_trainer.checkpoint.store import other_world_sizes

    save_checkpoint(tmp_path, 5, world_size=4)
    save_checkpoint(tmp_path, 10, world_size=2)
    assert other_world_sizes(tmp_path, world_size=4) == []
    uncommitted = save_checkpoint(tmp_path, 15, world_size=8, commit=False)
    assert uncommitted.is_dir() and other_world_sizes(tmp_path, world_size=2) == []


def test_a_close_cut_short_by_an_in_process_restart_is_finished_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """NVRx's monitor thread raises into the main thread again and again once its soft timeout
    passed, wherever the main thread is: inside the attempt's close() too. What close() did not
    finish, close_interrupted() (the wrapper's finalize step, and the next attempt's start)
    finishes, once."""
    from rtj_trainer.carry import CarryOver
    from rtj_trainer.checkpoint import checkpointer as module
    from rtj_trainer.checkpoint.carried import close_interrupted
    from rtj_trainer.config import CheckpointConfig

    class Interrupted(BaseException):  # NVRx's RankShouldRestart is raised the same way
        pass

    carry = CarryOver()
    made = module.Checkpointer(CheckpointConfig(dir=str(tmp_path), interval_steps=0),
                               root=tmp_path, rank=0, world_size=1,
                               device=torch.device("cpu"), identity="a0", carry=carry)
    committer = made._commit_worker()  # rank 0's commit thread runs
    real_stop = module.CommitWorker.stop

    def stop_then_interrupted(self: module.CommitWorker, timeout_seconds: float = 10.0) -> None:
        real_stop(self, timeout_seconds)
        monkeypatch.setattr(module.CommitWorker, "stop", real_stop)
        raise Interrupted

    monkeypatch.setattr(module.CommitWorker, "stop", stop_then_interrupted)
    with pytest.raises(Interrupted):
        made.close(abort=True)
    assert made._committer is committer and made in carry.unclosed
    assert close_interrupted(carry) == 1
    assert made._committer is None and made not in carry.unclosed
    assert close_interrupted(carry) == 0
    made.close(abort=True)  # closing again is harmless
