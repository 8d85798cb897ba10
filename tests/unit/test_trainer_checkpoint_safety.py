"""Checkpoint trust (docs/security.md): shards load without executing code, and a job refuses
another job's checkpoints unless its spec names that job."""

from __future__ import annotations

import hashlib
import json
import math
import pickle
import struct
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoint_helpers import save_checkpoint, stage
from rtj_trainer import checkpoint as ck
from rtj_trainer.config import CheckpointConfig
from rtj_trainer.configload import build_config
from rtj_trainer.errors import ForeignCheckpointError

pytestmark = pytest.mark.unit


class _Plant:
    """A pickle that creates `marker` when it is unpickled: what a hostile job would plant."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[Path]]:
        return (Path.touch, (self.marker,))


def _replace_header(shard: Path, magic: bytes, meta: bytes) -> None:
    """Keep the shard's data, put `magic` and `meta` in front of it (same page-aligned layout)."""
    data = shard.read_bytes()
    (old_meta,) = struct.unpack("<Q", data[8:16])
    offset = 16 + old_meta
    offset += -offset % 4096
    head = magic + struct.pack("<Q", len(meta)) + meta
    shard.write_bytes(head + bytes(-len(head) % 4096) + data[offset:])


def _recommit(directory: Path, world_size: int, job: str = "") -> None:
    """Rewrite every shard record and the manifest to match the files as they are now: an
    attacker with write access to the volume can do that too."""
    (directory / ck.MANIFEST).unlink()
    for rank in range(world_size):
        shard = directory / ck.shard_file_name(rank, world_size)
        size = shard.stat().st_size
        digest = hashlib.sha256(shard.read_bytes()).hexdigest()
        record = ck.ShardRecord(rank, shard.name, size, (ck.ChunkDigest(0, size, digest),))
        (directory / ck.shard_record_name(rank, world_size)).write_text(
            json.dumps(record.to_json()))
    step = ck.step_of(directory.name)
    assert step is not None
    assert ck.commit(directory, step=step, world_size=world_size, identity="a0", job=job)


def test_plain_python_values_round_trip_through_the_json_header(tmp_path: Path) -> None:
    state = {
        "optimizer": {"state": {0: {"exp_avg": torch.ones(2)}, 1: {}},
                      "param_groups": [{"params": [0, 1], "betas": (0.9, 0.999), "lr": 1e-4}]},
        "monitor": {"calculated_sections": {"step", "ckpt"}, "frozen": frozenset({1})},
        "odd": [math.inf, -math.inf, None, True, b"\x00\xff", torch.bfloat16, "x", 7, 2.5],
        (1, "tuple-key"): "v",
    }
    skeleton, layout, blob = stage(state)
    directory = tmp_path / ck.checkpoint_dir_name(1, "a0")
    directory.mkdir()
    ck.write_shard(str(directory / "s.bin"), str(directory / "s.json"), skeleton, layout, blob,
                   0, False, 0.0)
    loaded = ck.read_shard(directory / "s.bin")
    assert torch.equal(loaded["optimizer"]["state"][0]["exp_avg"], torch.ones(2))
    assert loaded["optimizer"]["param_groups"] == state["optimizer"]["param_groups"]
    assert loaded["monitor"] == state["monitor"] and loaded[(1, "tuple-key")] == "v"
    assert loaded["odd"] == state["odd"]
    skeleton, layout, blob = stage({"nan": math.nan})
    ck.write_shard(str(directory / "n.bin"), str(directory / "n.json"), skeleton, layout, blob,
                   0, False, 0.0)
    assert math.isnan(ck.read_shard(directory / "n.bin")["nan"])


def test_a_state_that_is_not_plain_data_cannot_be_saved_and_the_error_names_it() -> None:
    class Custom:
        pass

    skeleton, _, _ = stage({"model": {"w": torch.zeros(1)}, "extra": {"hook": Custom()}})
    with pytest.raises(ck.CheckpointError, match=r"\.extra\.hook: a .*Custom; a checkpoint "
                                                 r"holds tensors and plain data only"):
        ck.encode_skeleton(skeleton)


@pytest.mark.parametrize("magic", [b"RTJSHRD3", b"RTJSHRD2"], ids=["current", "old-format"])
def test_a_planted_pickle_header_is_refused_and_never_executed(
        tmp_path: Path, magic: bytes) -> None:
    marker = tmp_path / "code-ran"
    payload = pickle.dumps({"format": ck.FORMAT_VERSION, "skeleton": _Plant(marker),
                            "layout": [], "blob_bytes": 0})
    shard = save_checkpoint(tmp_path / "store", 5) / ck.shard_file_name(0, 2)
    _replace_header(shard, magic, payload)
    with pytest.raises(ck.CheckpointError):
        ck.read_shard(shard)
    assert not marker.exists(), "reading the shard ran the planted code"
    pickle.loads(payload)  # the control: the payload is live, the old pickle reader ran it
    assert marker.exists()
    marker.unlink()


@pytest.mark.parametrize("skeleton", [
    {"object": "os.system"},
    {"dict": [[{"tensor": 0}, 1]], "extra": 1},
    {"tensor": -1},
    {"float": "1e999"},
], ids=["unknown-tag", "two-tags", "negative-slot", "float-not-nonfinite"])
def test_a_tampered_json_header_is_refused(tmp_path: Path, skeleton: object) -> None:
    shard = save_checkpoint(tmp_path, 5) / ck.shard_file_name(0, 2)
    meta = json.dumps({"format": ck.FORMAT_VERSION, "skeleton": skeleton,
                       "layout": [], "blob_bytes": 64}).encode()
    _replace_header(shard, b"RTJSHRD3", meta)
    with pytest.raises(ck.CheckpointError, match="malformed shard header"):
        ck.read_shard(shard)


def test_a_header_may_name_only_real_dtypes_and_tensors_inside_the_data(tmp_path: Path) -> None:
    shard = save_checkpoint(tmp_path, 5) / ck.shard_file_name(0, 2)
    data = shard.stat().st_size - 4096  # the header fits in the first page
    for layout, message in (([[0, 4, "os.system", [1]]], "unknown dtype 'os.system'"),
                            ([[0, data + 1, "uint8", [data + 1]]],
                             f"outside the {data}-byte data")):
        meta = json.dumps({"format": ck.FORMAT_VERSION, "skeleton": {"tensor": 0},
                           "layout": layout, "blob_bytes": data}).encode()
        _replace_header(shard, b"RTJSHRD3", meta)
        with pytest.raises(ck.CheckpointError, match=message):
            ck.read_shard(shard)


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


def _checkpointer(root: Path, job: str, accepted: tuple[str, ...] = ()) -> ck.Checkpointer:
    cfg = CheckpointConfig(dir=str(root), interval_steps=0)
    return ck.Checkpointer(cfg, root=root, rank=0, world_size=1, device=torch.device("cpu"),
                           identity="a9", job=job, accepted_jobs=accepted)


def test_a_resume_skips_a_planted_shard_with_forged_digests_and_runs_nothing(
        tmp_path: Path, one_rank_group: None) -> None:
    marker = tmp_path / "code-ran"
    save_checkpoint(tmp_path / "store", 10, world_size=1, job="ml/llama")
    planted = save_checkpoint(tmp_path / "store", 20, world_size=1, job="ml/llama")
    _replace_header(planted / ck.shard_file_name(0, 1), b"RTJSHRD3",
                    pickle.dumps({"skeleton": _Plant(marker)}))
    _recommit(planted, 1, job="ml/llama")
    loaded = _checkpointer(tmp_path / "store", "ml/llama").load_latest()
    assert loaded is not None and loaded.state["step"] == 10, "fell back to the older one"
    assert any("unreadable shard header" in r for r in loaded.rejected), loaded.rejected
    assert not marker.exists()


def test_a_resume_that_fell_back_reports_the_checkpoint_it_stands_on(
        tmp_path: Path, one_rank_group: None) -> None:
    # review-2 F14, the trainer's half: the ranks reported the newest valid manifest (step 20)
    # as their committed step although they resumed from step 10, so status.lastCheckpoint
    # named the rejected step until the next commit.
    older = save_checkpoint(tmp_path / "store", 10, world_size=1, job="ml/llama")
    newest = save_checkpoint(tmp_path / "store", 20, world_size=1, job="ml/llama")
    shard = newest / ck.shard_file_name(0, 1)
    shard.write_bytes(shard.read_bytes()[:-8])  # a torn shard: its size no longer fits
    checkpointer = _checkpointer(tmp_path / "store", "ml/llama")
    loaded = checkpointer.load_latest()
    assert loaded is not None and loaded.state["step"] == 10 and loaded.rejected
    assert checkpointer.stats.committed_step == 10
    assert checkpointer.stats.committed_at == ck.read_manifest(older).committed_at


def test_the_manifest_names_the_job_that_wrote_it(tmp_path: Path) -> None:
    directory = save_checkpoint(tmp_path, 5, job="ml/llama")
    assert json.loads((directory / ck.MANIFEST).read_text())["job"] == "ml/llama"
    assert ck.read_manifest(directory).job == "ml/llama"
    assert ck.job_identity("ml", "llama") == "ml/llama" and ck.job_identity("", "x") == "x"


def test_another_jobs_checkpoints_are_refused_naming_both_jobs_and_the_way_out(
        tmp_path: Path, one_rank_group: None) -> None:
    save_checkpoint(tmp_path, 5, world_size=1, job="team-a/llama")
    with pytest.raises(ForeignCheckpointError) as caught:
        _checkpointer(tmp_path, "team-b/llama").load_latest()
    message = str(caught.value)
    assert "team-a/llama (step-000000005" in message and "this job is team-b/llama" in message
    assert "spec.checkpoint.resumeFromJobs" in message
    assert caught.value.reason == "ForeignCheckpoint"


def test_a_job_resumes_its_own_checkpoints_and_those_its_spec_names(
        tmp_path: Path, one_rank_group: None) -> None:
    save_checkpoint(tmp_path, 5, world_size=1, job="team-a/llama")
    own = _checkpointer(tmp_path, "team-a/llama").load_latest()
    assert own is not None and own.state["step"] == 5
    named = _checkpointer(tmp_path, "team-b/llama", accepted=("team-a/llama",)).load_latest()
    assert named is not None and named.state["step"] == 5


def test_a_manifest_that_names_no_job_is_foreign_to_a_job_in_a_cluster(tmp_path: Path) -> None:
    save_checkpoint(tmp_path, 5, job="")
    with pytest.raises(ForeignCheckpointError, match=r"\(no job recorded\)"):
        ck.refuse_foreign_checkpoints(tmp_path, job="ml/llama")
    ck.refuse_foreign_checkpoints(tmp_path, job="")  # a local run outside a cluster


def test_the_operator_variable_lists_the_accepted_jobs() -> None:
    cfg = build_config(env={"RTJ_CHECKPOINT_RESUME_FROM_JOBS": "a/x, b/y"})
    assert cfg.checkpoint.resume_from_jobs == ("a/x", "b/y")
