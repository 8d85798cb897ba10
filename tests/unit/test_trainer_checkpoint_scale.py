"""Commit and resume at 512 ranks (review T4): which files each rank touches, counted.

No process group: the per-rank halves of a resume (`resume_plans` on rank 0, then each rank's
`own_shard_problems` against the record rank 0 scattered to it) and of a commit (rank 0's `poll`
and commit thread, the other ranks' `poll`) are called directly, as the collectives would call
them. Every filesystem call under the store (`stat`, `open`, `listdir`, `scandir`) is recorded
with the thread that made it, by wrapping the `os`/`io` functions that pathlib and the store use.
"""

from __future__ import annotations

import builtins
import hashlib
import io
import json
import os
import pickle
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from rtj_trainer import checkpoint as ck
from rtj_trainer.checkpoint.tracking import PendingSave
from rtj_trainer.config import CheckpointConfig

pytestmark = pytest.mark.unit

WORLD = 512
IDENTITY = "a1-l0-i0-1"


class FileAccess:
    """(operation, path, thread id) of every filesystem call on a path under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.calls: list[tuple[str, Path, int]] = []

    def wrap(self, name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(path: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(path, str | os.PathLike) and os.fspath(path).startswith(self.root):
                self.calls.append((name, Path(os.fspath(path)), threading.get_ident()))
            return real(path, *args, **kwargs)
        return recorded

    def on(self, thread: int) -> list[tuple[str, Path]]:
        return [(op, path) for op, path, ident in self.calls if ident == thread]

    def clear(self) -> None:
        self.calls.clear()


@pytest.fixture
def access(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FileAccess]:
    recorder = FileAccess(tmp_path)
    for module, name in ((os, "stat"), (os, "lstat"), (os, "open"), (os, "listdir"),
                         (os, "scandir"), (io, "open"), (builtins, "open")):
        monkeypatch.setattr(module, name, recorder.wrap(name, getattr(module, name)))
    yield recorder


def _write_rank(directory: Path, rank: int, step: int, *, shard: bool = True,
                record: bool = True) -> ck.ShardRecord:
    data = f"step {step} rank {rank}".encode()
    path = directory / ck.shard_file_name(rank, WORLD)
    if shard:
        path.write_bytes(data)
    made = ck.ShardRecord(rank, path.name, len(data),
                          (ck.ChunkDigest(0, len(data), hashlib.sha256(data).hexdigest()),))
    if record:
        (directory / ck.shard_record_name(rank, WORLD)).write_text(json.dumps(made.to_json()))
    return made


def _directory(root: Path, step: int) -> Path:
    directory = root / ck.checkpoint_dir_name(step, IDENTITY)
    directory.mkdir(parents=True)
    return directory


def _committed(root: Path, step: int) -> Path:
    """512 tiny shards and the manifest `commit` would write (without their shard records,
    which a resume does not read, and without fsyncs: a busy disk makes 1,000 files slow)."""
    directory = _directory(root, step)
    records = tuple(_write_rank(directory, rank, step, record=False) for rank in range(WORLD))
    manifest = ck.Manifest(step=step, world_size=WORLD, shards=records,
                           committed_at=time.time(), identity=IDENTITY)
    (directory / ck.MANIFEST).write_text(json.dumps(manifest.to_json()))
    return directory


def _checkpointer(root: Path, rank: int) -> ck.Checkpointer:
    # interval 0: no NVRx writer process (the shards above are written already)
    cfg = CheckpointConfig(dir=str(root), interval_steps=0, keep=5)
    return ck.Checkpointer(cfg, root=root, rank=rank, world_size=WORLD,
                           device=torch.device("cpu"), identity=IDENTITY)


def test_a_resume_at_512_ranks_reads_manifests_on_rank_0_and_one_shard_per_rank(
        tmp_path: Path, access: FileAccess) -> None:
    root = tmp_path / "store"
    older = _directory(root, 10)
    (older / ck.MANIFEST).write_text("{")  # a torn manifest: rank 0's verdict, no shard looked at
    newest = _committed(root, 20)
    directories = [older, newest]
    broken = newest / ck.shard_file_name(7, WORLD)
    broken.write_bytes(broken.read_bytes()[::-1])  # rank 7's newest shard is corrupt
    me = threading.get_ident()

    access.clear()
    # Rank 0's part of load_latest: the checks that may refuse to start, then the plans.
    committed = ck.read_committed(root)
    ck.refuse_foreign_checkpoints(root, job="", committed=committed)
    ck.refuse_other_world_size(root, world_size=WORLD, committed=committed)
    plans = ck.resume_plans(root, world_size=WORLD, committed=committed)
    leader = access.on(me)
    touched = {path for _, path in leader}
    # Rank 0: the listing and the two manifests, each read once; not one shard or record.
    assert touched <= {root} | {d for d in directories} | {d / ck.MANIFEST for d in directories}
    opened = Counter(path for op, path in leader if "open" in op)
    assert opened == {d / ck.MANIFEST: 1 for d in directories}
    assert len(leader) <= 4 * len(directories) + 2, Counter(op for op, _ in leader)

    assert len(plans) == WORLD
    assert [name for name, _ in plans[0].candidates] == [newest.name, older.name]
    assert plans[0].candidates[0][1] == "" and "unreadable manifest" in plans[0].candidates[1][1]
    assert plans[0].committed is not None and plans[0].committed[0] == 20
    for rank in (0, 7, 511):
        record = plans[rank].records[0]
        assert record is not None and record["rank"] == rank and plans[rank].records[1] is None
    # What one rank receives is small: its own records, not the manifest of 512.
    assert len(pickle.dumps(plans[511])) < 2048

    checkpointers = [_checkpointer(root, rank) for rank in range(WORLD)]
    access.clear()
    verdicts = {rank: checkpointers[rank].own_shard_problems(newest, plans[rank].records[0])
                for rank in range(WORLD)}
    assert [rank for rank, problems in verdicts.items() if problems] == [7]
    assert "fails its sha256" in verdicts[7][0]
    per_file = Counter(path for _, path in access.on(me))
    # Each rank looked at its own shard only: 512 files in all, each by a stat and one open.
    assert set(per_file) == {newest / ck.shard_file_name(rank, WORLD) for rank in range(WORLD)}
    assert max(per_file.values()) <= 2
    assert sum(per_file.values()) <= 2 * WORLD  # not WORLD * WORLD stats


def test_a_commit_at_512_ranks_runs_off_rank_0s_step_loop(
        tmp_path: Path, access: FileAccess) -> None:
    root = tmp_path / "store"
    directory = _directory(root, 10)
    for rank in range(WORLD - 1):  # rank 511 is still writing (the commit reads records only)
        _write_rank(directory, rank, 10, shard=False)
    leader = _checkpointer(root, 0)
    leader._pending = [PendingSave(10, directory, time.time(), 0.0)]
    me = threading.get_ident()
    access.clear()
    for _ in range(20):  # twenty steps while rank 511's write is in flight
        assert leader.poll().committed_step == -1
    assert access.on(me) == []
    _write_rank(directory, WORLD - 1, 10, shard=False)  # (this test's own write, this thread)
    written = len(access.calls)
    leader.wait_until_committed(timeout_seconds=60)
    assert leader.stats.committed_step == 10 and leader.stats.newly_committed == [10]
    # The step loop's thread touched no file of the store; the commit thread read each
    # record exactly once, however many times it looked at the directory.
    assert [call for call in access.calls[written:] if call[2] == me] == []
    records = Counter(path.name for op, path, thread in access.calls
                      if thread != me and "open" in op and path.name.endswith(".json")
                      and path.name.startswith("shard-"))
    assert len(records) == WORLD and set(records.values()) == {1}
    assert ck.read_manifest(directory).world_size == WORLD
    leader.close(abort=True)

    followers = [_checkpointer(root, rank) for rank in range(1, WORLD)]
    for follower in followers:
        follower._pending = [PendingSave(10, directory, time.time(), 0.0),
                             PendingSave(20, root / ck.checkpoint_dir_name(20, IDENTITY),
                                      time.time(), 0.0)]
    access.clear()
    for follower in followers:
        stats = follower.poll()
        assert stats.committed_step == 10 and [p.step for p in follower._pending] == [20]
    # Each other rank learned the commit from one small file: one stat and one read each, and
    # none read the manifest (512 records) or looked at the checkpoint directory.
    progress = root / ck.COMMIT_PROGRESS
    assert Counter(path for _, path, _ in access.calls) == {progress: 2 * (WORLD - 1)}
    access.clear()
    for follower in followers:  # the next step: step 20 not resolved, the file unchanged
        assert follower.poll().newly_committed == []
    assert Counter(op for op, _, _ in access.calls) == {"stat": WORLD - 1}
