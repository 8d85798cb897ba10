"""`parallel.poll`: the wait loop under the polled barrier and the wait for peers."""

from __future__ import annotations

import itertools
import time

import pytest
from rtj_trainer.parallel import poll
from rtj_trainer.train import pace

pytestmark = pytest.mark.unit


def test_poll_returns_once_done_says_yes_and_keeps_alive_meanwhile() -> None:
    answers = iter([False] * 5 + [True])
    beats: list[float] = []
    assert poll(lambda: next(answers), seconds=10, max_pause=0.01,
                keepalive=lambda: beats.append(time.monotonic()), every_seconds=0.0)
    assert len(beats) == 5  # once per "no" (every_seconds 0), none after the "yes"


def test_poll_gives_up_at_its_deadline_and_beats_at_its_interval() -> None:
    beats: list[float] = []
    began = time.monotonic()
    assert not poll(lambda: False, seconds=0.35, max_pause=0.02,
                    keepalive=lambda: beats.append(time.monotonic()), every_seconds=0.1)
    took = time.monotonic() - began
    assert took >= 0.35
    # The first beat at once, then never closer than the interval.
    assert beats and beats[0] - began < 0.5 and len(beats) <= 1 + took / 0.1, beats
    assert all(b - a >= 0.1 for a, b in itertools.pairwise(beats))


def test_poll_asks_first_and_does_not_sleep_when_already_done() -> None:
    calls = []
    assert poll(lambda: calls.append(1) or True, seconds=0, max_pause=1.0)
    assert calls == [1]


def test_pace_sleeps_out_the_rest_of_a_step_in_short_slices(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """train.min_step_seconds: the loop sleeps until the step's end, never in one long sleep (an
    asynchronous exception of the in-process wrapper must be able to land)."""
    slept: list[float] = []
    real_sleep = time.sleep

    def recorded(seconds: float) -> None:
        slept.append(seconds)
        real_sleep(seconds)

    monkeypatch.setattr(time, "sleep", recorded)
    until = time.monotonic() + 0.2
    pace(until, slice_seconds=0.05)
    assert time.monotonic() >= until
    assert len(slept) >= 4 and max(slept) <= 0.05
    slept.clear()
    pace(time.monotonic() - 1.0)  # a step already longer than the minimum: no sleep at all
    assert slept == []
