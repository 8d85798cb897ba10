"""TRAINER_FAULTS parsing (errors quote the entry) and once-per-job firing."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rtj_trainer.faults import Fault, FaultInjector, FaultSpecError, InjectedFault, parse_faults

pytestmark = pytest.mark.unit


def test_fault_list_parses_every_kind() -> None:
    faults = parse_faults(" 8:1:exception, 17:0:sigkill,26:1:hang,30:0:exit=3,40:2:launcher-kill,"
                          "41:0:stall=2.5")
    assert faults == (
        Fault(8, 1, "exception"), Fault(17, 0, "sigkill"), Fault(26, 1, "hang"),
        Fault(30, 0, "exit", 3), Fault(40, 2, "launcher-kill"), Fault(41, 0, "stall", seconds=2.5),
    )
    assert faults[-1].marker_name == "step41-rank0-stall2.5"
    assert parse_faults("") == ()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("8:1", "expected STEP:RANK:KIND"),
        ("x:1:hang", "must be integers"),
        ("0:1:hang", "STEP >= 1"),
        ("8:1:explode", "unknown KIND 'explode'"),
        ("8:1:exit=abc", "exit=CODE needs an integer"),
        ("8:1:exit=0", "CODE must be 1..255"),
        ("8:1:exit", "unknown KIND 'exit'"),
        ("8:1:stall", "unknown KIND 'stall'"),
        ("8:1:stall=soon", "stall=SECONDS needs a number"),
        ("8:1:stall=0", "SECONDS must be in (0, 3600]"),
        ("8:1:stall=nan", "SECONDS must be in (0, 3600]"),
    ],
)
def test_malformed_fault_entries_are_quoted_in_the_error(text: str, needle: str) -> None:
    with pytest.raises(FaultSpecError) as caught:
        parse_faults(text)
    assert needle in str(caught.value) and text.split(",")[0] in str(caught.value)


def test_a_fault_fires_once_per_job_even_for_a_new_process(tmp_path: Path) -> None:
    faults = parse_faults("5:0:exception,5:1:hang")
    first = FaultInjector(faults, rank=0, marker_dir=tmp_path)
    first.maybe_fire(4)
    with pytest.raises(InjectedFault):
        first.maybe_fire(5)
    assert (tmp_path / "step5-rank0-exception").exists()
    restarted = FaultInjector(faults, rank=0, marker_dir=tmp_path)  # a later attempt
    restarted.maybe_fire(5)  # already fired: does nothing
    assert restarted.already_fired(faults[0]) and not restarted.already_fired(faults[1])


def test_a_stall_blocks_the_step_and_then_lets_it_go_on(tmp_path: Path) -> None:
    """A slow step, not a hang: `fire` returns (the step goes on) after blocking that long."""
    (stall,) = parse_faults("3:0:stall=0.2")
    injector = FaultInjector((stall,), rank=0, marker_dir=tmp_path)
    began = time.monotonic()
    injector.maybe_fire(3)
    assert time.monotonic() - began >= 0.2
    assert injector.already_fired(stall)


def test_write_faults_fire_in_the_save_of_their_step_once_per_job(tmp_path: Path) -> None:
    faults = parse_faults("10:0:write-error, 10:0:exception, 20:0:write-lost, 20:1:write-error")
    assert [f.kind for f in faults] == ["write-error", "exception", "write-lost", "write-error"]
    injector = FaultInjector(faults, rank=0, marker_dir=tmp_path)
    with pytest.raises(InjectedFault):  # the step-start fault of the same step still fires
        injector.maybe_fire(10)
    assert injector.write_fault(10) == "error"  # the shard write fails, leaving `.error`
    assert injector.write_fault(20) == "lost"  # ... leaving nothing at all
    injector.maybe_fire(20)  # a write fault does not fire at the start of the step
    again = FaultInjector(faults, rank=0, marker_dir=tmp_path)  # a later attempt
    assert again.write_fault(10) is None and again.write_fault(20) is None
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step10-rank0-exception", "step10-rank0-write-error", "step20-rank0-write-lost"]


@pytest.mark.parametrize("fail", ["error", "lost"])
def test_an_injected_write_fault_leaves_what_a_real_failure_leaves(
    tmp_path: Path, fail: str
) -> None:
    import torch
    from rtj_trainer.checkpoint.writer import write_shard

    shard, record = tmp_path / "shard-0", tmp_path / "shard-0.json"
    args = (str(shard), str(record), {}, [], torch.zeros(4, dtype=torch.uint8), 0)
    if fail == "error":  # outside the writer process the failure is also raised
        with pytest.raises(OSError, match="injected shard write failure"):
            write_shard(*args, False, 0.0, fail=fail)
    else:
        write_shard(*args, False, 0.0, fail=fail)
    error = record.with_name(record.name + ".error")
    assert not shard.exists() and not record.exists()
    assert error.exists() == (fail == "error")
    if fail == "error":
        assert "injected shard write failure" in error.read_text()


def test_the_markers_time_is_taken_once_it_is_durable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The benchmarks read the marker's time as the moment of the fault: it must be the time
    after the fsyncs (with a checkpoint write in flight they took up to 1.4 s on a GPU host, and
    that wait was counted as detection). Each fsync here advances a clock by 1 s."""
    import os

    from rtj_trainer import faults as faults_module

    clock = [1_000_000.0]
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        real_fsync(fd)
        clock[0] += 1.0

    monkeypatch.setattr(faults_module.time, "time", lambda: clock[0])
    monkeypatch.setattr(faults_module.os, "fsync", slow_fsync)
    (fault,) = parse_faults("3:0:stall=0.01")
    FaultInjector((fault,), rank=0, marker_dir=tmp_path).maybe_fire(3)
    assert float((tmp_path / fault.marker_name).read_text()) == clock[0] == 1_000_002.0
