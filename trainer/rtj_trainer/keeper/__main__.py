"""`python -m rtj_trainer.keeper --directory D --local-rank N`: one device keeper
(rtj_trainer.keeper), started by the launcher shim. It dies with the launcher
(PR_SET_PDEATHSIG), leads its own session (a signal to the launcher's or a worker's process group
does not reach it), creates its CUDA context on device N at start when there is a GPU (so that a
worker's first snapshot does not wait for it), then listens on `socket_path(D, N)`.

One request at a time, one buffer at a time: a lease of another size frees the buffer held
(its memory returns to the device once no worker maps it any more) and allocates the new one
when the device has room for it plus the request's headroom.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import sys
import threading
from typing import Any

from ..files import write_json_atomic
from ..lifeline import die_with_parent
from . import encode_cuda_share, socket_path, status_path


class Keeper:
    def __init__(self, directory: str, local_rank: int) -> None:
        import torch

        self.torch = torch
        self.directory = directory
        self.local_rank = local_rank
        self.cuda = torch.cuda.is_available() and local_rank < torch.cuda.device_count()
        if self.cuda:
            torch.cuda.set_device(local_rank)
            torch.empty(1, device=f"cuda:{local_rank}")  # the context, now
        self.buffer: Any = None
        self.memfd: int | None = None
        self.nbytes = 0
        self.device = ""
        self.generation = ""
        self.allocations = 0
        self.held_host: int | None = None
        """The worker's staging buffer (its shared-memory file), held (`hold`) so that a killed
        worker's and its writer's exits do not free its pages on a restart's critical path."""
        self.held_host_bytes = 0
        self._write_status()

    def _write_status(self) -> None:
        from pathlib import Path

        write_json_atomic(Path(status_path(self.directory, self.local_rank)), {
            "pid": os.getpid(), "cuda": self.cuda, "device": self.device,
            "buffer_bytes": self.nbytes,
            "cuda_buffer_bytes": self.nbytes if self.device.startswith("cuda") else 0,
            "generation": self.generation, "allocations": self.allocations,
            "host_held_bytes": self.held_host_bytes})

    def _release(self) -> None:
        self.buffer = None
        if self.memfd is not None:
            os.close(self.memfd)
            self.memfd = None
        if self.device.startswith("cuda"):
            self.torch.cuda.empty_cache()
        self.nbytes, self.device, self.generation = 0, "", ""

    def _allocate(self, nbytes: int, device: str, headroom: int) -> str | None:
        """Allocate the buffer; the reason it could not be, or None."""
        torch = self.torch
        self._release()
        if device == "cpu":
            fd = os.memfd_create("rtj-keeper-buffer")
            try:
                os.ftruncate(fd, nbytes)
            except OSError as exc:
                os.close(fd)
                return f"memfd of {nbytes} bytes: {exc}"
            self.memfd = fd
        else:
            target = torch.device(device)
            if not self.cuda or (target.index or 0) != self.local_rank:
                return f"this keeper holds memory on cuda:{self.local_rank}, not {device}"
            free, _ = torch.cuda.mem_get_info(target)
            if free < nbytes + headroom:
                return (f"{free / 2**30:.1f} GiB free on {device}, "
                        f"{(nbytes + headroom) / 2**30:.1f} GiB needed")
            try:
                self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=target)
            except torch.OutOfMemoryError as exc:
                return str(exc).splitlines()[0]
        self.allocations += 1
        self.nbytes, self.device = nbytes, device
        self.generation = f"{os.getpid()}.{self.allocations}"
        self._write_status()
        return None

    def hold(self, fds: list[int], nbytes: int) -> dict[str, Any]:
        """Hold the worker's staging buffer (`fds[0]`) instead of the one held before, whose
        pages (GBs) are freed by a thread here, off every restart's critical path."""
        if not fds:
            return {"error": "a hold request came without its buffer"}
        previous, self.held_host, self.held_host_bytes = self.held_host, fds[0], nbytes
        for extra in fds[1:]:
            os.close(extra)
        if previous is not None:
            threading.Thread(target=os.close, args=(previous,), name="rtj-keeper-free",
                             daemon=True).start()
        self._write_status()
        return {"held": nbytes}

    def answer(self, request: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], list[int]]:
        if request.get("op") == "hold":
            return self.hold(fds, int(request.get("nbytes", 0))), []
        for fd in fds:
            os.close(fd)
        if request.get("op") != "lease":
            return {"error": f"unknown request {request.get('op')!r}"}, []
        nbytes, device = int(request["nbytes"]), str(request["device"])
        if device.startswith("cuda") and ":" not in device:
            device = f"cuda:{self.local_rank}"
        if (self.nbytes, self.device) != (nbytes, device):
            if not request.get("allocate"):
                return {"none": True}, []
            problem = self._allocate(nbytes, device, int(request.get("headroom", 0)))
            if problem is not None:
                self._write_status()
                return {"error": problem}, []
        reply: dict[str, Any] = {"generation": self.generation, "nbytes": self.nbytes}
        if self.memfd is not None:
            return reply, [self.memfd]
        reply["cuda"] = encode_cuda_share(self.buffer.untyped_storage()._share_cuda_())
        return reply, []

    def serve(self, listener: socket.socket) -> None:
        while True:
            conn, _ = listener.accept()
            with conn:
                try:
                    conn.settimeout(30.0)
                    data, received, _flags, _addr = socket.recv_fds(conn, 1 << 16, 4)
                    request = json.loads(data or b"{}")
                    reply, fds = self.answer(request if isinstance(request, dict) else {},
                                             list(received))
                except Exception as exc:  # one bad request never ends the keeper
                    reply, fds = {"error": repr(exc)}, []
                with contextlib.suppress(OSError):
                    socket.send_fds(conn, [json.dumps(reply).encode()], fds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rtj_trainer.keeper")
    parser.add_argument("--directory", required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--parent", type=int, default=0,
                        help="exit at once if this is no longer the parent's pid")
    args = parser.parse_args(argv)
    die_with_parent(b"rtj-keeper")
    if args.parent and os.getppid() != args.parent:
        return 0
    keeper = Keeper(args.directory, args.local_rank)
    path = socket_path(args.directory, args.local_rank)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(8)
    os.replace(path + ".tmp", path)  # clients find the socket only once it listens
    print(f"[rtj-keeper] local rank {args.local_rank}: pid {os.getpid()}, "
          f"{'cuda' if keeper.cuda else 'cpu'}", file=sys.stderr, flush=True)
    keeper.serve(listener)
    return 0


if __name__ == "__main__":
    sys.exit(main())
