"""The worker's side of a device keeper (rtj_trainer.keeper): `lease` opens the buffer the
keeper of this local rank holds (`LOCAL_RANK`), asking it to allocate one first if needed."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

import torch

from . import DIR_ENV, MESSAGE_BYTES, REQUEST_TIMEOUT_SECONDS, decode_cuda_share, socket_path

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Lease:
    """A buffer a keeper holds, opened in this process: `tensor` (uint8, `nbytes` long) is its
    memory; `generation` names this allocation (a reallocated or restarted keeper's differs)."""

    tensor: torch.Tensor
    generation: str


_opened: dict[str, torch.Tensor] = {}
"""The buffers this process opened, by generation: each is opened once per process."""


def configured() -> bool:
    return bool(os.environ.get(DIR_ENV))


def lease(nbytes: int, device: torch.device, *, allocate: bool,
          headroom: int = 0) -> Lease | None:
    """The keeper's buffer of `nbytes` on `device`, opened here; with `allocate` the keeper
    allocates one of that size if it holds another (or none) and has room for it plus
    `headroom` bytes. None: no keeper, none of that size (`allocate` False), no room, or the
    keeper did not answer (logged; the caller holds its own buffer instead)."""
    directory = os.environ.get(DIR_ENV)
    if not directory:
        return None
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    request = {"op": "lease", "nbytes": nbytes, "device": str(device), "allocate": allocate,
               "headroom": headroom}
    try:
        reply, fds = _ask(socket_path(directory, local_rank), request)
    except OSError as exc:
        log.warning("no device keeper for local rank %d (%s): the worker holds its snapshot "
                    "buffer itself", local_rank, exc)
        return None
    try:
        if "error" in reply:
            log.warning("the device keeper of local rank %d refused a %.1f GiB buffer: %s",
                        local_rank, nbytes / 2**30, reply["error"])
            return None
        if reply.get("none"):
            return None
        generation = str(reply["generation"])
        if int(reply["nbytes"]) != nbytes:
            return None
        tensor = _opened.get(generation)
        if tensor is None:
            tensor = _open(reply, fds, device)
            _opened.clear()  # an older generation's memory is the keeper's to free
            _opened[generation] = tensor
        return Lease(tensor, generation)
    finally:
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)


def hold_host(buffer: torch.Tensor) -> bool:
    """Have this local rank's keeper hold `buffer` (the staging buffer: CPU, in shared memory)
    too, until the next worker hands over its own: then a SIGKILLed worker's and its writer's
    exits only unmap it, and its pages (GBs: ~0.7 s to free 11.3 GB) are freed in the keeper,
    off the restart's critical path. False: no keeper, or it did not take it (logged)."""
    directory = os.environ.get(DIR_ENV)
    if not directory or buffer.device.type != "cpu":
        return False
    local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    try:
        fd, size = buffer.untyped_storage()._share_fd_cpu_()  # type: ignore[attr-defined]
        reply, fds = _ask(socket_path(directory, local_rank), {"op": "hold", "nbytes": int(size)},
                          [int(fd)])
    except (OSError, RuntimeError, ValueError) as exc:
        log.warning("the device keeper of local rank %d does not hold the staging buffer: %s",
                    local_rank, exc)
        return False
    for extra in fds:
        os.close(extra)
    if "error" in reply:
        log.warning("the device keeper of local rank %d refused the staging buffer: %s",
                    local_rank, reply["error"])
        return False
    return True


def _ask(path: str, request: dict[str, Any],
         send: list[int] | None = None) -> tuple[dict[str, Any], list[int]]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as sock:
        sock.settimeout(REQUEST_TIMEOUT_SECONDS)
        sock.connect(path)
        socket.send_fds(sock, [json.dumps(request).encode()], send or [])
        data, fds, _flags, _addr = socket.recv_fds(sock, MESSAGE_BYTES, 1)
    if not data:
        raise ConnectionError("the keeper closed the connection without a reply")
    reply = json.loads(data)
    if not isinstance(reply, dict):
        raise ConnectionError(f"the keeper replied {reply!r}")
    return reply, list(fds)


def _open(reply: dict[str, Any], fds: list[int], device: torch.device) -> torch.Tensor:
    nbytes = int(reply["nbytes"])
    if device.type == "cpu":
        if not fds:
            raise ConnectionError("the keeper sent no memory with its reply")
        return torch.from_file(f"/proc/self/fd/{fds[0]}", shared=True, size=nbytes,
                               dtype=torch.uint8)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync = (
        decode_cuda_share(reply["cuda"]))
    tensor: torch.Tensor = rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
        torch.Tensor, (nbytes,), (1,), 0, torch.UntypedStorage, torch.uint8, index, handle,
        size, offset, False, ref_handle, ref_offset, event_handle, event_sync)
    return tensor
