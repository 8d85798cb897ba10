"""The goodput benchmark keeps the disk it runs on usable (issue #32's ratio run, 2026-12-06: the
baseline's DCP saves of an 11 GB state filled a 64 GB disk beside our run's saves and failed
with ENOSPC): the baseline keeps `checkpoint.keep` complete saves as the trainer does, and
`bench.goodput` deletes a finished run's saves and node-local copies before the next run."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.baseline_trainer import SAVE_PREFIX, prune_saves
from bench.goodput import free_checkpoints

pytestmark = pytest.mark.unit


def _save(root: Path, step: int, *, complete: bool) -> Path:
    path = root / f"{SAVE_PREFIX}{step:09d}"
    path.mkdir(parents=True)
    (path / "__0_0.distcp").write_bytes(b"x" * 10)
    if complete:
        (path / ".metadata").write_bytes(b"m")
    return path


def test_the_baseline_keeps_its_newest_complete_saves_and_no_cut_short_older_one(
        tmp_path: Path) -> None:
    _save(tmp_path, 100, complete=True)
    _save(tmp_path, 200, complete=False)  # a restart cut this async save short
    _save(tmp_path, 300, complete=True)
    _save(tmp_path, 400, complete=True)
    _save(tmp_path, 500, complete=False)  # newer than every complete one: may be in flight
    deleted = prune_saves(tmp_path, keep=2)
    assert sorted(p.name for p in deleted) == [f"{SAVE_PREFIX}{s:09d}" for s in (100, 200)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"{SAVE_PREFIX}{s:09d}" for s in (300, 400, 500)]
    assert prune_saves(tmp_path, keep=2) == []


def test_no_save_is_deleted_before_one_is_complete(tmp_path: Path) -> None:
    _save(tmp_path, 100, complete=False)
    assert prune_saves(tmp_path, keep=1) == []
    assert (tmp_path / f"{SAVE_PREFIX}{100:09d}").is_dir()


def test_a_finished_run_gives_its_saves_and_node_local_copies_back(tmp_path: Path) -> None:
    run_dir = tmp_path / "faulted-inprocess"
    ours = run_dir / "step-000000100.a0-l0-i0-1"
    ours.mkdir(parents=True)
    (ours / "rank0.shard").write_bytes(b"s" * 1000)
    theirs = _save(run_dir, 200, complete=True)
    local = tmp_path / "shm" / "rtj-local"
    local.mkdir(parents=True)
    (local / "copy").write_bytes(b"c" * 500)
    (run_dir / "losses.jsonl").write_text('{"step": 1}\n')
    (run_dir / "faults").mkdir()
    freed = free_checkpoints(run_dir, ["train.steps=10", f"checkpoint.local_dir={local}"])
    assert freed == 1000 + 10 + 1 + 500
    assert not ours.exists() and not theirs.exists() and not local.exists()
    assert (run_dir / "losses.jsonl").exists() and (run_dir / "faults").is_dir()
