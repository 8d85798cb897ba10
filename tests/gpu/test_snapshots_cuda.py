"""Node-local snapshots through a copy in device memory (rtj_trainer.checkpoint.snapshots) on a
GPU: the snapshot holds the state of its step although the training stream changes the state in
place right after `take` returned, while the thread still copies to the host on its side stream.

`make test-gpu` on a machine with CUDA; the CPU path is in
tests/unit/test_trainer_checkpoint_local.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("bounce_mib", [64, 7])  # 7: chunks that split tensors unevenly
def test_a_snapshot_is_of_its_step_while_the_next_steps_change_the_state(
        tmp_path: Path, bounce_mib: int) -> None:
    from rtj_trainer import checkpoint as ck
    from rtj_trainer.checkpoint import local, snapshots

    assert torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    # about 1.2 GB: the thread's host copy takes far longer than the updates queued after it
    params = [torch.randn(64 << 20, device=device) for _ in range(4)]
    moments = [torch.zeros(8 << 20, device=device, dtype=torch.bfloat16) for _ in range(4)]
    expected = [p.cpu() for p in params] + [m.cpu() for m in moments]
    state = {"params": params, "moments": moments, "step": 7}
    taker = snapshots.SnapshotTaker(tmp_path, device=device, rank=0,
                                    bounce_bytes=bounce_mib << 20)
    stall = taker.take(7, "a0-l0-i0-1", state)
    assert stall is not None and taker.usable
    for _ in range(20):  # "the next steps": in-place updates on the training stream
        for p in params:
            p.mul_(1.5).add_(1.0)
        for m in moments:
            m.add_(2.0)
    taker.wait(120)
    assert taker.written == 1 and taker.failed == 0
    copies = local.local_copies(tmp_path)
    assert [c.step for c in copies] == [7]
    loaded = ck.read_shard(copies[0].path)
    assert loaded["step"] == 7
    for got, want in zip(loaded["params"] + loaded["moments"], expected, strict=True):
        assert got.dtype == want.dtype and torch.equal(got, want)
    taker.close()


def test_without_room_in_device_memory_no_buffer_is_taken(tmp_path: Path) -> None:
    from rtj_trainer.checkpoint import local, snapshots

    device = torch.device("cuda", torch.cuda.current_device())
    free, _ = torch.cuda.mem_get_info(device)
    spare = tmp_path / local.SPARE_NAME  # left by a snapshot given up
    spare.write_bytes(b"x")
    taker = snapshots.SnapshotTaker(tmp_path, device=device, rank=0, bounce_bytes=64 << 20)
    assert not taker.prepare(free)  # the buffer itself fits, its headroom does not
    assert taker.usable is False
    assert not spare.exists()  # nothing would write over it: deleted (on a thread)
    assert taker.take(1, "a0", {"w": torch.zeros(1, device=device)}) is None


def test_a_shard_read_onto_the_device_holds_its_large_tensors_there(tmp_path: Path) -> None:
    from rtj_trainer import checkpoint as ck
    from rtj_trainer.checkpoint import format as shard_format
    from rtj_trainer.checkpoint import local, snapshots

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(1)
    # 0.6 GB in uneven tensors; a generator's state and a 4-byte step stay small
    state = {"w": [torch.randn(n, device=device) for n in (37 << 20, 5 << 20, 99_991)],
             "m": torch.randn(3 << 20, device=device).to(torch.bfloat16),
             "step": torch.tensor(12.0), "rng": torch.get_rng_state(), "n": 12}
    taker = snapshots.SnapshotTaker(tmp_path, device=device, rank=0, bounce_bytes=7 << 20)
    assert taker.take(12, "a0-l0-i0-1", state) is not None
    taker.wait(120)
    path = local.local_copies(tmp_path)[0].path
    on_map = ck.read_shard(path)
    loaded = ck.read_shard(path, device=device)
    big = [*loaded["w"][:2], loaded["m"]]
    assert all(t.device == device for t in big)
    assert loaded["w"][2].device.type == "cpu"  # 400 KB: under DEVICE_VIEW_BYTES
    assert loaded["step"].device.type == "cpu" and loaded["rng"].device.type == "cpu"
    assert loaded["n"] == 12
    for got, want in zip([*loaded["w"], loaded["m"]], [*on_map["w"], on_map["m"]], strict=True):
        assert got.dtype == want.dtype and torch.equal(got.cpu(), want)
    for got, want in zip(state["w"], loaded["w"], strict=True):
        assert torch.equal(got.cpu(), want.cpu())
    # A script's own entries (rtj_trainer.lib) come back on the host, equal to the map's.
    from rtj_trainer.lib.run import _on_host
    host = _on_host(loaded)
    assert all(t.device.type == "cpu" for t in [*host["w"], host["m"]])
    for got, want in zip([*host["w"], host["m"]], [*on_map["w"], on_map["m"]], strict=True):
        assert torch.equal(got, want)
    free, _ = torch.cuda.mem_get_info(device)  # no room for the buffer: the map, as before
    assert not shard_format.upload_room(device, free)
    taker.close()


def test_a_save_staged_through_the_device_copy_is_of_its_step(tmp_path: Path) -> None:
    """Issue #32: on CUDA a save is staged through the snapshots' device buffer by default
    (`checkpoint.save_device_copy`): `save` returns after the copy into it on the training
    stream, a thread copies it to the page-locked staging buffer on a side stream, and the write
    follows. The committed shard holds the state of its step although the training stream
    changed the state in place right after `save` returned."""
    import torch.distributed as dist
    from rtj_trainer import checkpoint as ck
    from rtj_trainer.config import CheckpointConfig

    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(2)
    params = [torch.randn(64 << 20, device=device) for _ in range(4)]  # ~1 GB
    expected = [p.cpu() for p in params]
    store = tmp_path / "store"
    cfg = CheckpointConfig(dir=str(store), interval_steps=10, mode="async",
                           local_dir=str(tmp_path / "shm"), local_interval_steps=5)
    assert cfg.save_device_copy is None  # the default: on for CUDA
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    checkpointer = ck.Checkpointer(cfg, root=store, rank=0, world_size=1, device=device,
                                   identity="a9")
    try:
        state = {"params": params, "step": 10}
        checkpointer.prepare(state)
        assert checkpointer.defers_saves()
        checkpointer.save(10, state)
        assert checkpointer.stats.saves_through_device_copy == 1
        for _ in range(20):  # the next steps, on the training stream
            for p in params:
                p.mul_(1.5).add_(1.0)
        checkpointer.wait_until_committed(120)
        assert checkpointer.stats.committed_step == 10
        shard = next(store.glob("step-000000010.*/*.bin"))
        loaded = ck.read_shard(shard)
        assert loaded["step"] == 10
        for got, want in zip(loaded["params"], expected, strict=True):
            assert torch.equal(got, want)
    finally:
        checkpointer.close()
        dist.destroy_process_group()


def test_a_mixed_state_is_copied_into_the_device_buffer_without_waiting_for_the_stream() -> None:
    """Parameters on the device with AdamW's `step` counters and the RNG state on the host:
    `FlatState.copy_into` copies all of them, and returns while a long kernel queued before it
    still runs (no blocking host-to-device copy: each one waited for the stream)."""
    from rtj_trainer.checkpoint.staging import FlatState, tensor_views

    device = torch.device("cuda", torch.cuda.current_device())
    params = [torch.randn(1 << 20, device=device) for _ in range(50)]
    steps = [torch.tensor(float(i)) for i in range(50)]  # host scalars, as AdamW's foreach
    state = {"params": params, "step": steps, "rng": torch.get_rng_state(),
             "half": torch.ones(1000, device=device, dtype=torch.bfloat16)}
    flat = FlatState.of(state)
    buffer = torch.zeros(flat.total, dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9))  # ~1 s of one busy kernel on the stream
    started = time.perf_counter()
    flat.copy_into(buffer)
    returned = time.perf_counter() - started
    for step in steps:  # the optimizer's next step changes the host counters in place
        step.add_(100.0)
    torch.cuda.synchronize()
    assert returned < 0.3, f"copy_into waited {returned:.3f} s for the stream"
    views = tensor_views(buffer, flat.layout)
    for view, tensor in zip(views, flat.tensors, strict=True):
        if tensor.device.type == "cpu":
            expected = tensor - 100.0 if tensor.dtype == torch.float32 else tensor
            assert torch.equal(view.cpu(), expected)
        else:
            assert torch.equal(view, tensor)
