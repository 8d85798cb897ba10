"""NVRx's ft_launcher as the launcher shim runs it (rtj_trainer.launcher): every patch of
`nvidia_resiliency_ext.fault_tolerance` and of torchelastic's agent underneath it.

Runs in the ft_launcher process of every trainer pod (and, through fork, in its rank monitor
processes). Each patch below is declared in `PATCHES` with the functions it was written against
(rtj_trainer.nvrx.guards); what the shim does with them is explained in rtj_trainer.launcher.

The patches, in short (NVRx 0.7.0 behaviour → what we need → cost measured):

1. `RankMonitorServer._handle_update_config_msg` (`reset_aborted_rank_monitors`): a rank
   monitor whose worker dropped its connection twice without a message in between is ABORTED
   for the launcher's life, so every later worker of that local rank fails ("Broken pipe"), cycle
   after cycle → start the monitor's state machine afresh when the launcher announces a new
   cycle. Upstream report: docs/nvrx.md, "Upstream reports", R1.
2. `ft_rendezvous_barrier.time` (`poll_rendezvous_rounds_faster`): a launcher restarting its
   workers polls for the next rendezvous round every 1 s (hard-coded) → 0.2 s; 1.01 s of every
   launcher restart measured on an H200. Upstream report R2.
3. `ft_rendezvous_barrier.RDZV_NO_RESTART_REASONS` (`install`): only NVRx's own reasons stop
   every launcher of a job → add ours, `STOP_REASON`, for worker exit codes that must not be
   retried.
4. `LocalElasticAgent._shutdown` (`install`): a launcher that got SIGTERM (its pod ends) or lost
   the store SIGTERMs its workers → first ask them to checkpoint and stop (`STOP_SIGNAL`).
5. `LocalElasticAgent.__init__` (`install`, with `exit_barrier_timeout`): the exit barrier waits
   300 s for launchers that a spare replaced and never come → a short barrier in jobs with spares.
6. `LocalElasticAgent._monitor_workers` (`install`): the workers of a peer's stop exit 95 one
   after the other and ft_launcher restarts the group at the first → let them finish; mark the
   round a peer's stop; stop the job on a non-retryable exit code; tell the shim when the group
   succeeded (before the exit barrier).
7. `LocalElasticAgent._handle_restart_decision` and `_invoke_run` (`_install_peer_stop_refunds`):
   a round opened for a peer's stop spends one of `--max-restarts` → give it back. And
   `--max-restarts` is a lifetime count of the job's rounds (a new launcher starts with
   `max_restarts - <rounds so far>`), so a long job ran out after ~13 faults however far apart →
   with `restart_window` (the operator passes its rank-restart window), each restart is given
   back that long after it was spent (`RestartWindow`; the rounds before this launcher started
   count as spent at its start).
8. The rank monitors' handlers of their worker's messages (rtj_trainer.nvrx.monitorstate): each
   monitor also writes its rank's state to a small file the shim reads for its pod endpoint.
9. `LocalElasticAgent._wait_for_gpu_memory_reclaim` (`install`, with `keeper_mb`): before
   restarting workers ft_launcher waits until each GPU uses at most `gpu_memory_tolerance_mb`,
   so the memory a device keeper holds (rtj_trainer.keeper) would hold every restart for the
   full 50 s timeout → the tolerance grows by what the keepers hold, for that wait.
10. `fault_tolerance.launcher.terminate_mp_processes` (`install`): after the worker processes
   are stopped, ft_launcher SIGTERMs the workers' process groups, sleeps a fixed 1 s, then
   SIGKILLs them, even when no process of those groups is left: 1.01 s of every SIGKILL restart
   (`failure_detected` to `worker_terminated`, measured on an H100 and an H200) → wait only while
   a group still has a live process, at most the same 1 s (rtj_trainer.nvrx.restart); zombies (a
   dead worker's writer and resource tracker, reparented to a PID 1 that reaps slowly) do not
   count.

Private attributes read here (guarded with the functions that define their meaning):
`_pcontext`, `_rdzv_handler`, `_rdzv_handler._barrier_state`, `_remaining_restarts`,
`_term_timeout`, `_stop_workers`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from rtj_wire.pod import CHECKPOINT_AND_STOP_SIGNAL as STOP_SIGNAL
from rtj_wire.pod import PEER_STOPPED_EXIT_CODE

from . import monitorstate
from .guards import Patch, Target, replace
from .restart import _allow_keepers_in_reclaim, terminate_leftover_groups

PEER_STOP_WAIT_SECONDS = 30.0
"""How long a launcher lets its other workers finish a stop after the first one exited 95."""
STOP_REASON = "trainer_non_retryable_exit"
"""What the rendezvous store records as the reason the job must not be restarted."""
RENDEZVOUS_ROUND_POLL_SECONDS = 0.2
"""How often a launcher that restarts its workers looks for the next rendezvous round to open
(NVRx 0.7.0: a hard-coded 1 s, a whole second on every launcher restart, measured 1.01 s on an
H200). Only launchers waiting for a round poll: at 1,000 nodes a few thousand small store reads a
second, for about a second."""
PEER_STOP_ROUND_KEY = "rtj_peer_stop_round_"
"""Suffix (after the rendezvous barrier's key prefix) of the store keys that mark the rounds
opened for a peer's stop."""

_FT = "nvidia_resiliency_ext.fault_tolerance"
_AGENT = f"{_FT}.launcher:LocalElasticAgent"
_ELASTIC = "torch.distributed.elastic.agent.server.api:SimpleElasticAgent"
PATCHES = (
    Patch("rank monitor reset on a new cycle",
          "an ABORTED rank monitor refuses every later worker of its local rank",
          (Target(f"{_FT}.rank_monitor_server:RankMonitorServer._handle_update_config_msg",
                  "bd8749b7b425e49a"),
           Target(f"{_FT}.rank_monitor_state_machine:RankMonitorStateMachine",
                  "d1843f6b3b3daa16"))),
    Patch("faster rendezvous round polls",
          "1 s polls for the next round cost a second of every launcher restart",
          (Target(f"{_FT}.ft_rendezvous_barrier:_RendezvousBarrierState._wait_for_rendezvous_open",
                  "c3666cd7b3f61508"),)),
    Patch("our no-restart reason",
          "only reasons in RDZV_NO_RESTART_REASONS stop every launcher of the job",
          (Target(f"{_FT}.ft_rendezvous_barrier:FtRendezvousBarrierHandler.no_restart_reason",
                  "77ed6b3fe8b1fcce"),
           Target(f"{_FT}.ft_rendezvous_barrier:FtRendezvousBarrierHandler.signal_no_restart",
                  "82ee897ce1bfa6c7"))),
    Patch("checkpoint before the launcher's shutdown",
          "a SIGTERM to the launcher SIGTERMs its workers, which then save nothing",
          (Target(f"{_AGENT}._shutdown", "8bbee17466996e92"),
           Target(f"{_AGENT}.__init__", "c67b44bfb8d7f260"))),
    Patch("peer stops finish, non-retryable codes stop the job",
          "ft_launcher restarts the group at the first worker that exits, whatever its code",
          (Target(f"{_AGENT}._monitor_workers", "219a518f9f2ad4e7"),)),
    Patch("a peer's stop spends no restart",
          "every rendezvous round spends one of --max-restarts, a peer's eviction too",
          (Target(f"{_AGENT}._handle_restart_decision", "7d8897079b5ab3dd"),
           Target(f"{_AGENT}._invoke_run", "a5b658f9a6ddfd0d"),
           Target(f"{_AGENT}._invoke_run_with_any_failed_policy", "c2fff9ca728b68c8"),
           Target(f"{_ELASTIC}.run", "1f0bf1529692b17f"))),
    Patch("the device keepers' memory is expected",
          "a restart waits until each GPU holds at most 512 MB, a keeper's buffer included",
          (Target(f"{_AGENT}._wait_for_gpu_memory_reclaim", "f83fb2622b2d5618"),)),
    Patch("leftover workers are waited for only while they exist",
          "a fixed 1 s between SIGTERM and SIGKILL of the workers' groups, even when empty",
          (Target(f"{_FT}.utils:terminate_mp_processes", "c98010f7a47ec556"),
           Target(f"{_AGENT}._shutdown", "8bbee17466996e92"))),
)
"""Digests: tests/unit/test_trainer_nvrx_guards.py prints the installed ones when they differ."""

log = logging.getLogger("rtj_trainer.launcher")



def non_retryable_failures(failures: Any, codes: frozenset[int]) -> list[tuple[int, int]]:
    """(global rank, exit code) of the failed workers whose code is in `codes`. A worker that
    checkpointed and stopped because a peer was asked to stop (`PEER_STOPPED_EXIT_CODE`) is
    never one: it must be restarted, whatever the job lists."""
    found = []
    for rank, failure in sorted((failures or {}).items()):
        code = getattr(failure, "exitcode", None)
        if isinstance(code, int) and code in codes and code != PEER_STOPPED_EXIT_CODE:
            found.append((int(rank), code))
    return found


def reset_aborted_rank_monitors() -> None:
    """Patch 1: a new cycle starts an ABORTED rank monitor afresh (see the module docstring). A
    new cycle means new worker processes; the monitors are forked from this process, so the
    patch reaches them (idempotent)."""
    from nvidia_resiliency_ext.fault_tolerance import rank_monitor_server
    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_state_machine import (
        RankMonitorState,
        RankMonitorStateMachine,
    )

    server = rank_monitor_server.RankMonitorServer
    original = server._handle_update_config_msg

    async def _handle_update_config_msg(self: Any, msg: Any, writer: Any,
                                        send_response: bool = True) -> None:
        cycle = getattr(msg, "current_cycle", None)
        if (cycle is not None and cycle != self.current_cycle
                and self.state_machine.state == RankMonitorState.ABORTED):
            self.logger.warning(f"cycle {cycle}: the rank monitor was aborted in cycle "
                                f"{self.current_cycle}; starting afresh for the new workers")
            self.state_machine = RankMonitorStateMachine(self.rmlogger)
        await original(self, msg, writer, send_response)

    replace(server, "_handle_update_config_msg", _handle_update_config_msg)


class _RoundPollTime:
    """`time` as NVRx's rendezvous barrier sees it: its two 1 s polls for the next round are
    shorter (its other sleeps, 0.1 s, are left alone)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(RENDEZVOUS_ROUND_POLL_SECONDS if seconds == 1.0 else seconds)


def poll_rendezvous_rounds_faster() -> None:
    """Patch 2: shorten NVRx's 1 s wait for the next rendezvous round (idempotent)."""
    from nvidia_resiliency_ext.fault_tolerance import ft_rendezvous_barrier

    if not isinstance(ft_rendezvous_barrier.time, _RoundPollTime):
        ft_rendezvous_barrier.time = _RoundPollTime()  # type: ignore[assignment]


def peer_stop_under_way(exit_codes: Sequence[int | None]) -> bool:
    """Whether the local workers are finishing a stop a peer was asked for: some exited, every
    one that exited exited with PEER_STOPPED_EXIT_CODE, and some still run (`exit_codes`: one
    per worker, None while it runs)."""
    ended = [code for code in exit_codes if code is not None]
    return (bool(ended) and len(ended) < len(exit_codes)
            and all(code == PEER_STOPPED_EXIT_CODE for code in ended))


def _barrier_store(agent: Any) -> tuple[Any, str] | None:
    """The rendezvous barrier's store and key prefix (NVRx 0.7.0's FtRendezvousBarrierHandler),
    or None with another rendezvous handler."""
    state = getattr(getattr(agent, "_rdzv_handler", None), "_barrier_state", None)
    if state is None or getattr(state, "store", None) is None:
        return None
    return state.store, str(state.prefix)


def _peer_stop_key(prefix: str, round_: int) -> str:
    return f"{prefix}:{PEER_STOP_ROUND_KEY}{round_}"


def mark_peer_stop_round(agent: Any) -> None:
    """Record in the store that the round this launcher is about to open (`round()`: the rounds
    completed so far) is opened for a peer's stop."""
    found = _barrier_store(agent)
    if found is not None:
        store, prefix = found
        store.set(_peer_stop_key(prefix, agent._rdzv_handler.round()), b"1")


def is_peer_stop_round(agent: Any, round_: int) -> bool:
    found = _barrier_store(agent)
    if found is None:
        return False
    store, prefix = found
    return bool(store.check([_peer_stop_key(prefix, round_)]))


def peer_stop_rounds_so_far(agent: Any) -> int:
    """How many of the rounds up to the current one were opened for a peer's stop (what a
    launcher that starts now adds back to the restarts left)."""
    return sum(1 for round_ in range(1, agent._rdzv_handler.round() + 1)
               if is_peer_stop_round(agent, round_))


def lost_the_store(error: BaseException | None) -> bool:
    """Whether the launcher ended because it lost the rendezvous store (its connection broke or
    timed out), rather than on a signal or its own decision."""
    from torch.distributed import DistError
    from torch.distributed.elastic.rendezvous.api import RendezvousConnectionError

    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, (DistError, RendezvousConnectionError)):
            return True
        error = error.__cause__ or error.__context__
        seen += 1
    return False


@contextlib.contextmanager
def sigterm_ignored() -> Iterator[None]:
    """SIGTERM does nothing inside (on the main thread; elsewhere this changes nothing): a second
    SIGTERM must not cut short a wait for a stop checkpoint (SIGKILL still ends it)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def ask_workers_to_stop(pcontext: Any, timeout: float,
                        stop_signal: signal.Signals = STOP_SIGNAL,
                        only: Collection[int] | None = None) -> float:
    """Send `stop_signal` to every live worker process (not its group) whose local rank is in
    `only` (None: every one) and wait up to `timeout` seconds for all of them to exit; returns
    the seconds left (all of `timeout` when none was asked)."""
    handlers = getattr(pcontext, "subprocess_handlers", None)
    if not handlers:
        return timeout
    began = time.monotonic()
    live = [h.proc for local_rank, h in handlers.items()
            if h.proc.poll() is None and (only is None or local_rank in only)]
    if not live:
        return timeout
    log.warning("asked to stop: %s to %d workers (checkpoint, then stop), at most %.0f s",
                signal.Signals(stop_signal).name, len(live), timeout)
    with sigterm_ignored():
        for proc in live:
            try:
                os.kill(proc.pid, stop_signal)
            except ProcessLookupError:
                pass
        for proc in live:
            left = timeout - (time.monotonic() - began)
            if left <= 0:
                break
            try:
                proc.wait(left)
            except subprocess.TimeoutExpired:  # ft_launcher's own shutdown follows
                break
    return max(0.0, timeout - (time.monotonic() - began))


def install(
    *,
    non_retryable: frozenset[int] = frozenset(),
    exit_barrier_timeout: float | None = None,
    restart_window: float | None = None,
    stop_signal: signal.Signals = STOP_SIGNAL,
    stoppable: Callable[[], Collection[int]] | None = None,
    on_finished: Callable[[], None] | None = None,
    on_non_retryable: Callable[[list[tuple[int, int]]], None] | None = None,
    keeper_mb: Callable[[], float] | None = None,
) -> None:
    """Patches 3-10 on ft_launcher's agent and rank monitors in this process (before `run`).

    `stop_signal` asks a worker to checkpoint, then stop, when the pod ends; it goes to the
    local ranks `stoppable()` names (None: every worker), and every other worker gets only
    ft_launcher's own SIGTERM (the torchrun convention). `on_finished` is called once the local
    worker group succeeded (every worker exited 0), before the exit barrier; `on_non_retryable`
    with the (rank, code) of workers that exited with a non-retryable code, before the launcher
    stops the job. `restart_window` (seconds): each of `--max-restarts` is given back that long
    after it was spent (None: a count over the job's life, as in NVRx). `keeper_mb()`: the GPU
    memory (MiB) the device keepers hold now, allowed for in the restart's reclaim wait."""
    from nvidia_resiliency_ext.fault_tolerance import ft_rendezvous_barrier, launcher
    from torch.distributed.elastic.multiprocessing.api import SignalException

    reset_aborted_rank_monitors()
    monitorstate.export_rank_monitor_state()
    poll_rendezvous_rounds_faster()
    agent = launcher.LocalElasticAgent
    if keeper_mb is not None:
        _allow_keepers_in_reclaim(agent, keeper_mb)
    replace(launcher, "terminate_mp_processes", terminate_leftover_groups)  # patch 10
    original_shutdown = agent._shutdown

    def _shutdown(self: Any, death_sig: signal.Signals = signal.SIGTERM,
                  timeout: int = 30) -> None:
        # Called inside ft_launcher's `except SignalException` when the launcher itself got a
        # signal (the pod is ending), from `run`'s `finally` when it failed otherwise (a lost
        # store: no signal), and without an exception when it stops workers to restart them.
        ending = sys.exception()
        only = stoppable() if stoppable is not None else None
        if self._pcontext is not None and isinstance(ending, SignalException):
            left = ask_workers_to_stop(self._pcontext, float(timeout), stop_signal, only)
            timeout = max(1, int(left))
        elif self._pcontext is not None and lost_the_store(ending):
            log.error("the launcher lost the rendezvous store (%s): its workers checkpoint "
                      "their current step before they stop", ending)
            left = ask_workers_to_stop(self._pcontext, float(self._term_timeout),
                                       stop_signal, only)
            timeout = max(1, int(left))
        original_shutdown(self, death_sig, timeout)

    replace(agent, "_shutdown", _shutdown)
    _install_peer_stop_refunds(agent, restart_window)
    if exit_barrier_timeout is not None:
        original_init = agent.__init__

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("exit_barrier_timeout", exit_barrier_timeout)
            original_init(self, *args, **kwargs)

        replace(agent, "__init__", __init__)
    # Peers accept the stop only for a reason in this set (no_restart_reason()).
    ft_rendezvous_barrier.RDZV_NO_RESTART_REASONS = frozenset(  # type: ignore[attr-defined]
        {*ft_rendezvous_barrier.RDZV_NO_RESTART_REASONS, STOP_REASON})
    _install_monitor(agent, launcher, non_retryable, on_finished, on_non_retryable)


def _install_monitor(agent: Any, launcher: Any, non_retryable: frozenset[int],
                     on_finished: Callable[[], None] | None,
                     on_non_retryable: Callable[[list[tuple[int, int]]], None] | None) -> None:
    """Patch 6 (see the module docstring and rtj_trainer.launcher)."""
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState

    original_monitor = agent._monitor_workers

    def _monitor_workers(self: Any, worker_group: Any) -> Any:
        # Before ft_launcher looks (its poll SIGTERMs every running worker once one failed):
        # the others are leaving a stop on their own ("Letting the local workers finish").
        handlers = getattr(self._pcontext, "subprocess_handlers", None) or {}
        if peer_stop_under_way([h.proc.poll() for h in handlers.values()]):
            since = getattr(self, "_rtj_peer_stop_since", None)
            if since is None:
                since = self._rtj_peer_stop_since = time.monotonic()
            if time.monotonic() - since < PEER_STOP_WAIT_SECONDS:
                return RunResult(state=WorkerState.HEALTHY)
        self._rtj_peer_stop_since = None
        result = original_monitor(self, worker_group)
        if result.state == WorkerState.SUCCEEDED and on_finished is not None:
            on_finished()  # the exit barrier follows: tell the operator the pod is done
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return result
        codes = [getattr(f, "exitcode", None) for f in (result.failures or {}).values()]
        if result.state == WorkerState.FAILED and codes and all(
                code == PEER_STOPPED_EXIT_CODE for code in codes):
            mark_peer_stop_round(self)  # before the restart decision opens the round
        failed = non_retryable_failures(result.failures, non_retryable) if non_retryable else []
        if not failed:
            return result
        message = ", ".join(f"rank {rank} exited with {code}" for rank, code in failed)
        log.error("a worker exited with a non-retryable code (%s): no restart for the job",
                  message)
        if on_non_retryable is not None:
            on_non_retryable(failed)
        self._rdzv_handler.signal_no_restart(STOP_REASON)
        self._stop_workers(worker_group)
        worker_group.state = WorkerState.FAILED
        raise launcher.NoRestartRequested(
            STOP_REASON, f"a worker exited with a non-retryable code ({message})")

    replace(agent, "_monitor_workers", _monitor_workers)


class RestartWindow:
    """The restarts a launcher spent, each given back `seconds` after it was spent: with it,
    `--max-restarts` bounds the restarts within a sliding window, as the operator's budgets do,
    instead of over the job's life."""

    def __init__(self, seconds: float, clock: Callable[[], float] | None = None) -> None:
        self.seconds = seconds
        self._clock = clock or time.monotonic
        self._spent: list[float] = []

    def begin(self, spent_before: int) -> None:
        """The launcher starts with `spent_before` restarts already counted (the job's rounds so
        far, whose times it does not know): each counts as spent now."""
        self._spent = [self._clock()] * max(0, spent_before)

    def given_back(self) -> int:
        """How many restarts fell out of the window since the last call (forgotten now)."""
        cutoff = self._clock() - self.seconds
        kept = [at for at in self._spent if at > cutoff]
        back = len(self._spent) - len(kept)
        self._spent = kept
        return back

    def spend(self) -> None:
        self._spent.append(self._clock())

    @property
    def in_window(self) -> int:
        return len(self._spent)


def _install_peer_stop_refunds(agent: Any, restart_window: float | None = None) -> None:
    """Patch 7: a restart into a round opened for a peer's stop spends nothing; with
    `restart_window`, a restart is given back that many seconds after it was spent."""
    original_decision = agent._handle_restart_decision
    original_invoke_run = agent._invoke_run

    def _handle_restart_decision(self: Any, role: str, spec: Any, log_msg: str,
                                 open_rendezvous: bool = False) -> bool:
        window: RestartWindow | None = getattr(self, "_rtj_restart_window", None)
        if window is not None:
            back = window.given_back()
            if back:
                self._remaining_restarts += back
                log.info("%d restart(s) older than %gs given back: %d left", back,
                         window.seconds, self._remaining_restarts)
        before = self._remaining_restarts
        if is_peer_stop_round(self, self._rdzv_handler.round()):
            self._remaining_restarts += 1
            log.warning("restarting the workers for a peer's stop (an eviction, not a fault): "
                        "no restart spent, %d left", self._remaining_restarts - 1)
        restarted: bool = original_decision(self, role, spec, log_msg, open_rendezvous)
        if window is not None and self._remaining_restarts < before:
            window.spend()
        return restarted

    def _invoke_run(self: Any, role: str = "default") -> Any:
        # `run` has just set the restarts left from the rounds done so far.
        refunded = peer_stop_rounds_so_far(self)
        if refunded:
            self._remaining_restarts += refunded
            log.info("%d round(s) so far were opened for a peer's stop: %d restarts left",
                     refunded, self._remaining_restarts)
        if restart_window is not None:
            window = RestartWindow(restart_window)
            window.begin(self._worker_group.spec.max_restarts - self._remaining_restarts)
            self._rtj_restart_window = window
        return original_invoke_run(self, role)

    replace(agent, "_handle_restart_decision", _handle_restart_decision)
    replace(agent, "_invoke_run", _invoke_run)


def run(launcher_args: Sequence[str]) -> None:
    """Run ft_launcher with these arguments in this process; exits with its exit code."""
    from nvidia_resiliency_ext.fault_tolerance import launcher

    sys.argv = ["ft_launcher", *launcher_args]
    launcher.main()
