"""The learned hang timeout (rtj_trainer.hangwatch): its arithmetic, and the watch thread that
reports a step outlasting it once, never a step within it, never the first step of an attempt."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import pytest
from rtj_trainer.hangwatch import HangWatch, LearnedTimeout

pytestmark = pytest.mark.unit


def test_the_timeout_is_unknown_until_enough_steps_then_covers_typical_and_longest_steps() -> None:
    learned = LearnedTimeout(floor=0.5, factor=4, longest_factor=2, learn_steps=3, window=4)
    learned.observe(0.1)
    learned.observe(0.2)
    assert learned.seconds() is None
    learned.observe(0.15)
    assert learned.seconds() == pytest.approx(0.6)  # 4 x the median, 0.15
    for _ in range(4):  # the older steps leave the window
        learned.observe(0.05)
    assert learned.seconds() == 0.5  # 4 x 0.05 and 2 x 0.05 are below the floor
    learned.observe(1.0)  # one long step: the median stays 0.05, the longest is covered twice
    assert learned.typical() == 0.05 and learned.seconds() == pytest.approx(2.0)


def test_the_h200_runs_steps_give_the_floor() -> None:
    """One H200 (docs/benchmarks.md): typical step 0.14 s, one step of 0.955 s beside a save.
    The first rule (5 x the longest) made that 4.8 s; now 2 x 0.955 s is under the 2 s floor."""
    learned = LearnedTimeout(floor=2.0, factor=5, longest_factor=2, learn_steps=20)
    for _ in range(150):
        learned.observe(0.14)
    learned.observe(0.955)
    assert learned.seconds() == 2.0


@pytest.mark.parametrize("kwargs", [dict(floor=0), dict(factor=0.5), dict(longest_factor=0.9),
                                    dict(learn_steps=0), dict(window=0)])
def test_nonsense_settings_are_refused(kwargs: dict[str, float]) -> None:
    settings: dict[str, float] = dict(floor=1.0, factor=2.0, learn_steps=1, window=8)
    settings.update(kwargs)
    with pytest.raises(ValueError, match="LearnedTimeout"):
        LearnedTimeout(**settings)  # type: ignore[arg-type]


class Reports:
    def __init__(self) -> None:
        self.calls: list[tuple[float, float]] = []
        self.event = threading.Event()

    def __call__(self, quiet: float, limit: float) -> None:
        self.calls.append((quiet, limit))
        self.event.set()


@contextlib.contextmanager
def _watching(learned: LearnedTimeout, reports: Reports) -> Iterator[HangWatch]:
    """One attempt's watch, closed at the end."""
    watch = HangWatch(learned, reports, rank=0, tick=0.01).start()
    try:
        yield watch
    finally:
        watch.close()


def _steps(watch: HangWatch, n: int, seconds: float) -> None:
    for _ in range(n):
        with watch.stretch():
            time.sleep(seconds)


def test_a_step_past_the_learned_timeout_is_reported_once_and_short_ones_never() -> None:
    learned = LearnedTimeout(floor=0.3, factor=3, learn_steps=3)
    reports = Reports()
    with _watching(learned, reports) as watch:
        _steps(watch, 6, 0.01)  # the first is not timed, the others teach the timeout
        assert learned.observed == 5 and learned.seconds() == 0.3
        assert reports.calls == []
        with watch.stretch():  # a hang: the watch reports while the step is still stuck
            assert reports.event.wait(5.0)
            assert reports.calls[0][0] > 0.3 and reports.calls[0][1] == 0.3
            time.sleep(0.1)
        _steps(watch, 1, 0.5)  # once per attempt: the restart is already under way
        assert len(reports.calls) == 1
        assert learned.observed == 5  # the hung step taught nothing


def test_the_first_step_of_each_attempt_and_steps_before_learning_are_not_timed() -> None:
    learned = LearnedTimeout(floor=0.1, factor=2, learn_steps=2)
    reports = Reports()
    with _watching(learned, reports) as first:
        _steps(first, 1, 0.3)  # the attempt's first step: slow, not timed, not learned
        _steps(first, 2, 0.01)  # learning: not timed
        assert learned.observed == 2 and reports.calls == []
    # The next attempt of the process keeps what was learned, but its first step is free again.
    with _watching(learned, reports) as second:
        _steps(second, 1, 0.3)
        assert reports.calls == []
        _steps(second, 1, 0.3)
        assert len(reports.calls) == 1


def test_a_closed_watch_times_nothing() -> None:
    learned = LearnedTimeout(floor=0.05, factor=1, learn_steps=1)
    reports = Reports()
    watch = HangWatch(learned, reports, rank=0, tick=0.01).start()
    _steps(watch, 3, 0.001)
    watch.close()  # training finished: the way out is not a step
    _steps(watch, 1, 0.2)
    assert reports.calls == []


def test_a_report_that_fails_is_logged_and_ends_the_watch(caplog: pytest.LogCaptureFixture) -> None:
    learned = LearnedTimeout(floor=0.05, factor=1, learn_steps=1)
    done = threading.Event()

    def broken(_quiet: float, _limit: float) -> None:
        done.set()
        raise RuntimeError("monitor process gone")

    watch = HangWatch(learned, broken, rank=3, tick=0.01).start()
    try:
        _steps(watch, 2, 0.001)
        with watch.stretch():
            assert done.wait(5.0)
            time.sleep(0.05)
        assert watch.reported is not None
        assert "reporting the hang failed" in caplog.text
    finally:
        watch.close()
