"""What a rank's checkpointer keeps in the process's `CarryOver` (rtj_trainer.carry) across
in-process restarts: the NVRx writer (`ProcessWriter`), the training state an interrupted attempt
offers to keep (`expect_offer`, `stage_offered`), and the closes a restart cut short
(`close_interrupted`). The wrapper's finalize step (rtj_trainer.resiliency) and the next attempt's
start (rtj_trainer.trainer) call them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from ..carry import CarryOver
from ..nvrx import asyncwriter
from .writer import arm_writer

log = logging.getLogger("rtj_trainer.checkpoint.checkpointer")


class ProcessWriter:
    """The process's one NVRx persistent writer (rtj_trainer.nvrx.asyncwriter), kept across
    in-process restarts while idle, in the process's `CarryOver` (rtj_trainer.carry).

    Why: NVRx's writer is a spawned Python process that imports torch, seconds of CPU. Every
    in-process restart used to kill each rank's writer (the wrapper's
    `AbortPersistentCheckpointProcesses`) and spawn a new one in the next attempt, so a warm
    spare's takeover put one such start-up per rank on the cores exactly while the new attempt
    built its process group and ran its first step (measured on the 2-core CPU benchmark: the
    first step took 2 s instead of 0.2 s, and once a gloo collective timed out and cost a
    second restart). Now an attempt that ends by an in-process restart hands its writer back
    when no write is in flight (`Checkpointer.close(abort=True)`: the next attempt stages into
    the same buffer, so a writer still reading it is killed as before), the next attempt takes
    it, and a process can start its writer before its first attempt (`prestart`: a warm spare
    does it while it waits)."""

    def __init__(self, carry: CarryOver) -> None:
        self.carry = carry

    def prestart(self, rank: int) -> None:
        """Spawn this process's writer now (once)."""
        if self.carry.writer is None:
            self.carry.writer = asyncwriter.spawn(rank, arm_writer)

    def stopped_busy(self, rank: int) -> None:
        """The writer of `rank` was stopped mid-write: replace it (`start_replacement`)."""
        self.carry.writer_to_replace = rank

    def start_replacement(self) -> None:
        """Start the replacement of a writer stopped mid-write, so that the next attempt's first
        save does not queue behind its start-up (seconds of imports: on two CPU cores a rank
        waited 5 s for it at its second save, its peer's gloo collective timed out, and the
        attempt restarted again). Called from the wrapper's finalize step."""
        rank, self.carry.writer_to_replace = self.carry.writer_to_replace, None
        if rank is not None:
            self.prestart(rank)

    def take(self, rank: int) -> Any:
        """The kept writer if it still runs, else a new one."""
        self.carry.writer_to_replace = None
        queue, self.carry.writer = self.carry.writer, None
        if queue is not None and asyncwriter.alive(queue):
            return queue
        if queue is not None:
            with contextlib.suppress(Exception):
                queue.close(abort=True)
        return asyncwriter.spawn(rank, arm_writer)

    def release(self) -> None:
        """The process is leaving: stop the writer no attempt took (kept by an attempt that
        failed, or prestarted). Left to the interpreter's exit, multiprocessing kills the writer
        first and NVRx's `__del__` then waits for it to take a last message, for ever: a worker
        that raised out of its last attempt never exited and held its launcher's pipe open."""
        queue, self.carry.writer = self.carry.writer, None
        self.carry.writer_to_replace = None
        if queue is not None:
            with contextlib.suppress(Exception):
                queue.close(abort=True)

    def keep(self, queue: Any) -> None:
        """Hand back an idle writer for the next attempt of this process."""
        if self.carry.writer is not None and self.carry.writer is not queue:
            with contextlib.suppress(Exception):
                self.carry.writer.close(abort=True)
        self.carry.writer = queue


def expect_offer(carry: CarryOver, offer: Callable[[], object] | None) -> None:
    """Register how the attempt now running offers its training state (it calls
    `Checkpointer.offer_live` when that state is intact), or withdraw it (None: the attempt ended
    cleanly or for good). `stage_offered` calls it when the attempt offered nothing itself.

    The attempt cannot be relied on to make the offer from its own exception handler: once NVRx's
    monitor thread has raised its restart into the main thread and the main thread has not reached
    the wrapper within the soft timeout (a rank stuck in one long C call, such as a slow step
    blocked past twice the soft timeout), the monitor raises again and again until it does, and one
    of those exceptions can land inside the handler and cut the offer short: the next attempt then
    went back to the last save and computed steps again."""
    carry.offer = offer


def stage_offered(carry: CarryOver) -> int | None:
    """Stage the training state an interrupted attempt offered (`Checkpointer.offer_live`, or the
    offer registered with `expect_offer`, made here), so that the next attempt can resume from
    it: called where no asynchronous exception of NVRx's monitor thread can land any more (the
    wrapper's finalize step, after `close_interrupted`), and before a new attempt builds its
    checkpointer. Returns the step staged, if any."""
    # Each entry is removed only once its work is done: a call cut short (an exception of NVRx's
    # that was already pending when its monitor thread stopped) leaves it to the next call,
    # which the next attempt makes before it builds its checkpointer (Trainer.__init__).
    if carry.offered is None and carry.offer is not None:
        try:
            carry.offer()
        except Exception as exc:  # the restart goes on: the next attempt resumes from a copy
            log.warning("could not offer the interrupted attempt's training state: %s", exc)
    carry.offer = None
    if carry.offered is None:
        return None
    checkpointer, step, state = carry.offered  # offer_live keeps at most one
    began = time.perf_counter()
    try:
        where = checkpointer.stage_live(step, state)
    except Exception as exc:  # the restart goes on: the next attempt resumes from a copy
        carry.offered = None
        log.warning("could not keep the training state after step %d in memory: %s", step, exc,
                    extra={"rank": checkpointer.rank})
        return None
    carry.offered = None
    log.info("kept the training state after step %d %s for the next attempt (%.3f s)",
             step, where, time.perf_counter() - began, extra={"rank": checkpointer.rank})
    return step


def close_interrupted(carry: CarryOver) -> int:
    """Finish, as an abort, every close() an in-process restart interrupted (or never reached):
    keep an idle writer for the next attempt, stop a busy one, stop a commit thread. Called
    after NVRx's monitor thread stopped raising (the wrapper's finalize step) and before a new
    attempt builds its checkpointer. Returns how many there were."""
    unclosed = list(carry.unclosed)
    for checkpointer in unclosed:
        try:
            checkpointer.close(abort=True)
        except Exception as exc:  # the next one still gets closed
            log.warning("closing an interrupted checkpointer failed: %s", exc,
                        extra={"rank": checkpointer.rank})
            with contextlib.suppress(ValueError):
                carry.unclosed.remove(checkpointer)
    return len(unclosed)
