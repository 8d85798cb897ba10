"""The launcher shim's patches of NVRx (rtj_trainer.nvrx.launcher): the rank monitor and the
rendezvous barrier's poll for the next round."""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from nvidia_resiliency_ext.fault_tolerance.data import UpdateConfigMsg
from nvidia_resiliency_ext.fault_tolerance.rank_monitor_server import RankMonitorServer
from nvidia_resiliency_ext.fault_tolerance.rank_monitor_state_machine import (
    RankMonitorState,
    RankMonitorStateMachine,
)
from rtj_trainer.nvrx import launcher as nvrx_launcher
from rtj_trainer.nvrx.launcher import reset_aborted_rank_monitors

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


# --- stops: the local workers finish a peer's stop; a lost store stops them with a checkpoint ---


def test_the_workers_finish_a_peer_stop_while_every_exited_one_exited_95() -> None:
    from rtj_trainer.nvrx.launcher import peer_stop_under_way

    assert peer_stop_under_way([95, None])  # one left, the other still leaving the wrapper
    assert peer_stop_under_way([None, 95, 95, None])
    assert not peer_stop_under_way([95, 95])  # all done: ft_launcher restarts them now
    assert not peer_stop_under_way([None, None])  # nothing ended
    assert not peer_stop_under_way([95, 1, None])  # a real failure among them: no waiting
    assert not peer_stop_under_way([-9, None])
    assert not peer_stop_under_way([])


def test_a_broken_store_connection_counts_as_a_lost_store_wherever_it_is_in_the_chain() -> None:
    import torch.distributed as dist
    from rtj_trainer.nvrx.launcher import lost_the_store
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    assert lost_the_store(dist.DistNetworkError("Connection reset by peer"))
    assert lost_the_store(dist.DistStoreError("timeout"))
    assert lost_the_store(RendezvousConnectionError("the store is gone"))
    wrapped = RuntimeError("the agent failed")
    wrapped.__cause__ = dist.DistNetworkError("Broken pipe")
    assert lost_the_store(wrapped)
    assert not lost_the_store(None)
    assert not lost_the_store(RuntimeError("something else"))
    assert not lost_the_store(SignalException("got signal: 15", 15))  # type: ignore[arg-type]


def test_sigterm_is_ignored_only_inside_the_wait_for_a_stop() -> None:
    import signal

    from rtj_trainer.nvrx.launcher import sigterm_ignored

    before = signal.getsignal(signal.SIGTERM)
    with sigterm_ignored():
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    assert signal.getsignal(signal.SIGTERM) == before


class FakeStore:
    """The two calls of a c10d store the refunds use."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}

    def set(self, key: str, value: bytes) -> None:
        self.keys[key] = value

    def check(self, keys: list[str]) -> bool:
        return all(key in self.keys for key in keys)


def launcher_at_round(store: FakeStore, round_: int) -> SimpleNamespace:
    barrier = SimpleNamespace(store=store, prefix="ft_rendezvous_barrier:job")
    handler = SimpleNamespace(_barrier_state=barrier, round=lambda: round_)
    return SimpleNamespace(_rdzv_handler=handler)


def test_a_round_opened_for_a_peers_stop_is_marked_for_every_launcher_to_see() -> None:
    from rtj_trainer.nvrx.launcher import is_peer_stop_round, mark_peer_stop_round

    store = FakeStore()
    first = launcher_at_round(store, 3)  # three rounds done: it is about to open round 3
    mark_peer_stop_round(first)
    assert store.keys == {"ft_rendezvous_barrier:job:rtj_peer_stop_round_3": b"1"}
    other = launcher_at_round(store, 3)  # another survivor, seeing round 3 opened
    assert is_peer_stop_round(other, 3) and not is_peer_stop_round(other, 2)


def test_a_launcher_that_starts_later_adds_back_every_round_opened_for_a_peers_stop() -> None:
    from rtj_trainer.nvrx.launcher import mark_peer_stop_round, peer_stop_rounds_so_far

    store = FakeStore()
    for round_ in (1, 4):  # two evictions; rounds 2 and 3 were faults
        mark_peer_stop_round(launcher_at_round(store, round_))
    assert peer_stop_rounds_so_far(launcher_at_round(store, 4)) == 2  # joining round 4
    assert peer_stop_rounds_so_far(launcher_at_round(store, 3)) == 1
    assert peer_stop_rounds_so_far(launcher_at_round(store, 0)) == 0  # a fresh job


def test_without_the_barrier_rendezvous_nothing_is_marked_or_refunded() -> None:
    from rtj_trainer.nvrx.launcher import (
        is_peer_stop_round,
        mark_peer_stop_round,
        peer_stop_rounds_so_far,
    )

    other = SimpleNamespace(_rdzv_handler=SimpleNamespace(round=lambda: 2))
    mark_peer_stop_round(other)
    assert not is_peer_stop_round(other, 2) and peer_stop_rounds_so_far(other) == 0


def test_the_shim_refunds_a_restart_into_a_peer_stop_round_and_only_that_one() -> None:
    """The patched agent methods, on a stand-in agent: the restart decision of a round marked
    for a peer's stop leaves the restarts left unchanged; a fault's decision spends one."""
    from rtj_trainer.nvrx.launcher import _install_peer_stop_refunds, mark_peer_stop_round

    class Agent:
        def _handle_restart_decision(self, role: str, spec: object, log_msg: str,
                                     open_rendezvous: bool = False) -> bool:
            self._remaining_restarts -= 1  # what ft_launcher does before restarting
            return True

        def _invoke_run(self, role: str = "default") -> int:
            return int(self._remaining_restarts)

    _install_peer_stop_refunds(Agent)  # in production: NVRx's LocalElasticAgent
    store = FakeStore()
    agent: Any = Agent()
    agent._rdzv_handler = launcher_at_round(store, 1)._rdzv_handler
    agent._remaining_restarts = 5
    mark_peer_stop_round(agent)
    assert agent._handle_restart_decision("default", None, "restart") is True
    assert agent._remaining_restarts == 5  # the eviction's round cost nothing
    agent._rdzv_handler = launcher_at_round(store, 2)._rdzv_handler  # a fault's round
    assert agent._handle_restart_decision("default", None, "restart") is True
    assert agent._remaining_restarts == 4
    late: Any = Agent()  # a replaced pod's launcher: `run` set 5 - 2 rounds done
    late._rdzv_handler = launcher_at_round(store, 2)._rdzv_handler
    late._remaining_restarts = 3
    assert late._invoke_run() == 4  # the same count as the survivors'


def test_a_restart_window_gives_each_restart_back_after_the_window() -> None:
    from rtj_trainer.nvrx.launcher import RestartWindow

    now = [0.0]
    window = RestartWindow(100.0, clock=lambda: now[0])
    window.begin(2)  # two rounds before this launcher started: spent "now"
    now[0] = 50.0
    window.spend()
    assert window.given_back() == 0 and window.in_window == 3
    now[0] = 100.5
    assert window.given_back() == 2 and window.in_window == 1
    now[0] = 150.5
    assert window.given_back() == 1 and window.given_back() == 0


class BudgetAgent:
    """Stands in for ft_launcher's agent: `_handle_restart_decision` spends one of the restarts
    left or refuses (NVRx 0.7.0); `run` sets the restarts left from the job's rounds so far."""

    def __init__(self, max_restarts: int, rounds_so_far: int) -> None:
        self._worker_group = SimpleNamespace(spec=SimpleNamespace(max_restarts=max_restarts))
        self._remaining_restarts = max_restarts - rounds_so_far
        self._rdzv_handler = launcher_at_round(FakeStore(), rounds_so_far)._rdzv_handler

    def _handle_restart_decision(self, role: str, spec: object, log_msg: str,
                                 open_rendezvous: bool = False) -> bool:
        if self._remaining_restarts > 0:
            self._remaining_restarts -= 1
            return True
        return False

    def _invoke_run(self, role: str = "default") -> int:
        return int(self._remaining_restarts)


@pytest.mark.parametrize("window", [None, 100.0])
def test_max_restarts_counts_in_the_window_not_over_the_jobs_life(
        window: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two restarts allowed: a third fault soon after is refused either way; one that comes after
    the window is refused by NVRx's lifetime count and taken with the window. A launcher that
    joins later counts the job's earlier rounds as spent at its start."""
    from rtj_trainer.nvrx import launcher as nvrx_launcher

    now = [0.0]
    monkeypatch.setattr(nvrx_launcher.time, "monotonic", lambda: now[0])

    class Agent(BudgetAgent):
        pass

    nvrx_launcher._install_peer_stop_refunds(Agent, window)
    agent: Any = Agent(max_restarts=2, rounds_so_far=0)
    agent._invoke_run()
    for at in (0.0, 10.0):
        now[0] = at
        assert agent._handle_restart_decision("default", None, "restart") is True
    now[0] = 50.0
    assert agent._handle_restart_decision("default", None, "restart") is False
    now[0] = 105.0  # the restart of t=0 is out of the window
    assert agent._handle_restart_decision("default", None, "restart") is (window is not None)
    late: Any = Agent(max_restarts=2, rounds_so_far=2)  # a replaced pod's launcher, at t=105
    late._invoke_run()
    now[0] = 150.0
    assert late._handle_restart_decision("default", None, "restart") is False
    now[0] = 206.0
    assert late._handle_restart_decision("default", None, "restart") is (window is not None)


def test_the_wait_for_the_next_rendezvous_round_polls_five_times_a_second(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import inspect
    import time

    from nvidia_resiliency_ext.fault_tolerance import ft_rendezvous_barrier
    from rtj_trainer.nvrx import launcher as ftlaunch

    # The two polls the patch is for are NVRx's only 1 s sleeps in that module.
    source = inspect.getsource(ft_rendezvous_barrier)
    assert source.count("time.sleep(1.0)") == 2
    monkeypatch.setattr(ft_rendezvous_barrier, "time", time)
    ftlaunch.poll_rendezvous_rounds_faster()
    ftlaunch.poll_rendezvous_rounds_faster()  # idempotent
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    ft_rendezvous_barrier.time.sleep(1.0)
    ft_rendezvous_barrier.time.sleep(0.1)
    assert slept == [ftlaunch.RENDEZVOUS_ROUND_POLL_SECONDS, 0.1] == [0.2, 0.1]
    assert ft_rendezvous_barrier.time.monotonic is time.monotonic


def _group(ignore_sigterm: bool) -> subprocess.Popen[bytes]:
    """A process in a process group of its own (as ft_launcher starts a worker)."""
    code = ("import signal, time\n"
            + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_sigterm else "")
            + "print('ready', flush=True)\ntime.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                            stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    proc.stdout.close()
    return proc


def test_leftover_worker_groups_are_waited_for_only_while_they_exist(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Patch 10: NVRx's stop of the workers' process groups slept a fixed 1 s between SIGTERM
    and SIGKILL even with the groups empty (1.01 s of every SIGKILL restart); ours does not wait
    for a group that is gone, lets one that ends on SIGTERM end, and SIGKILLs one that stays."""
    sleeps: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(nvrx_launcher.time, "sleep",
                        lambda seconds: (sleeps.append(seconds), real_sleep(seconds)))
    gone = _group(ignore_sigterm=False)
    gone.kill()
    gone.wait()
    nvrx_launcher.terminate_leftover_groups([gone.pid])
    assert sleeps == []  # nothing left: no wait at all
    zombie = _group(ignore_sigterm=False)  # dead, not reaped yet (as under a slow PID 1)
    zombie.kill()
    stat = Path(f"/proc/{zombie.pid}/stat")
    while stat.read_text().rsplit(")", 1)[1].split()[0] != "Z":
        time.sleep(0.01)
    sleeps.clear()
    nvrx_launcher.terminate_leftover_groups([zombie.pid])
    assert sleeps == []  # a zombie holds nothing: no wait either
    zombie.wait()

    polite, stubborn = _group(ignore_sigterm=False), _group(ignore_sigterm=True)
    nvrx_launcher.terminate_leftover_groups([polite.pid, stubborn.pid], grace=0.5)
    assert polite.wait(10) == -signal.SIGTERM
    assert stubborn.wait(10) == -signal.SIGKILL
    assert sum(sleeps) < 0.5 + 0.1  # the polls add up to the grace, not more
