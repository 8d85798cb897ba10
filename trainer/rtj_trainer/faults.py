"""Fault injection for tests, benchmarks and drills: `TRAINER_FAULTS="STEP:RANK:KIND,..."`.

KIND is one of:

- `exception`: raise (a soft fault; in-process restart can recover it in the same processes);
- `sigkill`: the rank's worker process SIGKILLs itself;
- `hang`: the rank stops making progress but stays alive (sleeps in short slices, so an
  asynchronous exception from the in-process wrapper can still interrupt it);
- `exit=CODE`: the worker exits with CODE at once;
- `launcher-kill`: the whole pod's process tree dies (the ft_launcher that owns this worker, its
  rank monitors and every worker), as when a node is lost;
- `stall=SECONDS`: the step is slow, not hung: the main thread blocks in one C call for SECONDS
  and runs no Python meanwhile (as in a long backward pass, or a collective waiting for a slower
  peer), then the step goes on;
- `write-error`: the shard write of the checkpoint of step STEP fails on RANK with EIO and the
  writer leaves its `.error` record, as when one write to the store fails;
- `write-lost`: the same write fails and leaves nothing, not even the `.error` record, as when the
  store fails for the small file too (EIO, ENOSPC, ESTALE, the directory gone).

A fault fires at the start of step STEP on global rank RANK, before that step's work (the write
faults: in the save of step STEP, so STEP must be a checkpointed step); STEP one
past the last step fires on the way out, once every checkpoint is committed and the trainer has
left its watchdogs (before the summary and the clean-up). Each fault
fires once per job, even across restarts: before firing, the rank creates a marker file under
`<checkpoint dir>/faults/` with O_EXCL and fsyncs it; a marker that exists means "already fired".
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T", int, float)
FAULT_KINDS = ("exception", "sigkill", "hang", "exit", "launcher-kill", "stall", "write-error",
               "write-lost")
WRITE_FAULTS = {"write-error": "error", "write-lost": "lost"}
"""Fault kind -> what `writer.write_shard(fail=...)` does."""
MAX_STALL_SECONDS = 3600.0


class FaultSpecError(ValueError):
    """TRAINER_FAULTS is malformed; the message quotes the offending entry."""


class InjectedFault(RuntimeError):
    """Raised by an `exception` fault."""


@dataclass(frozen=True, slots=True)
class Fault:
    step: int
    rank: int
    kind: str
    exit_code: int = 0
    seconds: float = 0.0
    """How long a `stall` blocks."""

    @property
    def marker_name(self) -> str:
        kind = self.kind
        if kind == "exit":
            kind = f"exit{self.exit_code}"
        elif kind == "stall":
            kind = f"stall{self.seconds:g}"
        return f"step{self.step}-rank{self.rank}-{kind}"


def parse_faults(text: str) -> tuple[Fault, ...]:
    """`"10:1:exception, 20:0:exit=3"` -> Faults; raises FaultSpecError on anything malformed."""
    faults = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) != 3:
            raise FaultSpecError(f"TRAINER_FAULTS entry {entry!r}: expected STEP:RANK:KIND")
        step_text, rank_text, kind = (p.strip() for p in parts)
        try:
            step, rank = int(step_text), int(rank_text)
        except ValueError:
            raise FaultSpecError(
                f"TRAINER_FAULTS entry {entry!r}: STEP and RANK must be integers"
            ) from None
        if step < 1 or rank < 0:
            raise FaultSpecError(f"TRAINER_FAULTS entry {entry!r}: STEP >= 1 and RANK >= 0")
        exit_code, seconds = 0, 0.0
        if kind.startswith("stall="):
            seconds = _parameter(entry, kind, float, "stall=SECONDS needs a number",
                                 lambda v: 0 < v <= MAX_STALL_SECONDS,
                                 f"SECONDS must be in (0, {MAX_STALL_SECONDS:g}]")
            kind = "stall"
        elif kind.startswith("exit="):
            exit_code = _parameter(entry, kind, int, "exit=CODE needs an integer",
                                   lambda v: 0 < v < 256, "CODE must be 1..255")
            kind = "exit"
        elif kind not in FAULT_KINDS or kind in ("exit", "stall"):
            raise FaultSpecError(
                f"TRAINER_FAULTS entry {entry!r}: unknown KIND {kind!r} "
                "(exception, sigkill, hang, exit=CODE, launcher-kill, stall=SECONDS, write-error, "
                "write-lost)"
            )
        faults.append(Fault(step, rank, kind, exit_code, seconds))
    return tuple(faults)


def _parameter(entry: str, kind: str, convert: Callable[[str], T],
               unparsable: str, valid: Callable[[T], bool], invalid: str) -> T:
    """The VALUE of a `KIND=VALUE` fault, converted and checked; FaultSpecError quoting the
    entry otherwise."""
    try:
        value = convert(kind.split("=", 1)[1])
    except ValueError:
        raise FaultSpecError(f"TRAINER_FAULTS entry {entry!r}: {unparsable}") from None
    if not valid(value):
        raise FaultSpecError(f"TRAINER_FAULTS entry {entry!r}: {invalid}")
    return value


def _launcher_tree_pids() -> list[int]:
    """This worker's ft_launcher (the nearest ancestor whose program is `ft_launcher`) and its
    descendants, launcher first; falls back to the parent process."""
    import psutil

    me = psutil.Process()
    root = me.parent()
    for ancestor in me.parents():
        try:
            if any(os.path.basename(part) == "ft_launcher" for part in ancestor.cmdline()[:2]):
                root = ancestor
                break
        except psutil.Error:
            continue
    if root is None:
        return [os.getpid()]
    family = [root.pid]
    try:
        family += [child.pid for child in root.children(recursive=True)]
    except psutil.Error:
        pass
    return family


class FaultInjector:
    """Fires this rank's faults at their steps, once per job (markers on the checkpoint volume)."""

    def __init__(self, faults: tuple[Fault, ...], *, rank: int, marker_dir: Path) -> None:
        self.rank = rank
        self.marker_dir = marker_dir
        mine = [f for f in faults if f.rank == rank]
        self._by_step = {f.step: f for f in mine if f.kind not in WRITE_FAULTS}
        self._in_save = {f.step: f for f in mine if f.kind in WRITE_FAULTS}

    def already_fired(self, fault: Fault) -> bool:
        return (self.marker_dir / fault.marker_name).exists()

    def _claim(self, fault: Fault) -> bool:
        """Record the firing durably before firing; False if it fired in an earlier attempt."""
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(self.marker_dir / fault.marker_name, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return False
        try:
            os.write(fd, _stamp())
            os.fsync(fd)
            dir_fd = os.open(self.marker_dir, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
            # The benchmarks read the marker's time as the moment of the fault: it is written
            # again once the marker is durable (the fsyncs take up to ~1.4 s with a checkpoint
            # write in flight, and that wait is not the recovery's). Same length, no fsync: a
            # crash of the host leaves the first time, which is the claim that matters.
            os.pwrite(fd, _stamp(), 0)
        finally:
            os.close(fd)
        return True

    def maybe_fire(self, step: int) -> None:
        fault = self._by_step.get(step)
        if fault is None or not self._claim(fault):
            return
        log.info("injecting fault %s at step %d", fault.kind, step, extra={"rank": self.rank})
        fire(fault)

    def write_fault(self, step: int) -> str | None:
        """The save of `step` is starting: what its shard write must do wrong on this rank
        (`WRITE_FAULTS`: "error" or "lost"), once per job; None for a write that goes well."""
        fault = self._in_save.get(step)
        if fault is None or not self._claim(fault):
            return None
        log.info("injecting fault %s into the save of step %d", fault.kind, step,
                 extra={"rank": self.rank})
        return WRITE_FAULTS[fault.kind]


def _stamp() -> bytes:
    """A marker's content: the time, in a fixed width (rewritten in place)."""
    return f"{time.time():.6f}\n".encode()


def fire(fault: Fault) -> None:
    if fault.kind == "exception":
        raise InjectedFault(f"injected exception at step {fault.step} on rank {fault.rank}")
    if fault.kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "exit":
        os._exit(fault.exit_code)
    if fault.kind == "launcher-kill":
        for pid in _launcher_tree_pids():
            if pid == os.getpid():
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os.kill(os.getpid(), signal.SIGKILL)
    if fault.kind == "stall":
        # One C call: the main thread runs no Python for that long (a slow step, e.g. a long
        # backward pass or a collective waiting for a slower peer), then the step goes on.
        time.sleep(fault.seconds)
        return
    if fault.kind == "hang":
        while True:  # short sleeps: an asynchronous exception can still land between them
            time.sleep(0.05)
