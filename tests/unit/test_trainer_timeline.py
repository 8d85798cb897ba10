"""The per-attempt timeline: process marks survive an in-process restart, attempt marks do not,
and the process start comes from /proc."""

from __future__ import annotations

import json
import time

import pytest
from rtj_trainer import timeline

pytestmark = pytest.mark.unit


def test_a_new_attempt_keeps_the_process_marks_and_drops_the_last_attempts() -> None:
    timeline.mark("imports", 100.0)
    timeline.mark("process_group", 101.0)
    timeline.begin_attempt()
    marks = timeline.marks()
    assert marks["imports"] == 100.0 and "process_group" not in marks and "attempt" in marks
    assert json.loads(timeline.render())["imports"] == 100.0


def test_the_process_start_is_before_now_and_after_boot() -> None:
    started = timeline.process_start_time()
    assert started is not None and time.time() - 3600 * 24 * 365 < started <= time.time() + 1
