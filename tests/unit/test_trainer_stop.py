"""Checkpoint now, then stop (rtj_trainer.stop): every rank stops at the same step, whichever
rank got the SIGTERM and whenever; the SIGTERM handler exists only inside the step loop."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable

import pytest
from rtj_trainer.stop import STOP, STOP_SIGNAL, StopAgreement, StopSignal

pytestmark = pytest.mark.unit


class Ranks:
    """N ranks in threads whose `reduce` is a real all-reduce over the threads (a barrier)."""

    def __init__(self, world: int) -> None:
        self.world = world
        self._values: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()
        self._barrier = threading.Barrier(world)

    def reduce_for(self, rank: int) -> Callable[[int, int], tuple[int, int]]:
        def reduce(any_flag: int, all_flag: int) -> tuple[int, int]:
            with self._lock:
                self._values[rank] = (any_flag, all_flag)
            self._barrier.wait()
            result = (max(v[0] for v in self._values.values()),
                      min(v[1] for v in self._values.values()))
            self._barrier.wait()  # nobody overwrites a value before everyone read this round
            return result

        return reduce


def run_ranks(world: int, signalled_at: dict[int, int], *, check_every: int,
              steps: int = 50) -> dict[int, tuple[int | None, bool | None]]:
    """Each rank trains `steps` steps; rank r gets its SIGTERM after step signalled_at[r].
    Returns per rank (the step it stopped at, whether everyone had been asked by then)."""
    ranks = Ranks(world)
    results: dict[int, tuple[int | None, bool | None]] = {}

    def rank_main(rank: int) -> None:
        flag = {"set": False}
        agreement = StopAgreement(ranks.reduce_for(rank), check_every=check_every,
                                  flag=lambda: flag["set"])
        for step in range(1, steps + 1):
            if signalled_at.get(rank) == step:
                flag["set"] = True
            if agreement.should_stop(step, step):
                # Trainer.stop: save and commit, then a second verdict (after the commit).
                results[rank] = (step, agreement.verdict().everyone)
                return
        results[rank] = (None, None)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a rank is stuck in a collective"
    return results


def test_every_rank_stops_at_the_first_check_after_any_rank_was_signalled() -> None:
    results = run_ranks(4, {2: 5, 0: 7}, check_every=1)
    assert results == dict.fromkeys(range(4), (5, False))  # ranks 1 and 3 were never asked


def test_with_a_check_every_k_steps_the_ranks_stop_at_the_next_check() -> None:
    results = run_ranks(3, {1: 4}, check_every=3)
    assert {step for step, _ in results.values()} == {6}


def test_the_second_verdict_says_whether_every_rank_was_asked() -> None:
    results = run_ranks(3, {0: 9, 1: 9, 2: 9}, check_every=1)
    assert results == dict.fromkeys(range(3), (9, True))


def test_nobody_stops_without_a_signal() -> None:
    assert run_ranks(2, {}, check_every=1) == {0: (None, None), 1: (None, None)}


def test_check_every_must_be_positive() -> None:
    with pytest.raises(ValueError, match="check_every"):
        StopAgreement(lambda a, b: (a, b), check_every=0)


def test_the_stop_signal_only_sets_the_flag_while_armed_and_ends_the_process_otherwise() -> None:
    stop = StopSignal()
    previous = signal.getsignal(STOP_SIGNAL)
    try:
        assert stop.arm()
        os.kill(os.getpid(), STOP_SIGNAL)  # handled between bytecodes, on this thread
        for _ in range(1000):
            if stop.requested:
                break
        assert stop.requested and stop.signal_number == STOP_SIGNAL
        stop.disarm()
        assert signal.getsignal(STOP_SIGNAL) == signal.SIG_DFL  # it ends the process again
        assert stop.requested  # what was asked stays asked
    finally:
        signal.signal(STOP_SIGNAL, previous)


def test_sigterm_is_left_alone() -> None:
    """ft_launcher restarts workers with SIGTERM: that must still end them at once."""
    stop = StopSignal()
    before = signal.getsignal(signal.SIGTERM)
    previous = signal.getsignal(STOP_SIGNAL)
    try:
        stop.arm()
        assert signal.getsignal(signal.SIGTERM) == before
    finally:
        stop.disarm()
        signal.signal(STOP_SIGNAL, previous)


def test_arming_off_the_main_thread_changes_nothing() -> None:
    stop = StopSignal()
    before = signal.getsignal(STOP_SIGNAL)
    armed: list[bool] = []
    thread = threading.Thread(target=lambda: armed.append(stop.arm()))
    thread.start()
    thread.join()
    assert armed == [False] and not stop.armed and signal.getsignal(STOP_SIGNAL) == before


def test_the_process_wide_flag_starts_unset() -> None:
    assert not STOP.requested and not STOP.armed


def test_a_worker_stopped_for_a_peer_is_never_taken_for_a_non_retryable_exit() -> None:
    from types import SimpleNamespace

    from rtj_trainer.nvrx.launcher import non_retryable_failures
    from rtj_trainer.stop import PEER_STOPPED_EXIT_CODE

    failures = {0: SimpleNamespace(exitcode=PEER_STOPPED_EXIT_CODE), 1: SimpleNamespace(exitcode=7)}
    assert non_retryable_failures(failures, frozenset({PEER_STOPPED_EXIT_CODE, 7})) == [(1, 7)]


def test_a_stopped_worker_exits_0_when_asked_and_95_when_a_peer_was() -> None:
    from rtj_trainer.stop import PEER_STOPPED_EXIT_CODE, stop_exit_code

    assert stop_exit_code(True) == 0
    assert stop_exit_code(False) == PEER_STOPPED_EXIT_CODE == 95


def test_a_stopped_worker_arms_a_daemon_timer_that_ends_it_with_its_code() -> None:
    """Leaving NVRx's wrapper can hang after a partial stop (its termination barrier waits for a
    peer its launcher killed): the timer ends the process with its code instead."""
    from rtj_trainer.stop import EXIT_AFTER_STOP_SECONDS, exit_soon

    ended: list[int] = []
    timer = exit_soon(95, after_seconds=3600, end=ended.append)
    try:
        assert timer.daemon and timer.is_alive() and timer.interval == 3600
        assert timer.function == ended.append and timer.args == (95,)
    finally:
        timer.cancel()
    assert 0 < EXIT_AFTER_STOP_SECONDS <= 30  # well inside any grace period
