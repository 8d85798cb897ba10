"""The start-up allowance's switch of the in-process wrapper's timeouts
(rtj_trainer.resiliency.StartupAllowance): off at `begin`, on again at `end` or when its timer
expires, and never on again after `cancel` (the way out of a finished job keeps them off).
The wrapper is a recorder of the two calls the allowance makes (NVRx's
`CallWrapper._disable_hang_protection` / `_enable_hang_protection`); what NVRx does with them is
covered by the e2e tests in tests/e2e/test_trainer_ft_launcher.py."""

from __future__ import annotations

import time

import pytest
from rtj_trainer.nvrx.inprocess import WrapperHandle
from rtj_trainer.resiliency import StartupAllowance

pytestmark = pytest.mark.unit


class Switch:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def _disable_hang_protection(self) -> None:
        self.calls.append("off")

    def _enable_hang_protection(self) -> None:
        self.calls.append("on")


def test_end_switches_the_timeouts_on_once() -> None:
    switch = Switch()
    allowance = StartupAllowance(WrapperHandle(switch), seconds=30, rank=0)
    allowance.begin()
    assert allowance.end() is True
    assert allowance.end() is False
    assert switch.calls == ["off", "on"]


def test_the_timer_switches_them_on_when_the_start_takes_too_long() -> None:
    switch = Switch()
    StartupAllowance(WrapperHandle(switch), seconds=0.05, rank=0).begin()
    deadline = time.monotonic() + 5
    while switch.calls != ["off", "on"] and time.monotonic() < deadline:
        time.sleep(0.01)
    assert switch.calls == ["off", "on"]


def test_cancel_leaves_them_off_and_stops_the_timer() -> None:
    switch = Switch()
    allowance = StartupAllowance(WrapperHandle(switch), seconds=0.05, rank=0)
    allowance.begin()
    allowance.cancel()
    time.sleep(0.2)  # past the timer
    assert allowance.end() is False
    assert switch.calls == ["off"]


def test_no_allowance_touches_nothing() -> None:
    switch = Switch()
    allowance = StartupAllowance(WrapperHandle(switch), seconds=0, rank=0)
    allowance.begin()
    assert allowance.end() is False
    assert switch.calls == []
