"""Node-local copies (rtj_trainer.checkpoint.local): the writer's copy is the shard's exact bytes,
the newest two per rank are kept, partial copies are never offered, ranks resume from a local
copy only when all hold the same save and it is not older than the newest commit, and the
Checkpointer falls back to the shared store otherwise."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoint_helpers import save_checkpoint, stage
from rtj_trainer import checkpoint as ck
from rtj_trainer.checkpoint import local
from rtj_trainer.config import CheckpointConfig

pytestmark = pytest.mark.unit


def _write(directory: Path, step: int, identity: str = "a0-l0-i0-1", value: float = 1.0) -> Path:
    skeleton, layout, blob = stage({"w": torch.full((3,), value), "step": step})
    header = ck.format.encode_header(skeleton, layout, blob.numel())
    data = memoryview(blob.numpy()).cast("B")
    return local.write_local_copy(directory, step, identity, header, data, threads=2)


def _two_copies_and_a_state(directory: Path) -> tuple[bytes, memoryview]:
    """Copies of steps 10 and 20 in `directory`, and the header and data of a state to publish
    (w = 3.0)."""
    _write(directory, 10)
    _write(directory, 20)
    skeleton, layout, blob = stage({"w": torch.full((3,), 3.0), "step": 30})
    return ck.format.encode_header(skeleton, layout, blob.numel()), memoryview(
        blob.numpy()).cast("B")


def test_the_writers_local_copy_is_the_shards_bytes(tmp_path: Path) -> None:
    skeleton, layout, blob = stage({"x": torch.randn(5000), "y": torch.arange(999)})
    shard = tmp_path / "store" / "shard.bin"
    shard.parent.mkdir()
    ck.write_shard(str(shard), str(tmp_path / "rec.json"), skeleton, layout, blob, 0, False, 0.0,
                   chunk_bytes=4096, threads=3, local_copy=(str(tmp_path / "local"), 7, "a1"))
    copies = local.local_copies(tmp_path / "local")
    assert [(c.step, c.identity) for c in copies] == [(7, "a1")]
    assert copies[0].path.read_bytes() == shard.read_bytes()
    assert torch.equal(ck.read_shard(copies[0].path)["y"], torch.arange(999))


def test_the_newest_two_copies_are_kept_and_partial_ones_are_never_offered(
        tmp_path: Path) -> None:
    for step in (10, 20, 30):
        _write(tmp_path, step)
    (tmp_path / ".step-000000040.a0-l0-i0-1.bin.tmp-123").write_bytes(b"half")
    assert [c.step for c in local.local_copies(tmp_path)] == [30, 20]
    local.remove_partial_copies(tmp_path)  # the temporary is kept as the spare, never a copy
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        local.SPARE_NAME, "step-000000020.a0-l0-i0-1.bin", "step-000000030.a0-l0-i0-1.bin"]
    assert [c.step for c in local.local_copies(tmp_path)] == [30, 20]


def _only(directory: Path, names: list[str], timeout: float = 10.0) -> None:
    """Until `directory` holds exactly `names` (deletions run on daemon threads)."""
    deadline = time.monotonic() + timeout
    while sorted(p.name for p in directory.iterdir()) != sorted(names):
        assert time.monotonic() < deadline, sorted(p.name for p in directory.iterdir())
        time.sleep(0.01)


def test_a_killed_writers_temporaries_become_the_spare_or_go_on_a_thread(
        tmp_path: Path) -> None:
    """Issue #32: deleting an 11.3 GB temporary on /dev/shm took ~1.2 s of a restart's critical
    path. At a restart one temporary becomes the spare file (renamed, which is instant), the
    others, an older trash file and, when the job finished, every one go."""
    copy = _write(tmp_path, 10).name
    first = tmp_path / ".step-000000020.a0-l0-i0-1.bin.tmp-7"
    first.write_bytes(b"x" * 100)
    (tmp_path / ".step-000000030.a0-l0-i0-1.bin.tmp-8").write_bytes(b"y" * 50)
    (tmp_path / ".trash-1-2-3").write_bytes(b"z")  # left by a process that exited
    local.remove_partial_copies(tmp_path)
    _only(tmp_path, [copy, local.SPARE_NAME])
    assert (tmp_path / local.SPARE_NAME).stat().st_size in (100, 50)
    (tmp_path / ".step-000000040.a0-l0-i0-1.bin.tmp-9").write_bytes(b"w")
    local.remove_partial_copies(tmp_path)  # a spare is there already: the new one goes
    _only(tmp_path, [copy, local.SPARE_NAME])
    local.drop_spare(tmp_path)  # no snapshot thread will write over it (no device memory)
    assert not (tmp_path / local.SPARE_NAME).exists()
    _only(tmp_path, [copy])
    (tmp_path / local.SPARE_NAME).write_bytes(b"s")
    local.discard_local_copies(tmp_path)  # the job finished: nothing is left, at once
    assert not tmp_path.exists()


def test_without_the_snapshot_thread_no_spare_is_kept(tmp_path: Path) -> None:
    """Snapshots through the writer process (`checkpoint.snapshot_device_copy` off) never write
    over a spare: a temporary left by a killed writer is deleted, as is a spare from before."""
    store = tmp_path / "store"
    cfg = CheckpointConfig(dir=str(store), interval_steps=10, local_dir=str(tmp_path / "shm"),
                           local_interval_steps=5, snapshot_device_copy=False)
    folder = local.local_copy_dir(tmp_path / "shm", store, 0, 1)
    folder.mkdir(parents=True)
    (folder / ".step-000000020.a0-l0-i0-1.bin.tmp-7").write_bytes(b"half")
    (folder / local.SPARE_NAME).write_bytes(b"old")
    checkpointer = ck.Checkpointer(cfg, root=store, rank=0, world_size=1,
                                   device=torch.device("cpu"), identity="a9")
    try:
        assert checkpointer._snapshots is None
        assert list(folder.iterdir()) == []
    finally:
        checkpointer.close()
    with_thread = cfg.model_copy(update={"snapshot_device_copy": True})
    assert with_thread.snapshots_by_thread and not cfg.snapshots_by_thread


def test_a_snapshot_given_up_leaves_its_file_as_the_spare_and_the_next_one_writes_over_it(
        tmp_path: Path) -> None:
    header, data = _two_copies_and_a_state(tmp_path)
    inode = local.local_copies(tmp_path)[-1].path.stat().st_ino  # the oldest: 10's

    def fill(view: memoryview) -> None:
        view[:] = data

    def fail(view: memoryview) -> None:
        raise RuntimeError("cut short")

    with pytest.raises(RuntimeError, match="cut short"):
        local.publish_local_copy(tmp_path, 30, "a0-l0-i0-1", header, len(data), fail)
    spare = tmp_path / local.SPARE_NAME
    assert spare.stat().st_ino == inode  # 10's file, not deleted on the caller's time
    assert [c.step for c in local.local_copies(tmp_path)] == [20]
    published = local.publish_local_copy(tmp_path, 30, "a0-l0-i0-1", header, len(data), fill)
    assert published is not None and published.stat().st_ino == inode and not spare.exists()
    assert torch.equal(ck.read_shard(published)["w"], torch.full((3,), 3.0))
    # a spare of another size is not written over: deleted, and a new file is made
    spare.write_bytes(b"other size")
    other = local.publish_local_copy(tmp_path, 40, "a0-l0-i0-1", header, len(data), fill)
    assert other is not None and [c.step for c in local.local_copies(tmp_path)] == [40, 30]
    _only(tmp_path, [other.name, published.name])


def test_ranks_agree_on_the_newest_save_all_of_them_hold() -> None:
    a, b = (30, "x"), (20, "x")
    assert local.common_newest([[a, b], [a, b]], at_least=0) == a
    assert local.common_newest([[a, b], [b]], at_least=0) == b  # one rank died writing 30
    assert local.common_newest([[a, b], []], at_least=0) is None  # a new node holds nothing
    assert local.common_newest([[a], [(30, "other attempt")]], at_least=0) is None
    assert local.common_newest([[a, b], [a, b]], at_least=40) is None  # a newer commit exists


def test_two_stores_on_one_node_never_share_copies(tmp_path: Path) -> None:
    one = local.local_copy_dir(tmp_path, tmp_path / "job-a", 1, 8)
    two = local.local_copy_dir(tmp_path, tmp_path / "job-b", 1, 8)
    assert one != two and one.name == two.name == "rank-00001-of-00008"


@pytest.fixture
def one_rank_group() -> object:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


def _checkpointer(store: Path, local_dir: Path) -> ck.Checkpointer:
    cfg = CheckpointConfig(dir=str(store), interval_steps=0, local_dir=str(local_dir))
    return ck.Checkpointer(cfg, root=store, rank=0, world_size=1, device=torch.device("cpu"),
                           identity="a9")


def test_a_resume_prefers_a_local_copy_newer_than_the_newest_commit(
        tmp_path: Path, one_rank_group: object) -> None:
    store = tmp_path / "store"
    save_checkpoint(store, 20, world_size=1)
    checkpointer = _checkpointer(store, tmp_path / "shm")
    assert checkpointer._local is not None
    _write(checkpointer._local, 30, value=3.0)
    loaded = checkpointer.load_latest()
    assert loaded is not None and loaded.source == "local" and not loaded.committed
    assert loaded.state["step"] == 30 and torch.equal(loaded.state["w"], torch.full((3,), 3.0))


def test_a_resume_uses_the_store_when_its_commit_is_newer_than_the_local_copies(
        tmp_path: Path, one_rank_group: object) -> None:
    store = tmp_path / "store"
    save_checkpoint(store, 40, world_size=1)
    checkpointer = _checkpointer(store, tmp_path / "shm")
    assert checkpointer._local is not None
    _write(checkpointer._local, 30)
    loaded = checkpointer.load_latest()
    assert loaded is not None and loaded.source == "store" and loaded.state["step"] == 40


def test_a_local_copy_of_a_committed_step_must_match_the_manifests_size(
        tmp_path: Path, one_rank_group: object) -> None:
    store = tmp_path / "store"
    directory = save_checkpoint(store, 20, world_size=1)
    identity = directory.name.split(".", 1)[1]
    checkpointer = _checkpointer(store, tmp_path / "shm")
    assert checkpointer._local is not None
    copy = _write(checkpointer._local, 20, identity=identity, value=5.0)
    with open(copy, "ab") as handle:  # not the bytes the manifest describes
        handle.write(b"x")
    loaded = checkpointer.load_latest()
    assert loaded is not None and loaded.source == "store"
    assert torch.equal(loaded.state["w"], torch.full((4, 3), 200.0))


def test_finishing_discards_the_local_copies(tmp_path: Path) -> None:
    _write(tmp_path / "rank", 10)
    local.discard_local_copies(tmp_path / "rank")
    assert not os.path.exists(tmp_path / "rank")


def test_a_save_without_a_local_copy_writes_only_the_store(
        tmp_path: Path, one_rank_group: object) -> None:
    # The run's last save (Trainer.save): its copies would be discarded once it commits.
    store = tmp_path / "store"
    cfg = CheckpointConfig(dir=str(store), interval_steps=0, mode="sync",
                           local_dir=str(tmp_path / "shm"))
    checkpointer = ck.Checkpointer(cfg, root=store, rank=0, world_size=1,
                                   device=torch.device("cpu"), identity="a9")
    assert checkpointer._local is not None
    checkpointer.save(10, {"w": torch.full((3,), 1.0), "step": 10})
    checkpointer.save(20, {"w": torch.full((3,), 2.0), "step": 20}, local_copy=False)
    assert [c.step for c in local.local_copies(checkpointer._local)] == [10]
    assert checkpointer.stats.committed_step == 20
    loaded = checkpointer.load_latest()
    assert loaded is not None and loaded.source != "local" and loaded.state["step"] == 20
    checkpointer.close()


def test_a_snapshot_is_a_local_copy_only_and_a_resume_starts_from_it(
        tmp_path: Path, one_rank_group: object) -> None:
    """`checkpoint.local_interval_steps` (issue #32: a killed worker recomputes at most that
    many steps): a snapshot writes the rank's node-local copy and nothing on the shared store,
    commits nothing, and a resume starts from it when it is newer than the newest commit."""
    store = tmp_path / "store"
    cfg = CheckpointConfig(dir=str(store), interval_steps=0, mode="sync",
                           local_dir=str(tmp_path / "shm"), local_interval_steps=5)
    checkpointer = ck.Checkpointer(cfg, root=store, rank=0, world_size=1,
                                   device=torch.device("cpu"), identity="a9")
    assert checkpointer._local is not None and checkpointer._snapshots is not None
    checkpointer.save(10, {"w": torch.full((3,), 1.0), "step": 10})
    assert checkpointer.snapshot_ready()
    checkpointer.snapshot(15, {"w": torch.full((3,), 1.5), "step": 15})
    checkpointer._snapshots.wait(30)
    assert [c.step for c in local.local_copies(checkpointer._local)] == [15, 10]
    assert not any("000000015" in p.name for p in store.iterdir())  # nothing on the store
    assert checkpointer.stats.committed_step == 10
    checkpointer.close()
    again = ck.Checkpointer(cfg, root=store, rank=0, world_size=1, device=torch.device("cpu"),
                            identity="a9")
    loaded = again.load_latest()
    assert loaded is not None and loaded.source == "local" and not loaded.committed
    assert loaded.state["step"] == 15 and torch.equal(loaded.state["w"], torch.full((3,), 1.5))
    again.close()


def test_a_snapshot_through_the_device_copy_never_waits_for_a_save_and_is_of_its_step(
        tmp_path: Path, one_rank_group: object) -> None:
    """Issue #32: a save keeps the writer process busy for seconds, and a snapshot that waited
    for it was skipped (a SIGKILL then recomputed back to the save). The device copy is taken
    while the save's write is in flight, and holds the state of its step even though the
    training state changes in place right after `snapshot` returned."""
    store = tmp_path / "store"
    cfg = CheckpointConfig(dir=str(store), interval_steps=10, mode="async",
                           local_dir=str(tmp_path / "shm"), local_interval_steps=5,
                           test_write_delay_seconds=1.0)
    checkpointer = ck.Checkpointer(cfg, root=store, rank=0, world_size=1,
                                   device=torch.device("cpu"), identity="a9")
    assert checkpointer._local is not None and checkpointer._snapshots is not None
    assert checkpointer._snapshots.bounce_bytes == 64 << 20  # checkpoint.snapshot_bounce_mib
    weights = torch.full((1000,), 1.0)
    try:
        checkpointer.save(10, {"w": weights, "step": 10})
        assert not checkpointer._writes_done()  # the save's write is still in flight
        assert checkpointer.snapshot_ready()
        weights.fill_(1.5)
        checkpointer.snapshot(15, {"w": weights, "step": 15})
        assert not checkpointer._writes_done()
        weights.fill_(9.0)  # the next steps' updates
        checkpointer._snapshots.wait(30)
        assert checkpointer._snapshots.written == 1 and checkpointer._snapshots.failed == 0
        copies = checkpointer.snapshot_copies()  # the trainer's summary reports these
        assert copies["thread_copies"] == 1
        assert 0 < copies["thread_copy_seconds_last"] == copies["thread_copy_seconds_max"]
        assert copies["copy_launch_seconds"] > 0  # the snapshot's copy into the device buffer
        copy = next(c for c in local.local_copies(checkpointer._local) if c.step == 15)
        state = ck.read_shard(copy.path)
        assert state["step"] == 15 and torch.equal(state["w"], torch.full((1000,), 1.5))
        checkpointer.wait_until_committed(30)
        assert [c.step for c in local.local_copies(checkpointer._local)] == [15, 10]
    finally:
        checkpointer.close()


def test_a_snapshot_cut_short_leaves_no_copy_and_the_older_ones_stand(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An in-process restart closes the checkpointer while a snapshot is being written: the
    thread stops between chunks, and no copy of that step is left; its file is kept as the
    spare for the next snapshot (not deleted while the restart waits)."""
    from rtj_trainer.checkpoint import snapshots

    folder = tmp_path / "shm"
    _write(folder, 10)
    monkeypatch.setattr(snapshots, "WRITE_CHUNK_BYTES", 1)  # a million chunks: seconds
    taker = snapshots.SnapshotTaker(folder, device=torch.device("cpu"), rank=0,
                                    bounce_bytes=64 << 20)
    stall = taker.take(20, "a0-l0-i0-1", {"w": torch.zeros(1 << 18), "step": 20})
    assert stall is not None and not taker.ready()
    taker.close()
    assert taker.ready() and taker.written == 0 and taker.failed == 0
    assert [c.step for c in local.local_copies(folder)] == [10]
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")] == [local.SPARE_NAME]


def test_a_published_copy_reuses_the_oldest_copys_file_and_keep_false_publishes_nothing(
        tmp_path: Path) -> None:
    header, data = _two_copies_and_a_state(tmp_path)

    def fill(view: memoryview) -> None:
        view[:] = data

    assert local.publish_local_copy(tmp_path, 40, "a0-l0-i0-1", header, len(data), fill,
                                    keep=lambda: False) is None
    # the file of 10 was reused, then given up: it is the spare now, which the next copy of
    # this size writes over
    assert [c.step for c in local.local_copies(tmp_path)] == [20]
    (tmp_path / local.SPARE_NAME).unlink()
    _write(tmp_path, 25)
    oldest = local.local_copies(tmp_path)[-1].path
    inode = oldest.stat().st_ino
    published = local.publish_local_copy(tmp_path, 30, "a0-l0-i0-1", header, len(data), fill)
    assert published is not None and published.stat().st_ino == inode  # no new file
    assert [c.step for c in local.local_copies(tmp_path)] == [30, 25]
    assert torch.equal(ck.read_shard(published)["w"], torch.full((3,), 3.0))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_snapshot_through_the_writer_is_skipped_while_a_write_is_in_flight(
        tmp_path: Path, one_rank_group: object) -> None:
    """`checkpoint.snapshot_device_copy` off (or no room in device memory): snapshots are
    staged like saves and wait for no write; one is skipped while the writer is busy."""
    store = tmp_path / "store"
    cfg = CheckpointConfig(dir=str(store), interval_steps=10, mode="async",
                           local_dir=str(tmp_path / "shm"), local_interval_steps=5,
                           test_write_delay_seconds=1.0, snapshot_device_copy=False)
    checkpointer = ck.Checkpointer(cfg, root=store, rank=0, world_size=1,
                                   device=torch.device("cpu"), identity="a9")
    assert checkpointer._local is not None
    try:
        checkpointer.save(10, {"w": torch.full((3,), 1.0), "step": 10})
        assert not checkpointer.snapshot_ready()  # the save's write is still in flight
        checkpointer.wait_until_committed(30)
        assert checkpointer.snapshot_ready()
        checkpointer.snapshot(15, {"w": torch.full((3,), 1.5), "step": 15})
        checkpointer._wait_for_local_write(time.monotonic() + 30)
        assert [c.step for c in local.local_copies(checkpointer._local)] == [15, 10]
    finally:
        checkpointer.close()


def test_a_resume_deletes_the_copies_of_steps_after_the_one_it_started_from(
        tmp_path: Path, one_rank_group: object) -> None:
    """Copies newer than the resumed step belong to a line of training given up (here: the
    copy of step 30 cannot be read, so the job resumes from the store's step 20). Kept, one of
    them could later be paired with another rank's copy of the same step from the new line."""
    store = tmp_path / "store"
    save_checkpoint(store, 20, world_size=1)
    checkpointer = _checkpointer(store, tmp_path / "shm")
    assert checkpointer._local is not None
    copy = _write(checkpointer._local, 30, value=3.0)
    copy.write_bytes(copy.read_bytes()[:20])  # a copy that cannot be read
    loaded = checkpointer.load_latest()
    assert loaded is not None and loaded.source == "store" and loaded.state["step"] == 20
    assert local.local_copies(checkpointer._local) == []


def test_snapshots_need_a_local_folder() -> None:
    with pytest.raises(ValueError) as refused:
        CheckpointConfig(local_interval_steps=5)
    assert ("checkpoint.local_interval_steps: node-local snapshots need checkpoint.local_dir"
            in str(refused.value))


def test_the_staging_buffer_is_allocated_beside_the_step_loop_and_a_save_waits_for_it(
        tmp_path: Path, one_rank_group: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """`prepare` (after an attempt's first step) no longer allocates and page-locks the staging
    buffer in the step loop (seconds for GBs, in every new process): a thread does, and the
    first save waits for it."""
    import threading

    from rtj_trainer.checkpoint import staging

    gate = threading.Event()
    threads: list[str] = []
    allocate = staging.HostStaging.ensure

    def held_back(self: staging.HostStaging, nbytes: int, device: torch.device) -> torch.Tensor:
        threads.append(threading.current_thread().name)
        assert gate.wait(30)
        return allocate(self, nbytes, device)

    monkeypatch.setattr(staging.HostStaging, "ensure", held_back)
    store = tmp_path / "store"
    cfg = CheckpointConfig(dir=str(store), interval_steps=10, mode="async")
    checkpointer = ck.Checkpointer(cfg, root=store, rank=0, world_size=1,
                                   device=torch.device("cpu"), identity="a9")
    state = {"w": torch.full((1000,), 2.0), "step": 10}
    try:
        checkpointer.prepare(state)  # returns while the allocation is held back
        assert threads == ["rtj-staging-allocation"] and checkpointer._staging.buffer is None
        gate.set()
        checkpointer.save(10, state)
        assert checkpointer._allocating is None and checkpointer._staging.buffer is not None
        checkpointer.wait_until_committed(30)
        assert checkpointer.stats.committed_step == 10
    finally:
        gate.set()
        checkpointer.close()


def _deferring(tmp_path: Path) -> ck.Checkpointer:
    """An async checkpointer with the snapshots' device copy, saves staged through it
    (`checkpoint.save_device_copy`, on CPU only when asked: the device buffer is host memory)."""
    store = tmp_path / "store"
    cfg = CheckpointConfig(dir=str(store), interval_steps=10, mode="async",
                           local_dir=str(tmp_path / "shm"), local_interval_steps=5,
                           save_device_copy=True)
    return ck.Checkpointer(cfg, root=store, rank=0, world_size=1, device=torch.device("cpu"),
                           identity="a9")


def test_a_save_staged_through_the_device_copy_is_of_its_step_and_commits(
        tmp_path: Path, one_rank_group: object) -> None:
    """Issue #32: the step loop waited ~0.2 s a save for the device-to-host copy of an 11.3 GB
    shard. Staged through the snapshots' device buffer, `save` returns after the copy into it;
    a thread copies that buffer to the staging buffer, and the write is requested once it is
    there. The committed shard holds the state of its step although the state changed in place
    right after `save` returned, and the staging buffer then holds that save (an in-process
    restart's rollback)."""
    checkpointer = _deferring(tmp_path)
    assert checkpointer.defers_saves()
    weights = torch.full((1000,), 1.0)
    try:
        checkpointer.prepare({"w": weights, "step": 0})  # after the first step: the buffers
        checkpointer.save(10, {"w": weights, "step": 10})
        assert checkpointer._deferred is not None  # the write is not requested yet
        assert checkpointer._staging.staged is None  # nor does the buffer hold it yet
        weights.fill_(9.0)  # the next steps' updates
        checkpointer.wait_until_committed(30)
        assert checkpointer._deferred is None
        assert checkpointer.stats.committed_step == 10
        copies = checkpointer.snapshot_copies()  # the save's copy counted apart
        assert copies["save_copy_launch_seconds"] > 0 and copies["copy_launch_seconds"] == 0
        # the commit's seconds split into phases that add up to the whole
        phases = checkpointer.stats.last_commit
        assert phases["step"] == 10 and phases["write"] > 0
        parts = ("staging", "queued", "write", "fsync", "record", "commit", "noticed")
        assert all(phases[part] >= 0 for part in parts), phases
        assert abs(sum(phases[part] for part in parts) - phases["total"]) < 0.005, phases
        staged = checkpointer._staging.staged
        assert staged is not None and staged.step == 10 and not staged.live
        shard = next((tmp_path / "store").glob("step-000000010.*/*.bin"))
        state = ck.read_shard(shard)
        assert state["step"] == 10 and torch.equal(state["w"], torch.full((1000,), 1.0))
        copy = next(c for c in local.local_copies(checkpointer._local) if c.step == 10)
        assert torch.equal(ck.read_shard(copy.path)["w"], torch.full((1000,), 1.0))
        # the device buffer is free again: the next snapshot is taken, of its own step
        assert checkpointer.snapshot_ready()
        checkpointer.snapshot(15, {"w": weights, "step": 15})
        checkpointer._snapshots.wait(30)
        copy = next(c for c in local.local_copies(checkpointer._local) if c.step == 15)
        assert torch.equal(ck.read_shard(copy.path)["w"], torch.full((1000,), 9.0))
    finally:
        checkpointer.close()


def test_a_save_is_staged_as_before_while_a_snapshot_is_being_copied(
        tmp_path: Path, one_rank_group: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The device buffer is busy while a snapshot's thread copies it: a save due then is staged
    into the host buffer in the step loop (it does not wait for the snapshot)."""
    import threading

    from rtj_trainer.checkpoint import snapshots

    gate = threading.Event()
    write = snapshots.SnapshotTaker._write

    def held_back(self: snapshots.SnapshotTaker, *args: object) -> None:
        assert gate.wait(30)
        write(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(snapshots.SnapshotTaker, "_write", held_back)
    checkpointer = _deferring(tmp_path)
    try:
        checkpointer.snapshot(5, {"w": torch.full((10,), 0.5), "step": 5})
        assert not checkpointer.defers_saves()
        checkpointer.save(10, {"w": torch.full((10,), 1.0), "step": 10})
        assert checkpointer._deferred is None
        staged = checkpointer._staging.staged
        assert staged is not None and staged.step == 10  # staged in the step loop
        gate.set()
        checkpointer.wait_until_committed(30)
        assert checkpointer.stats.committed_step == 10
    finally:
        gate.set()
        checkpointer.close()


def test_an_aborted_attempt_gives_up_a_save_still_being_staged(
        tmp_path: Path, one_rank_group: object) -> None:
    """An in-process restart closes the checkpointer (abort) before the save's write was
    requested: the save is given up (nothing written, nothing left pending), as a save whose
    busy writer is stopped is, and the staging buffer claims no save."""
    checkpointer = _deferring(tmp_path)
    try:
        checkpointer.prepare({"w": torch.full((10,), 0.0), "step": 0})
        checkpointer.save(10, {"w": torch.full((10,), 1.0), "step": 10})
        assert checkpointer._deferred is not None
    finally:
        checkpointer.close(abort=True)
        checkpointer._writers.release()  # the idle writer it kept for a next attempt
    assert checkpointer._deferred is None and not checkpointer._pending
    assert checkpointer._staging.staged is None
    assert not list((tmp_path / "store").glob("step-000000010.*/*.json"))
    assert not local.local_copies(checkpointer._local)


def test_a_failed_staging_copy_leaves_the_saves_error_record_and_it_never_commits(
        tmp_path: Path, one_rank_group: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The thread's copy into the staging buffer fails (e.g. a device error): the save is not
    written; its `.error` record says why, as a failed write's does, and rank 0 abandons it."""
    from rtj_trainer.checkpoint import snapshots

    def fails(self: snapshots.SnapshotTaker, source: torch.Tensor, target: torch.Tensor,
              event: object) -> None:
        self._staging_error = RuntimeError("injected staging failure")

    monkeypatch.setattr(snapshots.SnapshotTaker, "_to_host", fails)
    checkpointer = _deferring(tmp_path)
    checkpointer.cfg = checkpointer.cfg.model_copy(update={"commit_timeout_seconds": 2.0})
    try:
        checkpointer.prepare({"w": torch.full((10,), 0.0), "step": 0})
        checkpointer.save(10, {"w": torch.full((10,), 1.0), "step": 10})
        assert checkpointer.stats.saves_through_device_copy == 1
        checkpointer.wait_until_committed(30)
        assert checkpointer.stats.committed_step < 10
        errors = list((tmp_path / "store").glob("step-000000010.*/*.error"))
        assert len(errors) == 1 and "injected staging failure" in errors[0].read_text()
        assert checkpointer._staging.staged is None
    finally:
        checkpointer.close()


def test_a_save_of_another_size_than_the_device_buffer_is_staged_as_before(
        tmp_path: Path, one_rank_group: object) -> None:
    """A save whose state is not the size of the snapshots' device buffer (read another way
    than the snapshots') is staged in the step loop: the buffer is not given up for it (on a
    GPU the freed block would not count as free, and the snapshots would stop)."""
    checkpointer = _deferring(tmp_path)
    try:
        checkpointer.prepare({"w": torch.full((1000,), 1.0), "step": 0})  # the buffer's size
        buffer = checkpointer._snapshots._buffer
        assert buffer is not None
        checkpointer.save(10, {"w": torch.full((2000,), 1.0), "step": 10})
        assert checkpointer._deferred is None and checkpointer.stats.saves_through_device_copy == 0
        assert checkpointer._snapshots._buffer is buffer
        checkpointer.save(20, {"w": torch.full((1000,), 2.0), "step": 20})
        assert checkpointer.stats.saves_through_device_copy == 1
        checkpointer.wait_until_committed(30)
        assert checkpointer.stats.committed_step == 20
    finally:
        checkpointer.close()
