"""The carry-over object (rtj_trainer.carry.CarryOver): what one in-process attempt hands to the
next attempt in the same process, and only that. Two consecutive attempts share one CarryOver
(as `Resiliency` passes it through every `Session`); a new process (a new CarryOver) starts with
nothing. Checked for each thing it carries: the staging buffer and the save it holds, the
training state an interrupted attempt offered, a close the restart cut short, the kept writer and
the one to replace, and the gloo connections to cut."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from rtj_trainer import checkpoint as ck
from rtj_trainer import gloocut
from rtj_trainer.carry import CarryOver
from rtj_trainer.config import CheckpointConfig

pytestmark = pytest.mark.unit


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


def attempt(store: Path, carry: CarryOver, identity: str) -> ck.Checkpointer:
    """One attempt's checkpointer, as `Trainer` builds it from `session.carry`."""
    ck.close_interrupted(carry)  # what the next attempt does first (Trainer.__init__)
    ck.stage_offered(carry)
    config = CheckpointConfig(dir=str(store), interval_steps=0, mode="sync")
    return ck.Checkpointer(config, root=store, rank=0, world_size=1, device=torch.device("cpu"),
                           identity=identity, carry=carry)


def state(step: int) -> dict[str, Any]:
    return {"w": torch.full((3, 2), float(step)), "step": step}


def test_the_next_attempt_sees_the_save_and_the_offer_of_the_one_before_and_nothing_else(
        tmp_path: Path, one_rank: None) -> None:
    carry = CarryOver()
    first = attempt(tmp_path, carry, "a0-l0-i0-1")
    first.save(10, state(10))
    assert carry.unclosed == [first]
    # The attempt is interrupted after step 12 with its state intact: it offers it; the
    # wrapper's finalize step (or the next attempt's start) stages it once.
    ck.expect_offer(carry, lambda: first.offer_live(12, state(12)))
    first.close(abort=True)
    assert carry.unclosed == [] and carry.offer is not None and carry.offered is None
    second = attempt(tmp_path, carry, "a0-l0-i1-2")  # stages the offer before it builds
    assert carry.offer is None and carry.offered is None
    loaded = second.load_latest()
    assert loaded is not None and loaded.source == "live" and loaded.state["step"] == 12
    assert torch.equal(loaded.state["w"], torch.full((3, 2), 12.0))
    second.close(abort=True)
    # Another process: nothing carried over; it resumes from the store (the sync save of 10).
    other = attempt(tmp_path, CarryOver(), "a1-l0-i0-3")
    loaded = other.load_latest()
    assert loaded is not None and loaded.source == "store" and loaded.state["step"] == 10
    other.close()


def test_a_close_cut_short_is_finished_by_the_next_attempt_of_that_process_only(
        tmp_path: Path, one_rank: None) -> None:
    carry, elsewhere = CarryOver(), CarryOver()
    cut_short = attempt(tmp_path, carry, "a0-l0-i0-1")
    committer = cut_short._commit_worker()  # rank 0's commit thread runs
    assert ck.close_interrupted(elsewhere) == 0  # another process has nothing of it
    assert ck.close_interrupted(carry) == 1
    assert cut_short._committer is None and committer is not None
    assert carry.unclosed == []


class FakeWriter:
    """Stands in for NVRx's writer queue: `persistent_caller.process` and `close`."""

    def __init__(self, alive: bool = True) -> None:
        self.persistent_caller = SimpleNamespace(process=SimpleNamespace(is_alive=lambda: alive))
        self.closed = False

    def close(self, abort: bool = False) -> None:
        self.closed = True


def test_an_idle_writer_kept_by_one_attempt_is_taken_by_the_next(
        monkeypatch: pytest.MonkeyPatch) -> None:
    spawned: list[int] = []
    monkeypatch.setattr(ck.carried.asyncwriter, "spawn",
                        lambda rank, arm: spawned.append(rank) or FakeWriter())
    carry = CarryOver()
    kept = FakeWriter()
    ck.ProcessWriter(carry).keep(kept)  # attempt 1 ends by an in-process restart, writer idle
    assert ck.ProcessWriter(carry).take(0) is kept and spawned == []  # attempt 2 takes it
    assert carry.writer is None
    ck.ProcessWriter(CarryOver()).take(0)  # another process spawns its own
    assert spawned == [0]
    dead = FakeWriter(alive=False)
    ck.ProcessWriter(carry).keep(dead)
    assert ck.ProcessWriter(carry).take(3) is not dead and dead.closed and spawned == [0, 3]
    ck.ProcessWriter(carry).stopped_busy(5)  # a writer stopped mid-write: replaced at once
    ck.ProcessWriter(carry).start_replacement()
    assert spawned == [0, 3, 5] and carry.writer_to_replace is None


def test_the_gloo_connections_recorded_by_an_attempt_are_cut_through_its_process_carry() -> None:
    carry = CarryOver()
    before = gloocut.snapshot()
    server = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    try:
        assert carry.gloo.record(before) == 2
        assert CarryOver().gloo.cut() == 0  # another process's carry holds none of them
        assert carry.gloo.cut() == 2
        assert client.recv(1) == b""  # shut down
    finally:
        for s in (server, client, accepted):
            s.close()
