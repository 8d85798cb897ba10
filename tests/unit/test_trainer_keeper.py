"""Device keepers on CPU (rtj_trainer.keeper): a real keeper process lends a memfd, its memory
outlives a SIGKILLed borrower, snapshots into it are recorded only once whole, and a resume uses
the record only while it names the keeper's current buffer. The CUDA path (CUDA IPC) is
tests/gpu/test_keeper_cuda.py; a whole run with keepers is in tests/e2e/test_trainer_ft_launcher.py.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from rtj_trainer import keeper
from rtj_trainer.checkpoint import devicecopy, snapshots
from rtj_trainer.checkpoint.loading import Resumable
from rtj_trainer.keeper import client
from rtj_trainer.nvrx import launcher as nvrx_launcher

CPU = torch.device("cpu")


@pytest.fixture
def keeper_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    directory = tmp_path / "keeper"
    directory.mkdir()
    process = subprocess.Popen([sys.executable, "-m", "rtj_trainer.keeper",
                                f"--directory={directory}", "--local-rank=0"])
    deadline = time.monotonic() + 60
    while not Path(keeper.socket_path(str(directory), 0)).exists():
        assert process.poll() is None and time.monotonic() < deadline, "the keeper did not start"
        time.sleep(0.05)
    monkeypatch.setenv(keeper.DIR_ENV, str(directory))
    monkeypatch.setenv("LOCAL_RANK", "0")
    client._opened.clear()
    yield directory
    process.kill()
    process.wait()
    client._opened.clear()


def test_the_keepers_memory_outlives_a_killed_borrower(keeper_dir: Path) -> None:
    child = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import os, signal, torch
        from rtj_trainer.keeper import client
        lease = client.lease(1 << 20, torch.device("cpu"), allocate=True)
        lease.tensor[:5] = torch.tensor([9, 8, 7, 6, 5], dtype=torch.uint8)
        print(lease.generation, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """)], capture_output=True, text=True, timeout=60)
    assert child.returncode == -signal.SIGKILL, child.stderr
    lease = client.lease(1 << 20, CPU, allocate=False)
    assert lease is not None and lease.generation == child.stdout.strip()
    assert lease.tensor[:6].tolist() == [9, 8, 7, 6, 5, 0]
    # another size: none without `allocate`; with it a new buffer (a new generation)
    assert client.lease(2 << 20, CPU, allocate=False) is None
    again = client.lease(2 << 20, CPU, allocate=True)
    assert again is not None and again.generation != lease.generation
    status = json.loads((keeper_dir / "keeper-0.json").read_text())
    assert status["buffer_bytes"] == 2 << 20 and status["generation"] == again.generation
    assert keeper.held_mb(str(keeper_dir)) == 0  # a CPU buffer holds no GPU memory


def test_without_a_keeper_a_lease_is_none_and_says_why(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv(keeper.DIR_ENV, raising=False)
    assert client.lease(1024, CPU, allocate=True) is None
    monkeypatch.setenv(keeper.DIR_ENV, str(tmp_path))  # set, but nobody listens
    assert client.lease(1024, CPU, allocate=True) is None
    assert "no device keeper for local rank" in caplog.text


def test_a_snapshot_is_recorded_once_whole_and_forgotten_before_the_next_copy(
        keeper_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "local"
    taker = snapshots.SnapshotTaker(folder, device=CPU, rank=0, bounce_bytes=1 << 20)
    weights = torch.arange(1000, dtype=torch.float32)
    assert taker.take(4, "a0-l0-i0-1", {"w": weights, "step": 4}) is not None
    assert taker.kept
    taker.wait(30)
    record = devicecopy.read(folder)
    assert record is not None and (record.step, record.identity) == (4, "a0-l0-i0-1")
    assert taker.written == 1
    weights.add_(1.0)
    taker._forget_kept()  # what `take` and `stage` do before the copy is launched (_copy_in)
    assert devicecopy.read(folder) is None
    assert taker.take(6, "a0-l0-i0-1", {"w": weights, "step": 6}) is not None
    taker.wait(30)
    record = devicecopy.read(folder)
    assert record is not None and record.step == 6
    resumer: Any = SimpleNamespace(_local=folder, device=CPU)
    found = Resumable._kept_copy(resumer)
    assert found is not None and found[0].step == 6
    views = found[1][record.layout[0].offset:record.layout[0].offset + record.layout[0].nbytes]
    assert torch.equal(views.view(torch.float32), weights)
    # a save of another size is not staged through the buffer and leaves the record standing
    host = lambda n: torch.empty(n, dtype=torch.uint8)  # noqa: E731
    assert taker.stage({"w": torch.ones(7), "step": 7}, host) is None
    record = devicecopy.read(folder)
    assert record is not None and record.step == 6
    # a save staged through the same buffer removes the record before its copy
    staged = taker.stage({"w": weights, "step": 7}, lambda n: torch.empty(n, dtype=torch.uint8))
    assert staged is not None and devicecopy.read(folder) is None
    taker.wait(30)
    taker.close()


def test_a_record_of_another_buffer_is_not_resumed_from(keeper_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "local"
    taker = snapshots.SnapshotTaker(folder, device=CPU, rank=0, bounce_bytes=1 << 20)
    taker.take(2, "a0-l0-i0-1", {"w": torch.ones(64)})
    taker.wait(30)
    taker.close()
    resumer: Any = SimpleNamespace(_local=folder, device=CPU)
    assert Resumable._kept_copy(resumer) is not None
    client.lease(4096, CPU, allocate=True)  # the keeper reallocated: the record is stale
    assert Resumable._kept_copy(resumer) is None
    devicecopy.record_path(folder).write_text("{not json")
    assert devicecopy.read(folder) is None and Resumable._kept_copy(resumer) is None


def test_the_reclaim_wait_allows_for_what_the_keepers_hold(tmp_path: Path) -> None:
    seen: list[float] = []

    class Agent:
        _ft_cfg = SimpleNamespace(gpu_memory_tolerance_mb=512.0)

        def _wait_for_gpu_memory_reclaim(self, num_gpus: int) -> None:
            seen.append(self._ft_cfg.gpu_memory_tolerance_mb)

    (tmp_path / "keeper-0.json").write_text(json.dumps({"cuda": True,
                                                        "cuda_buffer_bytes": 3 << 30}))
    (tmp_path / "keeper-1.json").write_text(json.dumps({"cuda": True, "cuda_buffer_bytes": 0}))
    held = keeper.held_mb(str(tmp_path))
    assert held == 3072 + keeper.CONTEXT_ALLOWANCE_MB
    nvrx_launcher._allow_keepers_in_reclaim(Agent, lambda: held)
    Agent()._wait_for_gpu_memory_reclaim(2)
    assert seen == [512.0 + held] and Agent._ft_cfg.gpu_memory_tolerance_mb == 512.0


@pytest.mark.parametrize("value", ["yes", "2"])
def test_the_switch_names_itself_when_it_is_neither_1_nor_0(value: str) -> None:
    with pytest.raises(SystemExit, match="RTJ_DEVICE_KEEPER"):
        keeper.switched_on({keeper.SWITCH_ENV: value})
    assert keeper.switched_on({}) is False and keeper.switched_on({keeper.SWITCH_ENV: "1"})


def test_a_resume_from_the_keepers_buffer_keeps_nothing_the_next_snapshot_overwrites(
        keeper_dir: Path, tmp_path: Path) -> None:
    from rtj_trainer.checkpoint.local import LocalCopy

    folder = tmp_path / "local"
    taker = snapshots.SnapshotTaker(folder, device=CPU, rank=0, bounce_bytes=1 << 20)
    weights = torch.arange(4096, dtype=torch.float32)
    taker.take(8, "a0-l0-i0-1", {"w": weights, "step": 8})
    taker.wait(30)
    resumer: Any = SimpleNamespace(_local=folder, device=CPU, root=tmp_path / "store",
                                   _agree=lambda ok: ok, _resumed_from=None)
    kept = Resumable._kept_copy(resumer)
    assert kept is not None
    loaded = Resumable._load_local(
        resumer, -1, {}, [[(8, "a0-l0-i0-1")]],
        [LocalCopy(8, "a0-l0-i0-1", devicecopy.record_path(folder))], kept)
    assert loaded is not None and loaded.source == "device" and not loaded.committed
    assert loaded.state["step"] == 8 and torch.equal(loaded.state["w"], weights)
    buffer = kept[1]
    begin, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    assert not begin <= loaded.state["w"].data_ptr() < end  # a copy, not a view of the buffer
    taker.take(9, "a0-l0-i0-1", {"w": weights + 1, "step": 9})  # overwrites the buffer
    taker.wait(30)
    assert torch.equal(loaded.state["w"], weights)
    taker.close()


def _keeper_fd_targets(keeper_dir: Path) -> list[str]:
    """The files the keeper holds open, by inode (every staging buffer's memfd has one name)."""
    pid = json.loads((keeper_dir / "keeper-0.json").read_text())["pid"]
    targets = []
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            targets.append(str(entry.stat().st_ino))
        except OSError:  # closed meanwhile
            continue
    return targets


_STAGING_CHILD = """
import os, signal, torch
from rtj_trainer.checkpoint.staging import HostStaging
staging = HostStaging()
buffer = staging.ensure(64 << 20, torch.device("cpu"))
buffer.fill_(5)
fd, _ = buffer.untyped_storage()._share_fd_cpu_()
print(os.fstat(fd).st_ino, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_the_keeper_holds_a_killed_workers_staging_buffer_until_the_next_one(
        keeper_dir: Path) -> None:
    """With a keeper, the staging buffer (shared memory) is held by the keeper too: a SIGKILLed
    worker's exit (and its writer's) then only unmaps it, and its pages are freed in the keeper
    once the next worker hands over its own buffer, off the restart's critical path."""
    names = []
    for _ in range(2):
        child = subprocess.run([sys.executable, "-c", _STAGING_CHILD], capture_output=True,
                               text=True, timeout=60)
        assert child.returncode == -signal.SIGKILL, child.stderr
        names.append(child.stdout.strip())
        status = json.loads((keeper_dir / "keeper-0.json").read_text())
        assert status["host_held_bytes"] == 64 << 20
        assert names[-1] in _keeper_fd_targets(keeper_dir)  # the dead worker's buffer, held
    assert names[0] != names[1]
    deadline = time.monotonic() + 10
    while names[0] in _keeper_fd_targets(keeper_dir):  # closed by the keeper's thread
        assert time.monotonic() < deadline, "the keeper still holds the first buffer"
        time.sleep(0.05)
