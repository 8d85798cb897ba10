"""The staging buffer's shared memory (rtj_trainer.checkpoint.hostmem): every page allocated
before it is handed out, the same memory reachable through the file descriptor torch shares it
by (what the writer process and the device keeper receive), across a process boundary, and the
fallback where the kernel has no MADV_POPULATE_WRITE. How long the step loop's thread waits
while it is made is a benchmark (bench/trainer_gpu.py --allocation-gb), not a test here.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from rtj_trainer.checkpoint import hostmem
from rtj_trainer.checkpoint.staging import HostStaging

MIB = 1 << 20


def _rss_shmem_kib() -> int:
    with open(f"/proc/{os.getpid()}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("RssShmem:"):
                return int(line.split()[1])
    raise AssertionError("no RssShmem in /proc/self/status")


@pytest.mark.parametrize("threads", [1, 3])
def test_buffer_is_shared_zeroed_and_every_page_resident(threads: int) -> None:
    nbytes = 64 * MIB + 12345  # slices of unequal length, a last partial page
    before = _rss_shmem_kib()
    buffer = hostmem.shared_buffer(nbytes, threads=threads)
    resident = _rss_shmem_kib() - before
    assert buffer.dtype == torch.uint8 and buffer.numel() == nbytes
    assert buffer.is_shared()  # type: ignore[no-untyped-call]
    assert resident * 1024 >= nbytes - mmap.PAGESIZE, (resident, nbytes)
    assert int(buffer.count_nonzero()) == 0


def test_memory_reachable_through_the_shared_descriptor_from_another_process() -> None:
    nbytes = 8 * MIB
    buffer = hostmem.shared_buffer(nbytes)
    buffer[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    fd, size = buffer.untyped_storage()._share_fd_cpu_()  # type: ignore[attr-defined]
    assert size == nbytes
    child = textwrap.dedent("""
        import mmap, sys
        fd = int(sys.argv[1])
        view = mmap.mmap(fd, 0)
        assert list(view[:4]) == [1, 2, 3, 4], list(view[:4])
        view[-1] = 9
    """)
    subprocess.run([sys.executable, "-c", child, str(fd)], pass_fds=[fd], check=True,
                   timeout=60)
    assert int(buffer[-1]) == 9


def test_without_populate_the_pages_are_allocated_by_fallocate(
        monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = mmap.mmap(-1, 4 * MIB)  # page-aligned
    address = ctypes.addressof(ctypes.c_char.from_buffer(scratch))
    assert hostmem._populate(address, 4 * MIB, 2) is True
    # An advice the kernel does not know answers EINVAL, as MADV_POPULATE_WRITE does before 5.14.
    monkeypatch.setattr(hostmem, "MADV_POPULATE_WRITE", 0x7FFF)
    assert hostmem._populate(address, 4 * MIB, 2) is False
    nbytes = 16 * MIB
    buffer = hostmem.shared_buffer(nbytes, threads=2)
    fd, _ = buffer.untyped_storage()._share_fd_cpu_()  # type: ignore[attr-defined]
    assert os.fstat(fd).st_blocks * 512 >= nbytes  # allocated in the file, not only sized
    buffer.fill_(5)
    assert int(buffer.sum()) == 5 * nbytes


def test_empty_buffer() -> None:
    buffer = hostmem.shared_buffer(0)
    assert buffer.numel() == 0


def test_staging_buffer_comes_from_shared_memory_and_is_reused() -> None:
    staging = HostStaging()
    first = staging.ensure(3 * MIB, torch.device("cpu"))
    assert first.is_shared() and first.numel() == 3 * MIB  # type: ignore[no-untyped-call]
    assert set(staging.seconds) == {"share", "register", "hold"}
    assert staging.ensure(3 * MIB, torch.device("cpu")).data_ptr() == first.data_ptr()
    assert staging.ensure(MIB, torch.device("cpu")).numel() == MIB


def test_a_torch_without_the_fd_map_gets_torchs_own_shared_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert hostmem._maps_fds()  # this torch has it: the memfd route is the one the trainer takes
    monkeypatch.setattr(hostmem, "_maps_fds", lambda: False)  # (a C type's method: not deletable)
    buffer = hostmem.shared_buffer(2 * MIB)
    assert buffer.is_shared() and buffer.numel() == 2 * MIB  # type: ignore[no-untyped-call]
    fd, size = buffer.untyped_storage()._share_fd_cpu_()  # type: ignore[attr-defined]
    assert size == 2 * MIB and os.fstat(fd).st_size >= 2 * MIB
