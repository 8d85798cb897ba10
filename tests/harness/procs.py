"""Child processes that can never outlive the harness.

Every server the harness starts runs in its own session/process group, with a parent-death signal,
and is recorded in a process-wide registry. Teardown sends SIGTERM to the group, waits, then
SIGKILL. An atexit hook and SIGTERM/SIGHUP handlers run the same teardown when the owner exits
early, so a crashed test session leaves nothing behind.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TypeVar

_PR_SET_PDEATHSIG = 1
_registry: dict[int, ManagedProcess] = {}
_registry_lock = threading.Lock()
_handlers_installed = False


T = TypeVar("T")


def _die_with_parent(sig: int) -> Callable[[], None]:
    def preexec() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)

    return preexec


class ManagedProcess:
    """A process (and its process group) started by the harness, logging to a file."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_file: Path,
        env: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        death_signal: int = signal.SIGKILL,
    ) -> None:
        self.name = name
        self.log_file = log_file
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "ab") as log:
            self.popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=dict(env) if env is not None else None,
                cwd=cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent(death_signal),
            )
        self.pid = self.popen.pid
        with _registry_lock:
            _registry[self.pid] = self
        _install_exit_handlers()

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_file.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM the process group, SIGKILL it after `timeout` seconds; reap the leader."""
        try:
            kill_group(self.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
            kill_group(self.pid, signal.SIGKILL)
            try:
                self.popen.wait(5)
            except subprocess.TimeoutExpired:
                pass
        finally:
            with _registry_lock:
                _registry.pop(self.pid, None)


def kill_group(pgid: int, sig: int) -> None:
    """Signal a whole process group; a group that is already gone is fine."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(timeout: float = 5.0) -> None:
    """Stop every registered process, newest first (what atexit and the signal handlers run)."""
    with _registry_lock:
        processes = sorted(_registry.values(), key=lambda p: p.pid, reverse=True)
    for process in processes:
        kill_group(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for process in processes:
        try:
            process.popen.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        kill_group(process.pid, signal.SIGKILL)
    for process in processes:
        process.stop(timeout=1)


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    stop_all()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _install_exit_handlers() -> None:
    global _handlers_installed
    if _handlers_installed:
        return
    _handlers_installed = True
    atexit.register(stop_all)
    if threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(signum) in (signal.SIG_DFL, None):
                signal.signal(signum, _on_signal)


def wait_for(condition: Callable[[], T | None], timeout: float, what: str) -> T:
    """Poll `condition` every 0.1 s until it returns something truthy, and return that."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")


def wait_until(
    condition: Callable[[], bool],
    timeout: float,
    what: str,
    interval: float = 0.2,
    processes: Sequence[ManagedProcess] = (),
) -> None:
    """Poll `condition` until true; fail early with the log tail if a watched process died."""
    deadline = time.monotonic() + timeout
    while True:
        for process in processes:
            if not process.alive():
                raise RuntimeError(
                    f"{process.name} exited with {process.popen.returncode} while waiting for "
                    f"{what}; log {process.log_file}:\n{process.log_tail()}"
                )
        try:
            if condition():
                return
        except Exception:
            pass
        if time.monotonic() > deadline:
            details = "\n".join(f"--- {p.name}:\n{p.log_tail(15)}" for p in processes)
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}\n{details}")
        time.sleep(interval)
