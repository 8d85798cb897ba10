"""`python -m rtj_trainer.warm.attach <trainer arguments>`: the worker command ft_launcher starts
when warm workers are on (rtj_trainer.launcher, `RTJ_WARM_WORKERS=1`). It hands this worker over to
a warm process of the launcher's pool (rtj_trainer.warm.worker: torch, torch.distributed, NVRx and
the trainer already imported) and stands in for it until it ends; with no warm process ready it
becomes `python -m rtj_trainer <trainer arguments>` at once (exec). A warm process still importing
is waited for (rtj_trainer.warm.wire says why that is never slower).

Standard library only (an import-linter contract keeps torch, NVRx and pydantic off its import
path): the whole point is that this process starts in tens of milliseconds.

What it keeps true for ft_launcher, which only sees this process:

- the warm worker gets this process's arguments, environment, working directory and its stdin,
  stdout and stderr (SCM_RIGHTS), so it logs where this worker would have;
- signals sent to this process are passed on (rtj_trainer.warm.wire: SIGTERM/SIGINT/SIGHUP to the
  warm worker's process group, SIGUSR1/SIGUSR2 to its pid only);
- this process ends as the warm worker did: its exit code, or the signal that killed it
  (`warmwire.ending`); a warm worker killed from outside (its NVRx rank monitor, which knows the
  warm worker's pid: that process connected to it) reads here as SIGKILL;
- this process killed (SIGKILL from torchelastic or a fault drill) closes the socket, and the
  warm worker SIGKILLs its own process group at once (rtj_trainer.warm.worker).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
from collections.abc import Sequence
from types import FrameType
from typing import Any

from . import wire as warmwire

ANSWER_TIMEOUT_SECONDS = 60.0
"""How long to wait for a warm worker's answer: milliseconds when it is idle, the rest of its
imports when it is still starting; past this (a stuck warm worker) the client tries the next one
and then the normal path."""


def run_normally(args: Sequence[str]) -> None:
    """Become `python -m rtj_trainer <args>` (the path without warm workers)."""
    os.execv(sys.executable, [sys.executable, "-m", warmwire.WORKER_MODULE, *args])


def _answer(sock: socket.socket, decoder: warmwire.Decoder) -> dict[str, Any] | None:
    """The next message, or None at the end of the stream."""
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return None
        messages = decoder.feed(chunk)
        if messages:
            if len(messages) > 1 or decoder.pending:
                raise warmwire.WireError("more than one answer to a request")
            return messages[0]


def _local_rank() -> int:
    value = os.environ.get("LOCAL_RANK", "0")
    return int(value) if value.isdigit() else 0


def claim(pool_dir: str, request: warmwire.Request,
          ) -> tuple[socket.socket, int, warmwire.Decoder] | None:
    """Hand the request to the first ready warm worker that takes it: (socket, its pid, the
    decoder holding what came after the answer); None if none did."""
    payload = request.encode()
    for path in warmwire.warm_sockets(pool_dir, _local_rank()):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(ANSWER_TIMEOUT_SECONDS)
            sock.connect(path)
            socket.send_fds(sock, [payload], [0, 1, 2])
            decoder = warmwire.Decoder()
            answer = _answer(sock, decoder)
        except (OSError, warmwire.WireError):
            sock.close()
            continue  # taken by another worker, or gone: the next one
        if answer is None or "refused" in answer:
            if answer is not None:
                print(f"[rtj-warm] warm worker refused this worker ({answer['refused']}): "
                      "starting it the normal way", file=sys.stderr, flush=True)
            sock.close()
            if answer is not None:
                return None
            continue
        pid = answer.get("attached")
        if not isinstance(pid, int) or pid <= 0:
            sock.close()
            continue
        sock.settimeout(None)
        return sock, pid, decoder
    return None


class Forwarder:
    """Passes the signals this process gets on to the warm worker, and remembers the last one
    whose default action ends a process (`warmwire.ending` needs it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.last: int | None = None

    def install(self) -> None:
        for sig in (*warmwire.FORWARDED_TO_GROUP, *warmwire.FORWARDED_TO_PROCESS):
            signal.signal(sig, self.handle)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.last = signum
        try:
            if signum in warmwire.FORWARDED_TO_GROUP:
                os.killpg(self.pid, signum)  # the warm worker leads its own process group
            else:
                os.kill(self.pid, signum)
        except ProcessLookupError:
            pass


def end_as(result: warmwire.Ending) -> None:
    """Exit with the warm worker's code, or die by its signal."""
    sys.stdout.flush()
    sys.stderr.flush()
    if result.signal is not None:
        if result.signal != signal.SIGKILL:  # SIGKILL's action cannot be set (nor blocked)
            signal.signal(result.signal, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [result.signal])
        os.kill(os.getpid(), result.signal)
        signal.pause()
    os._exit(result.code if result.code is not None else 1)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    pool_dir = os.environ.get(warmwire.POOL_DIR_ENV)
    request = warmwire.Request(args=args, env=dict(os.environ), cwd=os.getcwd(), pid=os.getpid())
    claimed = claim(pool_dir, request) if pool_dir else None
    if claimed is None:
        run_normally(args)
        return
    sock, pid, decoder = claimed
    forwarder = Forwarder(pid)
    forwarder.install()
    exit_message: dict[str, Any] | None = None
    while exit_message is None:
        try:
            chunk = sock.recv(65536)
        except OSError:
            chunk = b""
        if not chunk:
            break
        try:
            messages = decoder.feed(chunk)
        except warmwire.WireError:
            break
        exit_message = next((m for m in messages if "exit" in m), None)
    end_as(warmwire.ending(exit_message, forwarder.last))


if __name__ == "__main__":
    main()
