"""Resuming from memory (rtj_trainer.checkpoint.staging `HostStaging.staged`): after an in-process
restart every rank still holds its last save in its staging buffer; the ranks roll back from there
when all hold the same save and it is not older than the newest commit, also when that save was
never committed; a staging copy cut short is never offered; a loaded state never shares memory
with the buffer once it is in the optimizer."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from checkpoint_helpers import save_checkpoint
from rtj_trainer import checkpoint as ck
from rtj_trainer.carry import CarryOver
from rtj_trainer.config import CheckpointConfig
from rtj_trainer.parallel import into_template

pytestmark = pytest.mark.unit


@pytest.fixture
def one_rank_group() -> Iterator[CarryOver]:
    """One rank's process group, and what the process carries from one attempt to the next (a
    fresh "process": no buffer kept by another test)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield CarryOver()
    dist.destroy_process_group()


def _checkpointer(store: Path, identity: str, carry: CarryOver, **cfg: object) -> ck.Checkpointer:
    config = CheckpointConfig(dir=str(store), interval_steps=0, mode="sync", **cfg)
    return ck.Checkpointer(config, root=store, rank=0, world_size=1,
                           device=torch.device("cpu"), identity=identity, carry=carry)


def _state(step: int) -> dict[str, object]:
    return {"w": torch.full((4, 3), float(step)), "step": step,
            "optim": {"step": torch.tensor(float(step))}, "rng": [1, 2]}


def test_the_next_attempt_resumes_from_the_save_its_buffer_holds(
        tmp_path: Path, one_rank_group: CarryOver) -> None:
    store = tmp_path / "store"
    first = _checkpointer(store, "a0-l0-i0-1", one_rank_group)
    first.save(30, _state(30))  # sync: written and committed
    first.close(abort=True)  # an in-process restart keeps the buffer
    # The shard on disk is gone (or unreadable): memory does not need it.
    (store / ck.checkpoint_dir_name(30, "a0-l0-i0-1") / ck.shard_file_name(0, 1)).unlink()
    loaded = _checkpointer(store, "a0-l0-i1-2", one_rank_group).load_latest()
    assert loaded is not None and loaded.source == "memory" and loaded.committed
    assert loaded.state["step"] == 30 and torch.equal(loaded.state["w"], torch.full((4, 3), 30.0))
    assert loaded.directory.name == ck.checkpoint_dir_name(30, "a0-l0-i0-1")


def test_a_save_never_committed_is_still_resumed_from_memory(
        tmp_path: Path, one_rank_group: CarryOver) -> None:
    store = tmp_path / "store"
    save_checkpoint(store, 20, world_size=1)
    first = _checkpointer(store, "a0-l0-i0-1", one_rank_group)
    first.save(30, _state(30))
    # As if the writer had been stopped mid-write: the save never got its manifest.
    (store / ck.checkpoint_dir_name(30, "a0-l0-i0-1") / ck.format.MANIFEST).unlink()
    first.close(abort=True)
    loaded = _checkpointer(store, "a0-l0-i1-2", one_rank_group).load_latest()
    assert loaded is not None and loaded.source == "memory" and not loaded.committed
    assert loaded.state["step"] == 30


def test_a_commit_newer_than_the_buffer_wins(tmp_path: Path, one_rank_group: CarryOver) -> None:
    store = tmp_path / "store"
    first = _checkpointer(store, "a0-l0-i0-1", one_rank_group)
    first.save(30, _state(30))
    first.close(abort=True)
    save_checkpoint(store, 40, world_size=1)
    loaded = _checkpointer(store, "a0-l0-i1-2", one_rank_group).load_latest()
    assert loaded is not None and loaded.source == "store" and loaded.state["step"] == 40


def test_a_staging_copy_cut_short_is_never_offered(
        tmp_path: Path, one_rank_group: CarryOver) -> None:
    store = tmp_path / "store"
    save_checkpoint(store, 20, world_size=1)
    first = _checkpointer(store, "a0-l0-i0-1", one_rank_group)
    first.save(30, _state(30))
    broken = _state(40)
    broken["w"] = torch.empty((4, 3), device="meta")  # the copy fails halfway
    with pytest.raises(NotImplementedError):
        first.save(40, broken)
    first.close(abort=True)
    assert one_rank_group.staging.staged is None
    loaded = _checkpointer(store, "a0-l0-i1-2", one_rank_group).load_latest()
    assert loaded is not None and loaded.source == "store"


def test_a_finished_attempt_leaves_nothing_to_resume_from_memory(
        tmp_path: Path, one_rank_group: CarryOver) -> None:
    store = tmp_path / "store"
    first = _checkpointer(store, "a0-l0-i0-1", one_rank_group)
    first.save(30, _state(30))
    first.close()  # not an in-process restart: the buffer is released
    assert one_rank_group.staging.staged is None


def test_a_plain_tensor_loaded_into_the_optimizer_is_a_copy() -> None:
    buffer = torch.zeros(8)
    saved = buffer[2:3]
    loaded = into_template(torch.zeros(1), saved, "optimizer.state.0.step")
    loaded += 1  # Adam's `step_t += 1`
    assert torch.equal(buffer, torch.zeros(8))
