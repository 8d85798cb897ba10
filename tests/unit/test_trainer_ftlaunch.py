"""The launcher shim's patch of NVRx's rank monitor (rtj_trainer.ftlaunch)."""

from __future__ import annotations

import asyncio
import logging
from types import SimpleNamespace

import pytest
from nvidia_resiliency_ext.fault_tolerance.data import UpdateConfigMsg
from nvidia_resiliency_ext.fault_tolerance.rank_monitor_server import RankMonitorServer
from nvidia_resiliency_ext.fault_tolerance.rank_monitor_state_machine import (
    RankMonitorState,
    RankMonitorStateMachine,
)
from rtj_trainer.ftlaunch import reset_aborted_rank_monitors

pytestmark = pytest.mark.unit


class _RestarterLog:
    """What RankMonitorStateMachine logs through (NVRx's RankMonitorLogger): the events only."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def log_restarter_event(self, text: str) -> None:
        self.events.append(text)


def _aborted_monitor(cycle: int) -> SimpleNamespace:
    """The parts of a RankMonitorServer the config handler touches, in the state NVRx leaves a
    monitor whose worker exited while restarting in-process."""
    log = logging.getLogger("test-rank-monitor")
    rmlog = _RestarterLog()
    machine = RankMonitorStateMachine(rmlog)
    machine.handle_heartbeat_msg()  # UNINITIALIZED -> INITIALIZE
    machine.handle_ipc_connection_lost()  # -> HANDLING_START (an in-process restart)
    machine.handle_ipc_connection_lost()  # -> ABORTED (the worker exited meanwhile)
    assert machine.state == RankMonitorState.ABORTED
    return SimpleNamespace(state_machine=machine, current_cycle=cycle, rmlogger=rmlog,
                           logger=log, cfg=SimpleNamespace())


def _announce(monitor: SimpleNamespace, cycle: int) -> None:
    handler = RankMonitorServer._handle_update_config_msg
    asyncio.run(handler(monitor, UpdateConfigMsg(current_cycle=cycle), None, False))


def test_an_aborted_rank_monitor_accepts_the_workers_of_the_next_cycle() -> None:
    reset_aborted_rank_monitors()
    reset_aborted_rank_monitors()  # idempotent
    monitor = _aborted_monitor(cycle=1)
    with pytest.raises(AssertionError, match="ABORTED"):
        monitor.state_machine.handle_heartbeat_msg()  # what NVRx alone does: refused for ever
    _announce(monitor, cycle=2)
    assert monitor.current_cycle == 2
    monitor.state_machine.handle_heartbeat_msg()  # the new worker's first heartbeat is taken
    assert monitor.state_machine.state == RankMonitorState.INITIALIZE


def test_the_same_cycle_announced_again_does_not_clear_an_abort() -> None:
    reset_aborted_rank_monitors()
    monitor = _aborted_monitor(cycle=3)
    _announce(monitor, cycle=3)
    assert monitor.state_machine.state == RankMonitorState.ABORTED
