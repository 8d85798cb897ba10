"""A large host buffer in shared memory, made without stopping the step loop.

The staging buffer (rtj_trainer.checkpoint.staging) is GBs (11.3 GB for the `1b` shape's rank)
and is made once per process, in a thread, while the first steps run (`Checkpointer.prepare`).
torch's own routes hold the GIL for the slow part: `torch.empty(n).share_memory_()` and
`UntypedStorage._new_shared(n)` create the shared-memory file and `posix_fallocate` it (every
page allocated and zeroed) inside one C++ call that never releases the GIL. Measured on a
2-core CPU host for 4 GiB: the step loop's thread was stopped for 0.47-0.62 s; scaled to 11.3 GB
that is 1.3-1.7 s lost inside the second step of every new process, on top of that step.

Here each slow part runs where the GIL is free: `os.memfd_create` + `os.ftruncate` (instant),
then the pages are allocated and mapped by `madvise(MADV_POPULATE_WRITE)` over slices of the
map from a few threads at once (ctypes releases the GIL for the call), and only the map itself
(`UntypedStorage._new_shared_fd_cpu`, an mmap without populating) runs under the GIL. The
result is a tensor torch shares like its own shared memory (`is_shared()`, `_share_fd_cpu_()`
gives its file descriptor: the writer process and the device keeper receive it that way).

Where `MADV_POPULATE_WRITE` is not there (Linux < 5.14) the pages are allocated by
`os.posix_fallocate` (GIL released, one thread) and mapped by the first thing that touches
them (on CUDA, `cudaHostRegister`, which releases the GIL too). Where memfd is not there at all
(not Linux), or a torch without `_new_shared_fd_cpu`, torch's own route.

A buffer that cannot get its memory fails here with MemoryError naming the size, not with a
SIGBUS at the first copy into it.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable

import torch

MADV_POPULATE_WRITE = 23
"""linux/mman.h (5.14+): fault in (allocating) every page of the range, writable."""

POPULATE_THREADS = 8
"""At most this many threads populate one buffer (fewer on a host with fewer CPUs)."""

_SLICE_ALIGN = 2 << 20
"""Slice boundaries on 2 MiB, so a slice never splits a huge page."""


def libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's `madvise(address, length, advice)` (ctypes: the GIL is released for the call; the
    errno is kept for `ctypes.get_errno`), or None without libc."""
    try:
        function = ctypes.CDLL("libc.so.6", use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return lambda address, length, advice: int(function(address, length, advice))


def populate_threads() -> int:
    return max(1, min(POPULATE_THREADS, (os.cpu_count() or 2) // 2))


def _populate(address: int, nbytes: int, threads: int) -> bool:
    """Allocate and map every page of [address, address + nbytes) from `threads` threads.
    False when the kernel does not know MADV_POPULATE_WRITE (nothing was done); MemoryError
    when the memory is not there."""
    madvise = libc_madvise()
    if madvise is None:
        return False
    step = max(_SLICE_ALIGN, -(-nbytes // threads // _SLICE_ALIGN) * _SLICE_ALIGN)
    slices = [(start, min(step, nbytes - start)) for start in range(0, nbytes, step)]
    failures: list[int] = []

    def one(start: int, length: int) -> None:
        if madvise(address + start, length, MADV_POPULATE_WRITE) != 0:
            failures.append(ctypes.get_errno())

    workers = [threading.Thread(target=one, args=piece, name="rtj-populate", daemon=True)
               for piece in slices[1:]]
    for worker in workers:
        worker.start()
    one(*slices[0])
    for worker in workers:
        worker.join()
    if not failures:
        return True
    if all(code == errno.EINVAL for code in failures) and len(failures) == len(slices):
        return False
    raise MemoryError(f"the {nbytes}-byte shared host buffer could not get its memory: "
                      f"{os.strerror(next(c for c in failures if c != errno.EINVAL))}")


def _maps_fds() -> bool:
    """Whether this torch has the private `UntypedStorage._new_shared_fd_cpu` (what its own
    multiprocessing uses to map a received descriptor): without it, torch's route (and its
    GIL-held allocation) rather than none."""
    return callable(getattr(torch.UntypedStorage, "_new_shared_fd_cpu", None))


def shared_buffer(nbytes: int, threads: int | None = None) -> torch.Tensor:
    """A flat uint8 tensor of `nbytes` in shared memory, every page allocated (see the module
    docstring for why this way and what holds the GIL)."""
    if not nbytes or not hasattr(os, "memfd_create") or not _maps_fds():
        shared: torch.Tensor = torch.empty(nbytes, dtype=torch.uint8).share_memory_()  # type: ignore[no-untyped-call]
        return shared
    fd = os.memfd_create("rtj-staging", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        storage = torch.UntypedStorage._new_shared_fd_cpu(fd, nbytes)  # type: ignore[attr-defined]
    finally:
        os.close(fd)  # the storage keeps its own duplicate
    buffer = torch.empty(0, dtype=torch.uint8).set_(storage)
    if not _populate(buffer.data_ptr(), nbytes, threads or populate_threads()):
        descriptor, _ = storage._share_fd_cpu_()
        try:
            os.posix_fallocate(descriptor, 0, nbytes)
        except OSError as exc:
            raise MemoryError(f"the {nbytes}-byte shared host buffer could not get its "
                              f"memory: {exc.strerror}") from exc
    return buffer
