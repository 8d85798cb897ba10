"""Wall-clock marks of a worker's start and of each attempt's set-up, logged once per attempt.

Why: a restart's cost is the sum of process start, imports, CUDA and NCCL set-up, reading the
checkpoint, building the model and loading the state, and the benchmarks could only see it as
log lines stamped when they reached them (through ft_launcher's relay, up to seconds late). Each
rank now logs `timeline {...}` with the absolute Unix times at which it passed each point, so a
benchmark (or a person) can split a restart exactly. Marks cost one `time.time()` each.

Process-level marks (`process_start`, `main`, `imports`) are kept for the process's life; attempt
marks are cleared by `begin_attempt()` (every in-process restart iteration is a new attempt),
which rtj_trainer.resiliency calls where an attempt begins: at the start of the training function
(`attempt`; with in-process restart, when the wrapper enters it, then `session` once the rank
monitor and the application store are reconnected); `rtj_trainer.trainer` marks the rest
(`build`, `process_group`, `identity`, `checkpoint_chosen`, `model_built`, `state_loaded`,
`first_step`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable

PROCESS_MARKS = ("process_start", "attached", "main", "imports")
"""`attached`: a warm worker took over this worker (rtj_trainer.warm.worker); `process_start` is
then the start of the worker process ft_launcher started (the attach client)."""
RESTART_MARKS = ("restart_abort", "restart_ours_aborted", "restart_finalize", "restart_finalized")
"""How the in-process restart before this attempt went (rtj_trainer.resiliency), kept into the
attempt it started: NVRx's monitor thread began the abort steps (`restart_abort`, after the
wrapper's `last_call_wait`), ours were done (`restart_ours_aborted`; NVRx then aborts NCCL and
destroys the process groups, waits for the device and raises into the main thread), the finalize
step began (`restart_finalize`: the main thread caught the restart) and ended (`restart_finalized`:
writer closed, live state kept); then NVRx's health check, iteration barrier and `attempt`."""
_marks: dict[str, float] = {}


def process_start_time(pid: int | None = None) -> float | None:
    """When this process (or `pid`) started (Unix time), from /proc; None where /proc cannot be
    read."""
    try:
        with open(f"/proc/{'self' if pid is None else pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        start_ticks = int(fields[19])  # field 22 of stat(5); fields[0] is field 3
        with open("/proc/stat") as handle:
            boot = next(int(line.split()[1]) for line in handle if line.startswith("btime "))
        return boot + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def mark(name: str, at: float | None = None) -> None:
    """Record that this process passed `name` now (or at `at`)."""
    _marks[name] = time.time() if at is None else at


def marker(name: str) -> Callable[[], None]:
    """A callable that marks `name` when called (an in-process restart's step)."""
    return lambda: mark(name)


def begin_attempt() -> None:
    """Forget the previous attempt's marks (process-level and restart marks stay) and mark
    `attempt`."""
    for name in [n for n in _marks if n not in PROCESS_MARKS + RESTART_MARKS]:
        del _marks[name]
    mark("attempt")


def marks() -> dict[str, float]:
    """The marks so far, in the order they were first set."""
    return dict(_marks)


def render() -> str:
    """`{"process_start": 1796077251.873, ...}` (millisecond precision) for the log line."""
    return json.dumps({name: round(at, 3) for name, at in _marks.items()})
