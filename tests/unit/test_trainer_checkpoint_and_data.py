"""Checkpoint manifests (commit, validation, fallback, pruning), payload round trips, data
determinism and the restart ledger. No processes, no sleeps: shards are written inline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from rtj_trainer import checkpoint as ck
from rtj_trainer.config import DataConfig
from rtj_trainer.data import TokenBatches
from rtj_trainer.metrics import advance_ledger, classify_restart

pytestmark = pytest.mark.unit


def _stage(state: dict[str, object]) -> tuple[object, list[ck.TensorLayout], torch.Tensor]:
    """What `stage_to_host` does on CPU: (skeleton, layout, one flat byte buffer)."""
    tensors: list[torch.Tensor] = []
    skeleton = ck.flatten_state(state, tensors)
    layout, total = ck.plan_layout(tensors)
    blob = torch.empty(total, dtype=torch.uint8)
    for view, tensor in zip(ck.tensor_views(blob, layout), tensors, strict=True):
        view.copy_(tensor)
    return skeleton, layout, blob


def _save(root: Path, step: int, world_size: int = 2, commit: bool = True) -> Path:
    """Write every rank's shard the way the NVRx writer does (several chunks and threads, as
    an 11 GB shard would be), then (optionally) commit."""
    directory = root / ck.checkpoint_dir_name(step, "a0-l0-i0-1")
    directory.mkdir(parents=True)
    for rank in range(world_size):
        state = {"w": torch.full((4, 3), float(step * 10 + rank)), "step": step,
                 "nested": [torch.arange(3), {"rng": torch.zeros(5, dtype=torch.uint8)}]}
        skeleton, layout, blob = _stage(state)
        ck.write_shard(str(directory / ck.shard_file_name(rank, world_size)),
                       str(directory / ck.shard_record_name(rank, world_size)),
                       skeleton, layout, blob, rank, False, 0.0, chunk_bytes=64, threads=3)
    if commit:
        assert ck.commit(directory, step=step, world_size=world_size, identity="a0") is not None
    return directory


def test_a_shard_round_trips_tensors_and_python_values(tmp_path: Path) -> None:
    directory = _save(tmp_path, 5)
    state = ck.read_shard(directory / ck.shard_file_name(1, 2))
    assert torch.equal(state["w"], torch.full((4, 3), 51.0))
    assert state["step"] == 5 and torch.equal(state["nested"][0], torch.arange(3))
    assert state["nested"][1]["rng"].dtype == torch.uint8


def test_a_shard_round_trips_bit_exactly_across_chunk_boundaries(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    tensors = {"bf16": torch.randn(257, 3, generator=generator).to(torch.bfloat16),
               "fp32": torch.randn(1001, generator=generator),
               "int64": torch.randint(-(2**62), 2**62, (77,), generator=generator),
               "empty": torch.zeros(0), "scalar": torch.tensor(2.5)}
    skeleton, layout, blob = _stage({**tensors, "text": "kept"})
    path = tmp_path / "shard.bin"
    ck.write_shard(str(path), str(tmp_path / "rec.json"), skeleton, layout, blob, 0, False, 0.0,
                   chunk_bytes=1000, threads=4)  # chunk edges fall inside tensors
    loaded = ck.read_shard(path)
    for key, saved in tensors.items():
        assert loaded[key].dtype == saved.dtype and loaded[key].shape == saved.shape
        as_bytes = [t.reshape(-1).view(torch.uint8).tolist() for t in (loaded[key], saved)]
        assert as_bytes[0] == as_bytes[1]
    assert loaded["text"] == "kept"


def test_parallel_writers_produce_the_same_file_as_one(tmp_path: Path) -> None:
    skeleton, layout, blob = _stage({"x": torch.randn(5000), "y": torch.arange(999)})
    for name, threads in (("one", 1), ("many", 8)):
        ck.write_shard(str(tmp_path / f"{name}.bin"), str(tmp_path / f"{name}.json"), skeleton,
                       layout, blob, 0, False, 0.0, chunk_bytes=4096, threads=threads)
    one, many = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("one", "many"))
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "many.bin").read_bytes()
    assert one["chunks"] == many["chunks"] and len(many["chunks"]) == 1 + 7  # header + 28,032 B
    assert many["writer"]["threads"] == 8 and many["writer"]["seconds"] > 0


def test_manifest_lists_every_shard_with_size_and_chunk_sha256s(tmp_path: Path) -> None:
    directory = _save(tmp_path, 5)
    manifest = ck.read_manifest(directory)
    assert manifest.step == 5 and manifest.world_size == 2
    for shard in manifest.shards:
        path = directory / shard.file
        assert shard.bytes == path.stat().st_size and len(shard.chunks) > 2
        assert ck.chunk_tiling_problem(shard.chunks, shard.bytes) is None
        ranges = [(chunk.offset, chunk.bytes) for chunk in shard.chunks]
        assert [chunk.sha256 for chunk in shard.chunks] == ck.digest_ranges(path, ranges)


def test_no_manifest_is_written_until_every_rank_has_a_shard(tmp_path: Path) -> None:
    directory = _save(tmp_path, 5, commit=False)
    (directory / ck.shard_record_name(1, 2)).unlink()  # rank 1 still writing
    assert ck.commit(directory, step=5, world_size=2, identity="a0") is None
    assert not (directory / ck.MANIFEST).exists()
    assert ck.committed_checkpoints(tmp_path) == []


def test_resume_picks_the_newest_committed_checkpoint(tmp_path: Path) -> None:
    _save(tmp_path, 5)
    newest = _save(tmp_path, 10)
    _save(tmp_path, 15, commit=False)  # a writer killed mid-save: never committed
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
    previous = _save(tmp_path, 5)
    newest = _save(tmp_path, 10)
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
    _save(tmp_path, 5, world_size=2)
    chosen, rejected = ck.newest_valid_checkpoint(tmp_path, world_size=4)
    assert chosen is None and "written by 2 ranks, this job has 4" in rejected[0]


def test_a_manifest_with_missing_ranks_is_malformed(tmp_path: Path) -> None:
    directory = _save(tmp_path, 5)
    data = json.loads((directory / ck.MANIFEST).read_text())
    data["shards"] = data["shards"][:1]
    (directory / ck.MANIFEST).write_text(json.dumps(data))
    assert "manifest lists ranks [0] for world size 2" in ck.validation_problems(
        directory, world_size=2, verify_ranks=None, verify_checksums=False)[0]


def test_a_manifest_whose_chunks_leave_bytes_unchecked_is_malformed(tmp_path: Path) -> None:
    directory = _save(tmp_path, 5)
    data = json.loads((directory / ck.MANIFEST).read_text())
    data["shards"][1]["chunks"] = data["shards"][1]["chunks"][:-1]
    (directory / ck.MANIFEST).write_text(json.dumps(data))
    (problem,) = ck.validation_problems(directory, world_size=2, verify_ranks=None,
                                        verify_checksums=True)
    assert "malformed manifest" in problem and "chunks cover" in problem


def test_a_manifest_of_the_old_format_is_rejected(tmp_path: Path) -> None:
    directory = _save(tmp_path, 5)
    data = json.loads((directory / ck.MANIFEST).read_text())
    data["format"] = 1
    (directory / ck.MANIFEST).write_text(json.dumps(data))
    chosen, rejected = ck.newest_valid_checkpoint(tmp_path, world_size=2)
    assert chosen is None and "manifest format 1, expected 2" in rejected[0]


def test_pruning_keeps_the_last_k_and_drops_abandoned_partial_saves(tmp_path: Path) -> None:
    for step in (5, 10, 15):
        _save(tmp_path, step)
    abandoned = _save(tmp_path, 12, commit=False)
    in_flight = _save(tmp_path, 20, commit=False)
    deleted = ck.prune(tmp_path, keep=2)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert [ck.step_of(n) for n in names] == [10, 15, 20]
    assert abandoned in deleted and in_flight.exists()


def test_pruning_hides_doomed_checkpoints_at_once_and_defers_the_slow_delete(
    tmp_path: Path,
) -> None:
    for step in (5, 10, 15):
        _save(tmp_path, step)
    handed_over: list[Path] = []
    ck.prune(tmp_path, keep=2, delete=handed_over.append)  # a background deleter, not yet run
    assert [p.name for p in handed_over] == [".deleting-" + ck.checkpoint_dir_name(5, "a0-l0-i0-1")]
    assert handed_over[0].is_dir()  # still on disk, but no longer a checkpoint
    assert [ck.step_of(p.name) for p in ck.committed_checkpoints(tmp_path)] == [15, 10]
    ck.prune(tmp_path, keep=2)  # a later prune finishes what a dead process left behind
    assert not handed_over[0].exists()


def test_a_failed_write_leaves_an_error_record_and_no_commit(tmp_path: Path) -> None:
    directory = tmp_path / ck.checkpoint_dir_name(5, "x")  # never created: the write fails
    ck.write_shard(str(directory / "shard.bin"), str(tmp_path / "rec.json"), {}, [],
                   torch.zeros(64, dtype=torch.uint8), 0, True, 0.0)
    assert (tmp_path / "rec.json.error").exists() and not (tmp_path / "rec.json").exists()


def test_a_write_that_fails_midway_leaves_no_temporary_file(tmp_path: Path) -> None:
    (tmp_path / "shard.bin" / "in-the-way").mkdir(parents=True)  # written, then not renamed
    skeleton, layout, blob = _stage({"x": torch.arange(100)})
    ck.write_shard(str(tmp_path / "shard.bin"), str(tmp_path / "rec.json"), skeleton, layout,
                   blob, 0, True, 0.0)
    assert (tmp_path / "rec.json.error").exists() and not (tmp_path / "rec.json").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_batches_are_a_pure_function_of_step_and_rank() -> None:
    data = TokenBatches(DataConfig(batch_size=3, seed=7), seq_len=16, vocab_size=256)
    again = TokenBatches(DataConfig(batch_size=3, seed=7), seq_len=16, vocab_size=256)
    assert torch.equal(data.batch(12, 1), again.batch(12, 1))
    assert data.batch(12, 1).shape == (3, 17) and int(data.batch(12, 1).max()) < 256
    assert not torch.equal(data.batch(12, 1), data.batch(12, 0))
    assert not torch.equal(data.batch(12, 1), data.batch(13, 1))
    assert data.fingerprint() != TokenBatches(DataConfig(seed=8), seq_len=16,
                                              vocab_size=256).fingerprint()


def test_memmap_batches_read_the_token_file(tmp_path: Path) -> None:
    import numpy as np

    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    data = TokenBatches(DataConfig(kind="memmap", path=str(path), batch_size=2), seq_len=8,
                        vocab_size=65536)
    batch = data.batch(3, 0)
    assert batch.shape == (2, 9)
    assert torch.equal(batch[:, 1:] - batch[:, :-1], torch.ones(2, 8, dtype=torch.int64))
    assert torch.equal(batch, data.batch(3, 0))


def test_restarts_are_classified_from_the_previous_attempt() -> None:
    first = advance_ledger(None, now=100.0, pod_attempts={"0": 0, "1": 0},
                           launcher_restart_count=0, inprocess_iteration=0,
                           resumed_step_completed_at=None)
    assert first.restarts == {"inprocess": 0, "launcher": 0, "pod": 0}
    kw = {"pod_attempts": {"0": 0, "1": 0}, "launcher_restart_count": 0}
    assert classify_restart(first, inprocess_iteration=1, **kw) == "inprocess"  # type: ignore[arg-type]
    launcher = advance_ledger(first, now=130.0, pod_attempts={"0": 0, "1": 0},
                              launcher_restart_count=1, inprocess_iteration=0,
                              resumed_step_completed_at=120.0)
    assert launcher.restarts["launcher"] == 1 and launcher.lost_seconds == pytest.approx(10.0)
    pod = advance_ledger(launcher, now=200.0, pod_attempts={"0": 0, "1": 1},
                         launcher_restart_count=2, inprocess_iteration=0,
                         resumed_step_completed_at=None)
    assert pod.restarts == {"inprocess": 0, "launcher": 1, "pod": 1}
    assert pod.lost_seconds == pytest.approx(10.0 + 100.0)  # nothing committed: since job start
