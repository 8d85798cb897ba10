"""The launcher shim's pool of warm workers (`RTJ_WARM_WORKERS=1`, rtj_trainer.launcher).

Why: every worker ft_launcher starts (the first ones, and every restart after a fault) spent
seconds importing torch, torch._dynamo, torch.distributed and NVRx before its first line of
training code (5.6 s of a 15.8 s SIGKILL recovery on two H200s, docs/benchmarks.md). The pool
keeps `size` processes (rtj_trainer.warm.worker) that did those imports ahead of time, and the
worker command becomes a small attach client (rtj_trainer.warm.attach) that hands its worker over to
one of them; a client that finds none ready runs the normal path at once. Each warm worker is meant
for one local rank (one per rank, `--local-rank`): on a GPU it also creates its CUDA context on
that rank's device and does the libraries' first-use work (rtj_trainer.warm.device), and a client
tries the ones meant for its `LOCAL_RANK` first.

One thread (`WarmPool.run`) owns the processes: it starts `size` of them, and another for the same
local rank each time one is taken (a warm worker writes `T` on its status pipe when a client
connected), so the next restart finds warm processes again. A warm worker that dies before it was
ready counts as a failure; after `MAX_FAILED_STARTS` in a row the pool stops starting them (clients
then run the normal path). The warm workers are started from that thread, which lives as long as
the shim: their PR_SET_PDEATHSIG (set while idle) fires when the thread that started them ends.
They lead their own sessions, like torchelastic's workers: a signal to the launcher's process group
(a pod ending under the test harness) does not reach them; idle ones die with the launcher.
"""

from __future__ import annotations

import contextlib
import logging
import os
import selectors
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from ..warm import wire as warmwire

MAX_FAILED_STARTS = 3
log = logging.getLogger("rtj_trainer.launcher")


@dataclass(slots=True)
class _Warm:
    process: subprocess.Popen[bytes]
    status_fd: int
    local_rank: int
    ready: bool = False
    taken: bool = False


class WarmPool:
    """`size` warm workers of interpreter `python`, listening in a private directory."""

    def __init__(self, python: str, size: int, preload: Sequence[str] = ()) -> None:
        if size < 1:
            raise ValueError(f"warm pool size is {size}, not a positive number of processes")
        self.python = python
        self.size = size
        self.preload = tuple(preload)
        self.directory = tempfile.mkdtemp(prefix="rtj-warm-")  # mode 0700
        self.started = 0
        self.taken = 0
        self._failed_in_a_row = 0
        self._selector = selectors.DefaultSelector()
        self._warm: dict[int, _Warm] = {}
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self.run, name="rtj-warm-pool", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _spawn(self, local_rank: int) -> None:
        read_fd, write_fd = os.pipe()
        env = dict(os.environ)
        env[warmwire.POOL_DIR_ENV] = self.directory
        if self.preload:
            env[warmwire.PRELOAD_ENV] = ",".join(self.preload)
        try:
            process = subprocess.Popen(
                [self.python, "-m", "rtj_trainer.warm.worker", f"--status-fd={write_fd}",
                 f"--local-rank={local_rank}"],
                env=env, pass_fds=(write_fd,), stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        except OSError as exc:
            os.close(read_fd)
            os.close(write_fd)
            log.error("cannot start a warm worker: %s", exc)
            self._failed_in_a_row += 1
            return
        os.close(write_fd)
        self.started += 1
        self._warm[read_fd] = _Warm(process, read_fd, local_rank)
        self._selector.register(read_fd, selectors.EVENT_READ)

    def _wanted(self) -> list[int]:
        """The local ranks to start a warm worker for now: each of the `size` ranks has one idle
        or starting warm worker meant for it (rtj_trainer.warm.device warms its device)."""
        if self._failed_in_a_row >= MAX_FAILED_STARTS or self._stopping.is_set():
            return []
        covered = {warm.local_rank for warm in self._warm.values() if not warm.taken}
        return [rank for rank in range(self.size) if rank not in covered]

    def _on_status(self, fd: int) -> None:
        warm = self._warm[fd]
        try:
            data = os.read(fd, 64)
        except OSError:
            data = b""
        if b"R" in data:
            warm.ready = True
            self._failed_in_a_row = 0
        if b"T" in data:
            warm.taken = True
            self.taken += 1
        if not data:  # the warm worker closed its pipe: taken (and attached) or dead
            self._selector.unregister(fd)
            os.close(fd)
            del self._warm[fd]
            if not warm.taken:
                code = warm.process.wait()
                if not warm.ready:
                    self._failed_in_a_row += 1
                log.error("warm worker %d exited with %s before it was taken%s",
                          warm.process.pid, code,
                          "" if self._failed_in_a_row < MAX_FAILED_STARTS else
                          f"; {MAX_FAILED_STARTS} failed starts in a row: no more warm workers")
            else:
                _reap_later(warm.process)

    def run(self) -> None:
        while not self._stopping.is_set():
            for rank in self._wanted():
                self._spawn(rank)
            for key, _events in self._selector.select(timeout=0.5):
                self._on_status(int(key.fd))

    def close(self) -> None:
        """Stop starting warm workers, end the idle ones and remove the directory."""
        self._stopping.set()
        for warm in list(self._warm.values()):
            if not warm.taken:
                with contextlib.suppress(ProcessLookupError):
                    warm.process.kill()
        shutil.rmtree(self.directory, ignore_errors=True)


def _reap_later(process: subprocess.Popen[bytes]) -> None:
    """A taken warm worker runs as long as its client; collect its exit status when it ends (a
    zombie would look alive to `kill -0`)."""
    threading.Thread(target=process.wait, name=f"rtj-warm-reap-{process.pid}",
                     daemon=True).start()


def pool_size(launcher_args: list[str]) -> int:
    """One warm worker per local rank: ft_launcher's `--nproc-per-node` (1 when it is not a
    number, e.g. `gpu`)."""
    for index, arg in enumerate(launcher_args):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if arg == flag and index + 1 < len(launcher_args):
                value = launcher_args[index + 1]
            elif arg.startswith(flag + "="):
                value = arg.removeprefix(flag + "=")
            else:
                continue
            return int(value) if value.isdigit() and int(value) > 0 else 1
    return 1


def switched_on(env: dict[str, str] | os._Environ[str]) -> bool:
    """`RTJ_WARM_WORKERS`: `1` on, `0` or unset off; anything else is an error naming it."""
    value = env.get(warmwire.SWITCH_ENV, "0").strip()
    if value not in ("0", "1"):
        raise SystemExit(f"launcher: {warmwire.SWITCH_ENV}={value!r}: expected 1 or 0")
    return value == "1"
