"""Checkpoint now, then stop: what a worker does when its pod is asked to end (SIGTERM).

Kubernetes ends a pod (the job suspended or preempted, the job or the pod deleted, the node
drained) by sending SIGTERM to the container and SIGKILL after `terminationGracePeriodSeconds`.
ft_launcher (the container's main process) then stops its workers and SIGKILLs them after
`--term-timeout` (the operator sets it below the grace period: rtj_operator.podplan). Through the
launcher shim (rtj_trainer.launcher) it sends them `STOP_SIGNAL` (SIGUSR2), to the worker process
only, not its process group (the worker's checkpoint writer must live to write the last save).
A worker then has that long to save the step it is at. SIGTERM keeps its meaning (die now): it is
what ft_launcher sends its workers to restart them after a fault, where nothing is worth saving.

**Every rank saves the same step.** The signal reaches ranks at different steps (pods are deleted
one by one; a node drain signals one pod only), and a checkpoint is a set of per-rank shards of
one step. So `STOP_SIGNAL` only sets a flag here (`StopSignal`); every `check_every` steps all ranks
reduce their flags (`StopAgreement.should_stop`: one all-reduce of two integers, MAX and MIN of
"I was signalled"). The first check that sees any flag set is the step every rank stops at: it
saves that step (unless it was saved already), waits until rank 0 committed it, and leaves the
step loop. A second reduce after the commit tells whether every rank was signalled (the whole job
was stopped: a suspend, preemption or deletion) or only some (a drain or an eviction of some
pods: the others must be restarted).

**A stop's wait is bounded.** A signalled worker lives at most `--term-timeout` after the signal
(then ft_launcher SIGKILLs it), and one killed before its shard is written leaves no record:
the others would wait out the commit deadline (`checkpoint.commit_timeout_seconds`, 10 minutes)
for a save that can never commit. So before it saves, every rank works out how long it may still
wait (`stop_budget`: `checkpoint.stop_timeout_seconds`, which the launcher shim sets from its
`--term-timeout` through `TERM_TIMEOUT_ENV`, less the time since its signal and a margin) and the
ranks take the smallest (`StopAgreement.common_budget`, one all-reduce), so that they all give
up at the same moment. A stop that gives up reports no committed step (the termination message's
`committedStep` is null: the operator records no stop), joins no further collective (a peer may
be gone) and exits as a stop does; the next attempt resumes from the newest commit.

**How the worker exits.** A rank that was signalled itself exits 0 and local rank 0 writes the
termination message with outcome `Stopped` (the step, the committed step); its launcher, already
shutting down, exits 0 as well. A rank that stopped only because a peer was signalled exits with
`PEER_STOPPED_EXIT_CODE`: its launcher is not shutting down, and restarts its workers (they
rejoin the rendezvous with the replaced pod and resume from the checkpoint just committed).

**Leaving promptly.** The termination message is written as soon as the checkpoint is committed,
still inside NVRx's in-process wrapper, and a timer then ends the process with its exit code
`EXIT_AFTER_STOP_SECONDS` later unless it has ended by itself (`exit_soon`). Leaving the wrapper
can hang after a stop of only some pods: its termination barrier waits, with no time limit on the
rank that hosts the wrapper's store (rank 0), for every rank of the world, and a peer that its
launcher killed while it was stopping never arrives (seen on a drained pod 0: it stayed until the
kubelet's SIGKILL at the end of the grace period). Everything worth keeping is on disk by then.

Outside the step loop (building the model, loading a checkpoint, a warm spare waiting inside the
in-process wrapper) there is nothing newer to save: the handler is installed only while the loop
runs (`StopSignal.arm`), so the signal elsewhere ends the process at once (its default action).

"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import TYPE_CHECKING

from rtj_wire.env import STOP_SIGNAL_DIR
from rtj_wire.pod import CHECKPOINT_AND_STOP_SIGNAL, PEER_STOPPED_EXIT_CODE

if TYPE_CHECKING:
    import torch

STOP_SIGNAL = CHECKPOINT_AND_STOP_SIGNAL
"""What asks a worker to checkpoint, then stop (its default action, outside the step loop, ends
the process as SIGTERM would); the pod's contract (rtj_wire.pod).

`PEER_STOPPED_EXIT_CODE` (rtj_wire.pod): a worker that checkpointed and stopped because another
rank was asked to stop (its own pod runs on): not 0, so that its ft_launcher restarts it into the
next rendezvous round."""
TERM_TIMEOUT_ENV = "RTJ_TERM_TIMEOUT_SECONDS"
"""Set by the launcher shim for its workers from ft_launcher's `--term-timeout` (rtj_trainer.
launcher.shim); read as `checkpoint.stop_timeout_seconds` (rtj_trainer.config). Between the shim and
its workers only (train-local.sh passes the same variable as the flag)."""
STOP_NOT_COMMITTED = "StopCheckpointNotCommitted"
"""The termination message's reason when a stop gave up its checkpoint (no `committedStep`)."""
STOP_MARGIN_SECONDS = 5.0
"""Of the stop's budget, kept for leaving (the termination message, the exit) before ft_launcher's
SIGKILL; a tenth of the budget when that is less."""
EXIT_AFTER_STOP_SECONDS = 10.0
"""How long a worker that stopped (its checkpoint committed, its termination message written)
may take to leave the in-process wrapper before it ends itself with its exit code."""


def stop_budget(timeout_seconds: float, *, requested_at: float | None, now: float) -> float:
    """Seconds this rank may still spend on a stop's checkpoint: `timeout_seconds` (the
    launcher's `--term-timeout`) less the time since this rank's own signal (`requested_at`,
    unix time; None: a peer's signal stopped it, so it learned of the stop just now) and the
    margin for leaving; at least a second."""
    elapsed = 0.0 if requested_at is None else max(0.0, now - requested_at)
    margin = min(STOP_MARGIN_SECONDS, timeout_seconds / 10)
    return max(1.0, timeout_seconds - elapsed - margin)


def register(env: dict[str, str] | None = None) -> bool:
    """Tell the launcher shim that this worker handles `STOP_SIGNAL` (checkpoint, then stop): a
    file `local-rank-<LOCAL_RANK>` in `RTJ_STOP_SIGNAL_DIR` (rtj_wire.env). The shim sends the
    signal only to workers that registered; every other worker gets the torchrun convention when
    its pod ends (SIGTERM, then SIGKILL after the launcher's `--term-timeout`). Returns whether
    it registered (False outside the shim, or where the directory is gone)."""
    source = os.environ if env is None else env
    directory, local_rank = source.get(STOP_SIGNAL_DIR, ""), source.get("LOCAL_RANK", "")
    if not directory or not (local_rank.isascii() and local_rank.isdecimal()):
        return False
    try:
        with open(os.path.join(directory, f"local-rank-{int(local_rank)}"), "w") as marker:
            marker.write(f"{os.getpid()}\n")
    except OSError:
        return False
    return True


def registered_local_ranks(directory: str) -> set[int]:
    """The local ranks whose workers registered in `directory` (the shim's side of `register`)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return set()
    found = set()
    for name in names:
        number = name.removeprefix("local-rank-")
        if name.startswith("local-rank-") and number.isascii() and number.isdecimal():
            found.add(int(number))
    return found


def stop_exit_code(asked: bool) -> int:
    """0 for a worker that was asked to stop, PEER_STOPPED_EXIT_CODE for one that stopped because
    a peer was."""
    return 0 if asked else PEER_STOPPED_EXIT_CODE


def exit_now(code: int) -> None:
    """End the process with `code` at once (output flushed first). The interpreter's own
    shutdown after a stop can take seconds of the grace period and crash (SIGSEGV after
    "deallocated BytesIO object has exported buffers", seen under ft_launcher), which the
    launcher would count as a failed worker."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def exit_soon(code: int, *, after_seconds: float = EXIT_AFTER_STOP_SECONDS,
              end: Callable[[int], None] = exit_now) -> threading.Timer:
    """Arm a daemon timer that ends the process with `code` after `after_seconds` unless it
    has ended by then (see "Leaving promptly" above); returns it, started."""
    timer = threading.Timer(after_seconds, end, args=(code,))
    timer.daemon = True
    timer.name = "rtj-exit-after-stop"
    timer.start()
    return timer


class StopSignal:
    """The process-wide "asked to stop" flag, set by the `STOP_SIGNAL` handler.

    The handler is installed only while `armed` (inside the step loop, `arm`/`disarm`): a worker
    blocked in C code elsewhere (joining the process group, waiting for a peer) must still die
    at once on SIGTERM, as it would without a handler, and a Python handler runs only when the
    main thread gets back to the interpreter."""

    def __init__(self) -> None:
        self.requested_at: float | None = None
        self.signal_number: int | None = None
        self.armed = False
        self._lock = threading.Lock()

    @property
    def requested(self) -> bool:
        return self.requested_at is not None

    def request(self, signum: int = STOP_SIGNAL) -> None:
        with self._lock:
            if self.requested_at is None:
                self.requested_at = time.time()
                self.signal_number = signum

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The signal handler (runs in the main thread, between bytecodes)."""
        if not self.armed:  # disarmed after the signal arrived: the default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.request(signum)

    def arm(self) -> bool:
        """From now on `STOP_SIGNAL` only sets the flag. Only the main thread can install a signal
        handler: elsewhere nothing changes and this returns False."""
        if threading.current_thread() is not threading.main_thread():
            return False
        self.armed = True
        signal.signal(STOP_SIGNAL, self.handle)
        return True

    def disarm(self) -> None:
        """`STOP_SIGNAL` ends the process again (a flag already set stays set)."""
        if not self.armed or threading.current_thread() is not threading.main_thread():
            return
        self.armed = False
        signal.signal(STOP_SIGNAL, signal.SIG_DFL)

    def reset(self) -> None:
        with self._lock:
            self.requested_at = None
            self.signal_number = None


STOP = StopSignal()
"""This worker's flag (one per process)."""


@dataclass(frozen=True, slots=True)
class Verdict:
    """What the ranks agreed at one check."""

    stop: bool
    """Some rank was asked to stop: every rank stops at this step."""
    everyone: bool
    """Every rank was asked to stop (the whole job is ending), not only some."""


Reduce = Callable[[int, int], tuple[int, int]]
"""(any, all) -> (MAX of `any` over the ranks, MIN of `all` over the ranks): one collective."""


class StopAgreement:
    """Decides, identically on every rank, the step at which the job stops.

    `should_stop(step)` runs the collective on every `check_every`-th step of the attempt (and
    only then: every rank calls it with the same steps, so every rank joins the same
    collectives), and returns True on all ranks at the first check after any rank was asked to
    stop. It never returns True on one rank and False on another."""

    def __init__(self, reduce: Reduce, *, check_every: int = 1,
                 flag: Callable[[], bool] = lambda: STOP.requested) -> None:
        if check_every < 1:
            raise ValueError(f"check_every is {check_every}, not a positive number of steps")
        self._reduce = reduce
        self._flag = flag
        self.check_every = check_every
        self.checks = 0
        self.stopped_at: int | None = None

    def verdict(self) -> Verdict:
        """Run the collective now (every rank must call it at the same point)."""
        mine = 1 if self._flag() else 0
        any_rank, all_ranks = self._reduce(mine, mine)
        self.checks += 1
        return Verdict(stop=any_rank > 0, everyone=all_ranks > 0)

    def common_budget(self, seconds: float) -> float:
        """Collective (every rank, at the same point): the smallest of every rank's `seconds`
        (`stop_budget`), so that every rank gives up waiting for a stop's checkpoint at the same
        moment and none is left in a collective with a peer that already left."""
        millis = max(0, min(int(seconds * 1000), 2**31 - 1))
        _, least = self._reduce(millis, millis)
        return least / 1000

    def stop_deadline(self, timeout_seconds: float) -> tuple[float, float]:
        """Collective: this stop's common budget (`stop_budget` from this process's signal,
        `common_budget`) and the monotonic moment it runs out."""
        budget = self.common_budget(stop_budget(timeout_seconds, requested_at=STOP.requested_at,
                                                now=time.time()))
        return budget, time.monotonic() + budget

    def should_stop(self, step: int, steps_this_attempt: int) -> bool:
        """After `step` (the `steps_this_attempt`-th step of this attempt) completed."""
        if steps_this_attempt % self.check_every != 0:
            return False
        if self.verdict().stop:
            self.stopped_at = step
            return True
        return False


def torch_reduce(device: torch.device) -> Reduce:
    """The collective over the default process group: one all-reduce of [any, -all] with MAX."""
    import torch
    import torch.distributed as dist

    where = device if device.type == "cuda" else torch.device("cpu")

    def reduce(any_flag: int, all_flag: int) -> tuple[int, int]:
        values = torch.tensor([any_flag, -all_flag], dtype=torch.int32, device=where)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        found = values.tolist()
        return int(found[0]), -int(found[1])

    return reduce
