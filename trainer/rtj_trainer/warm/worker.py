"""`python -m rtj_trainer.warm.worker --status-fd N`: a warm worker of the launcher shim's pool
(rtj_trainer.launcher.warmpool). It imports everything a trainer worker imports (torch,
torch._dynamo, torch.distributed with FSDP and DCP, NVRx, the trainer's modules) without touching
CUDA, listens on `warm-<pid>.sock` in the pool directory (from before its imports: a client that
comes early waits for them), and waits for one attach client (rtj_trainer.warm.attach). Then it
becomes that worker: it takes the client's stdin/stdout/stderr, environment, working directory and
arguments,
and runs `python -m rtj_trainer` in this process (`runpy`, exactly as the interpreter would), so
the worker's own time starts after the imports.

**What a warm worker cannot take from the client.** Variables read when the interpreter starts
or torch is imported (warmwire.STARTUP_ENV_PREFIXES: PYTHON*, LD_*, TORCHDYNAMO_*, TORCH_LOGS,
...) were taken from the launcher's environment; a worker whose values differ is refused and
starts the normal way. The thread count (OMP_NUM_THREADS, which torchelastic sets for its
workers) is applied at attach (`torch.set_num_threads`); torch's inter-op pool keeps the size it
gets at first use, after attach. The pid is the warm worker's, not the client's: NVRx's rank
monitor learns it from this process and kills this process on a missed heartbeat; the client
then ends as if SIGKILLed (rtj_trainer.warm.attach).

**Failure coupling.** Idle, a warm worker dies with the launcher (PR_SET_PDEATHSIG). Attached, it
lives exactly as long as its client: the client's end of the socket closing (it was SIGKILLed)
makes it SIGKILL its own process group (itself and its checkpoint writer, as torchelastic's
SIGKILL of a worker's group does). Its own end is reported to the client as `{"exit": code}`,
from the last `atexit` handler or from `os._exit` (wrapped here, in this process only), so the
client exits with the worker's code.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import os
import runpy
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Sequence
from typing import NoReturn

from .. import timeline
from ..lifeline import parent_death_signal
from . import wire as warmwire

REQUEST_TIMEOUT_SECONDS = 5.0
PRELOADED = (
    "torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp",
    "torch.distributed.checkpoint", "rtj_trainer.nvrx.preload",
    "rtj_trainer.__main__", "rtj_trainer.metrics", "rtj_trainer.resiliency", "rtj_trainer.train",
)
"""What a worker imports before its first line of training (rtj_trainer.__main__ and the lazy
imports of rtj_trainer.resiliency and rtj_trainer.checkpoint; rtj_trainer.nvrx.preload names the
NVRx modules, which only rtj_trainer.nvrx imports)."""


def preimport() -> None:
    import importlib

    for name in PRELOADED:
        importlib.import_module(name)
    preloaded = []
    for name in filter(None, os.environ.get(warmwire.PRELOAD_ENV, "").split(",")):
        try:  # the model's modules (warmwire.model_preloads): a worker without them still runs
            importlib.import_module(name)
            preloaded.append(name)
        except Exception as exc:  # any import error: the worker reports it itself
            print(f"[rtj-warm] warm worker {os.getpid()}: cannot preload {name}: {exc!r}",
                  file=sys.stderr)
    if preloaded:
        print(f"[rtj-warm] warm worker {os.getpid()} preloaded {', '.join(preloaded)}",
              file=sys.stderr, flush=True)


def listen(pool_dir: str, local_rank: int | None = None) -> tuple[socket.socket, str]:
    """Listen under a temporary name, then publish the socket (an atomic rename), so a client
    never finds a socket nobody listens on. This happens before the imports: a client that
    connects meanwhile waits for them to finish (they started before it did)."""
    final = warmwire.warm_socket_path(pool_dir, os.getpid(), local_rank)
    temporary = os.path.join(pool_dir, f".starting-{os.getpid()}{warmwire.SOCKET_SUFFIX}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(temporary)
    listener.listen(8)
    os.rename(temporary, final)
    return listener, final


def read_request(conn: socket.socket) -> tuple[warmwire.Request, list[int]]:
    """The client's request and its stdin/stdout/stderr (three descriptors)."""
    conn.settimeout(REQUEST_TIMEOUT_SECONDS)
    decoder = warmwire.Decoder()
    fds: list[int] = []
    while True:
        data, received, _flags, _address = socket.recv_fds(conn, 1 << 20, 3)
        fds.extend(received)
        if not data:
            raise warmwire.WireError("the client left before its request")
        messages = decoder.feed(data)
        if messages:
            if len(fds) != 3:
                raise warmwire.WireError(f"expected stdin, stdout and stderr, got {len(fds)} fds")
            conn.settimeout(None)
            return warmwire.Request.from_message(messages[0]), fds


class Attachment:
    """The link to the client once attached: the exit report and the watch for its end."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.pid = os.getpid()
        self.code: int | None = None
        self._lock = threading.Lock()
        self._reported = False
        self._exiting = False

    def report(self, code: int) -> None:
        """Tell the client how this worker ends (once; never from a forked child)."""
        if os.getpid() != self.pid:
            return
        with self._lock:
            self._exiting = True
            if self._reported:
                return
            self._reported = True
        with contextlib.suppress(OSError):
            self.conn.sendall(warmwire.encode({"exit": code}))

    def report_at_exit(self) -> None:
        if self.code is not None:
            self.report(self.code)

    def watch(self) -> None:
        """Runs in a daemon thread: the client gone means this worker goes, at once."""
        while True:
            try:
                chunk = self.conn.recv(4096)
            except OSError:
                chunk = b""
            if not chunk:
                break
        with self._lock:
            if self._exiting:
                return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        os.kill(self.pid, signal.SIGKILL)


def apply(request: warmwire.Request, fds: Sequence[int]) -> None:
    """Become the client's worker: its stdio, environment, directory and thread count."""
    sys.stdout.flush()
    sys.stderr.flush()
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdout.reconfigure(line_buffering=os.isatty(1))  # type: ignore[union-attr]
    os.environ.clear()
    os.environ.update(request.env)
    os.chdir(request.cwd)
    threads = request.env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        import torch

        torch.set_num_threads(int(threads))


def _wrap_os_exit(attachment: Attachment) -> None:
    real_exit = os._exit

    def _exit(status: int) -> NoReturn:
        attachment.report(status)
        real_exit(status)

    os._exit = _exit


def run_worker(args: Sequence[str]) -> int:
    """`python -m rtj_trainer <args>` in this process; its exit code."""
    sys.argv = ["-m", *args]
    try:
        runpy.run_module(warmwire.WORKER_MODULE, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None:
            return 0
        if isinstance(exc.code, int):
            return exc.code
        print(exc.code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        raise
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


def warm_device(local_rank: int | None) -> str:
    """The device warm-up (rtj_trainer.warm.device) for a warm worker meant for a local rank,
    where it is on; what it did, for the attach line ("" when nothing)."""
    from . import device

    if local_rank is None or not device.switched_on(os.environ):
        return ""
    try:
        report = device.warm_up(local_rank)
    except Exception as exc:  # a device that fails here fails the worker too: it says so itself
        return f"; device warm-up failed: {exc!r}"
    if "skipped" in report:
        return ""
    return "; device warmed: " + ", ".join(f"{k} {v}" for k, v in report.items())


_attachment: Attachment | None = None


def _report_at_exit() -> None:
    if _attachment is not None:
        _attachment.report_at_exit()


def main(argv: Sequence[str] | None = None) -> int:
    global _attachment
    # Registered before anything else (the imports register theirs): runs after all of them.
    atexit.register(_report_at_exit)
    parser = argparse.ArgumentParser(prog="python -m rtj_trainer.warm.worker")
    parser.add_argument("--status-fd", type=int, required=True,
                        help="pipe to the pool: R when ready, T when taken")
    parser.add_argument("--local-rank", type=int, default=None,
                        help="the local rank this warm worker is meant for (its device warmed)")
    options = parser.parse_args(argv)
    launch_env = dict(os.environ)  # before torch adds its own (CUDA_MODULE_LOADING at CUDA init)
    pool_dir = os.environ[warmwire.POOL_DIR_ENV]
    parent_death_signal(signal.SIGKILL)
    listener, socket_path = listen(pool_dir, options.local_rank)
    began = time.time()
    preimport()
    imported = time.time()
    warmed = warm_device(options.local_rank)
    os.write(options.status_fd, b"R")
    conn, _ = listener.accept()
    with contextlib.suppress(OSError):
        os.unlink(socket_path)
    listener.close()
    with contextlib.suppress(OSError):
        os.write(options.status_fd, b"T")
    os.close(options.status_fd)
    try:
        request, fds = read_request(conn)
    except (OSError, warmwire.WireError) as exc:
        print(f"[rtj-warm] warm worker {os.getpid()}: no usable request ({exc})", file=sys.stderr)
        return 0
    mismatch = warmwire.startup_env_mismatch(request.env, launch_env)
    if mismatch is not None:
        for fd in fds:
            os.close(fd)
        conn.sendall(warmwire.encode({"refused": f"{mismatch} differs from the launcher's"}))
        return 0
    attachment = _attachment = Attachment(conn)
    _wrap_os_exit(attachment)
    apply(request, fds)
    parent_death_signal(0)  # from now on it lives as long as its client
    started = timeline.process_start_time(request.pid)
    if started is not None:
        timeline.mark("process_start", started)
    timeline.mark("attached")
    conn.sendall(warmwire.encode({"attached": os.getpid()}))
    threading.Thread(target=attachment.watch, name="rtj-warm-client", daemon=True).start()
    print(f"[rtj-warm] worker pid {request.pid} runs in warm process {os.getpid()} (imports "
          f"took {imported - began:.1f} s, done {time.time() - imported:.1f} s before{warmed})",
          file=sys.stderr, flush=True)
    attachment.code = run_worker(request.args)
    return attachment.code


if __name__ == "__main__":
    sys.exit(main())
