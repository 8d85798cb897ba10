"""A hang timeout learned from the observed steps (`resiliency.learned_hang_timeout`).

NVRx's in-process wrapper takes one soft timeout when it is built (half the heartbeat timeout,
5 s on the GPU benchmark) and checks it in its monitor process, which cannot be told a new value
later. A 1B model's step on an H200 takes 0.14-0.18 s, so a hang waited 5 s plus the monitor's
intervals (6.8 s measured) before the restart began. This module times the step loop itself:

- `LearnedTimeout` (pure arithmetic): the timeout is the largest of `floor`, `factor` times the
  median of the last `window` watched stretches (the typical step) and `longest_factor` times
  the longest of them (steps that recur, e.g. the one beside a checkpoint's copy); none until
  `learn_steps` stretches were seen. The stretches of a process are kept across its in-process
  attempts (same model, same data). The first rule, `factor` x the longest, was measured on one
  H200: a 0.955 s step beside a save (the typical step 0.14 s) made the timeout 4.8 s, and the
  hang waited 3.9 s; `longest_factor` keeps such steps covered twice over at a 2 s floor.
- `HangWatch` (a daemon thread per attempt): `stretch()` brackets one watched stretch of the
  step loop (the fault point, the batch, forward, backward, the update and the loss's
  synchronisation; rtj_trainer.train). The first stretch of each attempt is neither timed nor
  learned from (the start-up allowance covers it: allocator, communicators, kernels). When a
  stretch outlasts the learned timeout, the watch calls `report` once for the attempt, which
  records a soft-timeout interruption in the wrapper (`WrapperHandle.report_hang`): every rank
  is then restarted in place exactly as by NVRx's own soft timeout, which stays on as the
  backstop (for stretches the watch does not time and for a main thread that holds the GIL).

Checkpoint sections, the end of training, a stop (SIGTERM) and everything outside the
stretches are not timed by the watch. Nothing here imports NVRx.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

log = logging.getLogger(__name__)

__all__ = ["HangWatch", "LearnedTimeout"]


class LearnedTimeout:
    """The timeout learned from the durations of watched stretches (seconds)."""

    def __init__(self, *, floor: float, factor: float, learn_steps: int,
                 longest_factor: float = 2.0, window: int = 256) -> None:
        if floor <= 0 or factor < 1 or longest_factor < 1 or learn_steps < 1 or window < 1:
            raise ValueError("LearnedTimeout: floor > 0, factor >= 1, longest_factor >= 1, "
                             "learn_steps >= 1, window >= 1")
        self.floor = floor
        self.factor = factor
        self.longest_factor = longest_factor
        self.learn_steps = learn_steps
        self._recent: deque[float] = deque(maxlen=window)
        self.observed = 0
        """Stretches seen in all (not only the window)."""
        self.reported = 0
        """Hangs reported by this process's watches."""

    def observe(self, seconds: float) -> None:
        self._recent.append(seconds)
        self.observed += 1

    def seconds(self) -> float | None:
        """The timeout now, or None while fewer than `learn_steps` stretches were seen."""
        if self.observed < self.learn_steps:
            return None
        return max(self.floor, self.factor * self.typical(),
                   self.longest_factor * self.longest())

    def typical(self) -> float:
        """The median of the window (0 when empty)."""
        if not self._recent:
            return 0.0
        ordered = sorted(self._recent)
        return ordered[len(ordered) // 2]

    def longest(self) -> float:
        return max(self._recent, default=0.0)

    def summary(self) -> dict[str, float | int]:
        """What the trainer's summary shows (`learned_hang_timeout`)."""
        timeout = self.seconds()
        return {"seconds": round(timeout, 3) if timeout is not None else 0.0,
                "steps_timed": self.observed, "typical_step": round(self.typical(), 4),
                "longest_step": round(self.longest(), 4), "reported": self.reported}


class HangWatch:
    """Times an attempt's watched stretches against a `LearnedTimeout` (see the module)."""

    def __init__(self, learned: LearnedTimeout, report: Callable[[float, float], None], *,
                 rank: int, tick: float | None = None) -> None:
        self.learned = learned
        self._report = report
        self._rank = rank
        self._tick = tick if tick is not None else min(0.05, learned.floor / 20)
        self._lock = threading.Lock()
        self._began: float | None = None
        """Monotonic start of the stretch being timed; None between stretches."""
        self._limit: float | None = None
        self._stretches = 0
        self._closed = threading.Event()
        self.reported: tuple[float, float] | None = None
        """(seconds without progress, the timeout) when the watch reported this attempt's hang."""
        self._thread = threading.Thread(target=self._run, name=f"rtj-hang-watch-{rank}",
                                        daemon=True)

    def start(self) -> HangWatch:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop timing for good (the attempt ended, or training finished)."""
        self._closed.set()
        with self._lock:
            self._began = None
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)

    @contextlib.contextmanager
    def stretch(self) -> Iterator[None]:
        """One watched stretch of the step loop; learned from only when it ends normally."""
        self._stretches += 1
        timed = self._stretches > 1 and not self._closed.is_set()
        began = time.monotonic()
        if timed:
            with self._lock:
                self._limit = self.learned.seconds()
                self._began = began
        ended_normally = False
        try:
            yield
            ended_normally = True
        finally:
            with self._lock:
                self._began = None
            if timed and ended_normally and self.reported is None:
                self.learned.observe(time.monotonic() - began)

    def _run(self) -> None:
        while not self._closed.wait(self._tick):
            with self._lock:
                began, limit = self._began, self._limit
                if began is None or limit is None or self.reported is not None:
                    continue
                quiet = time.monotonic() - began
                if quiet <= limit:
                    continue
                self.reported = (quiet, limit)
                self.learned.reported += 1
            learned = self.learned
            log.warning("no progress for %.2f s in a step (learned hang timeout %.2f s from the "
                        "last %d steps: typical %.3f s x %.1f, longest %.3f s x %.1f, floor "
                        "%.1f s): restarting in place", quiet, limit,
                        min(learned.observed, len(learned._recent)), learned.typical(),
                        learned.factor, learned.longest(), learned.longest_factor,
                        learned.floor, extra={"rank": self._rank})
            try:
                self._report(quiet, limit)
            except Exception:  # the wrapper's own soft timeout stays as the backstop
                log.exception("reporting the hang failed", extra={"rank": self._rank})
            return
