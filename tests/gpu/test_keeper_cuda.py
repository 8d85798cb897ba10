"""Device keepers on a GPU (rtj_trainer.keeper): a worker's snapshot lands in device memory that
the keeper holds through CUDA IPC, a SIGKILLed worker leaves it there, and the next process opens
the same memory and finds the snapshot's bytes; a resume rebuilds the state from it.

`make test-gpu` on a machine with CUDA; the CPU path (a memfd) is in
tests/unit/test_trainer_keeper.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture
def keeper_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    directory = tmp_path / "keeper"
    directory.mkdir()
    device = torch.cuda.current_device()
    process = subprocess.Popen([sys.executable, "-m", "rtj_trainer.keeper",
                                f"--directory={directory}", f"--local-rank={device}"])
    deadline = time.monotonic() + 120
    while not (directory / f"keeper-{device}.sock").exists():
        assert process.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    monkeypatch.setenv("RTJ_DEVICE_KEEPER_DIR", str(directory))
    monkeypatch.setenv("LOCAL_RANK", str(device))
    yield directory
    process.kill()
    process.wait()


def test_a_killed_borrower_leaves_its_bytes_in_the_keepers_device_memory(
        keeper_dir: Path) -> None:
    from rtj_trainer import keeper
    from rtj_trainer.keeper import client

    device = torch.cuda.current_device()
    nbytes = 256 << 20
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, signal, torch
        from rtj_trainer.keeper import client
        lease = client.lease({nbytes}, torch.device("cuda", {device}), allocate=True)
        torch.manual_seed(3)
        lease.tensor.copy_(torch.randint(0, 256, ({nbytes},), dtype=torch.uint8, device="cuda"))
        torch.cuda.synchronize()
        print(lease.generation, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """)], capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr[-3000:]
    generation = child.stdout.strip()
    lease = client.lease(nbytes, torch.device("cuda", device), allocate=False)
    assert lease is not None and lease.generation == generation
    assert lease.tensor.device.type == "cuda"
    torch.manual_seed(3)
    expected = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    assert torch.equal(lease.tensor, expected)
    # what ft_launcher's reclaim wait allows for: the buffer and a context
    assert keeper.held_mb(str(keeper_dir)) == 256 + keeper.CONTEXT_ALLOWANCE_MB
    assert client.lease(nbytes * 2, torch.device("cuda", device), allocate=False) is None


def test_a_snapshot_into_the_keepers_buffer_is_recorded_and_resumed_from(
        keeper_dir: Path, tmp_path: Path) -> None:
    from rtj_trainer.checkpoint import devicecopy, snapshots
    from rtj_trainer.checkpoint.staging import tensor_views, unflatten_state

    device = torch.device("cuda", torch.cuda.current_device())
    params = [torch.randn(16 << 20, device=device) for _ in range(3)]
    rng = torch.get_rng_state()  # a host tensor in the state, as the trainer's
    expected = [p.cpu() for p in params]
    folder = tmp_path / "local"
    taker = snapshots.SnapshotTaker(folder, device=device, rank=0, bounce_bytes=64 << 20)
    assert taker.take(9, "a0-l0-i0-1", {"params": params, "rng": rng, "step": 9}) is not None
    assert taker.kept
    for p in params:  # the next steps change the state in place
        p.mul_(3.0)
    taker.wait(60)
    record = devicecopy.read(folder)
    assert record is not None and record.step == 9 and taker.written == 1
    from rtj_trainer.keeper import client

    lease = client.lease(record.nbytes, device, allocate=False)
    assert lease is not None and lease.generation == record.generation
    state = unflatten_state(record.skeleton, tensor_views(lease.tensor, record.layout))
    assert state["step"] == 9 and torch.equal(state["rng"].cpu(), rng)
    for got, want in zip(state["params"], expected, strict=True):
        assert torch.equal(got.cpu(), want)
    # the next snapshot removes the record before its copy is launched
    taker.take(10, "a0-l0-i0-1", {"params": params, "rng": rng, "step": 10})
    taker.wait(60)
    assert devicecopy.read(folder).step == 10  # type: ignore[union-attr]
    taker.close()
    assert os.path.exists(devicecopy.record_path(folder))
