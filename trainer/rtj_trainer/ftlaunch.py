"""`python -m rtj_trainer.ftlaunch [--rtj-...] <ft_launcher arguments>`: NVRx's ft_launcher (0.7.0)
with two additions. Every trainer pod runs it (and trainer/scripts/train-local.sh).

**Worker exit codes that must not be retried.** ft_launcher restarts its workers whatever code
they exited with: a worker cannot stop the restarts. With `--rtj-non-retryable-exit-codes=94,3`
(the operator passes `rtj_trainer.errors.FATAL_EXIT_CODE` and the job's
`faultTolerance.nonRetryableExitCodes`), a launcher whose worker exited with one of these codes
does what NVRx does for its own "do not restart" verdicts: it records the stop in the rendezvous
store and opens the next round (`signal_no_restart`), stops its workers and exits with
ft_launcher's no-restart code (`--ft-no-restart-exit-code`, 93); every other launcher of the job
sees the stop at its next poll and exits 93 as well. The reason string is added to NVRx's set of
no-restart reasons in each launcher process (they all run this shim). When no worker wrote the
pod's termination message (rtj_trainer.termination), the shim writes one naming the worker's
exit code, so the operator learns the worker's code, not only the launcher's 93.

**A short exit barrier, for jobs with warm spares** (`--rtj-exit-barrier-timeout=5`). When every
worker of a launcher has finished, torchelastic's agent waits in an exit barrier for every other
launcher of the rendezvous round (`exit_barrier_timeout`, 300 s, not a command-line flag). After a
spare took over a lost pod inside the running processes, the lost pod's launcher never arrives
there, so every surviving pod would stay Running five minutes after the job finished. The barrier
only keeps a store-hosting launcher alive for the others; our store lives in the rendezvous pod
(nvrx-control), so a short wait loses nothing.

**Checkpoint now, then stop, when the pod is ended** (always on). On SIGTERM (the kubelet ending
the pod: a suspend, preemption, deletion or drain) ft_launcher stops its workers with the same
signal and SIGKILLs them after `--term-timeout`. The shim sends them
`rtj_trainer.stop.STOP_SIGNAL` (SIGUSR2) instead, to each worker process only (not its process
group: the worker's checkpoint writer must outlive the signal), and waits up to `--term-timeout`
for them to commit a checkpoint of their current step and exit (rtj_trainer.stop); whatever is
left then gets ft_launcher's own SIGTERM and SIGKILL. A second SIGTERM meanwhile (the operator
deleting a pod that is already stopping) does not cut the wait short. The same happens when the
launcher loses the rendezvous store (its pod evicted, or lost): the launcher cannot go on, but
its workers are healthy and their process group needs no store, so they checkpoint their current
step first. Stopping workers to restart them after a fault is unchanged (SIGTERM: they die at
once).

**Letting the local workers finish a stop.** When another pod's workers were asked to stop, every
rank stops at the same step and this pod's workers exit with `PEER_STOPPED_EXIT_CODE` (95), one
after the other. ft_launcher would restart the worker group as soon as the first one exits and
SIGTERM the others while they leave NVRx's in-process wrapper, where rank 0 then waits for them
(its termination barrier) until its own pod is killed. So while every worker that has exited
exited 95 and others still run, the shim reports the group healthy for up to
`PEER_STOP_WAIT_SECONDS`, and the others exit by themselves first.

**A peer's stop spends no launcher restart.** ft_launcher's `--max-restarts` counts rendezvous
rounds, job-wide: each launcher restarts its workers at most that many times, and a launcher
that starts later (a replaced pod) starts with `--max-restarts` minus the rounds already done.
A round opened because another pod was evicted (every local worker exited 95) is not a fault:
the launcher that first sees it marks the round in the rendezvous store before it opens it
(`mark_peer_stop_round`), every launcher that restarts into that round gets the restart back,
and a launcher starting later adds back the rounds marked so far, so every launcher keeps the
same count. Only a worker group that stopped entirely with 95 marks a round: a real failure
among them spends the restart as before.

**Warm workers** (`RTJ_WARM_WORKERS=1`; the operator sets it from `faultTolerance.warmWorkers`).
Before anything heavy is imported here, the shim starts a pool of pre-imported worker processes
(rtj_trainer.warmpool) and turns the worker command `<python> -m rtj_trainer ...` into the attach
client `<python> -m rtj_trainer.attach ...`, which hands each worker over to one of them
(docs/trainer.md, "Warm workers"). ft_launcher still starts, signals and waits for the client.

**The pod's liveness endpoint.** The shim also serves `GET /ranks` on
RTJ_METRICS_HOST:(RTJ_METRICS_PORT - 1): every local rank's heartbeat, step and counters in one
small JSON document (rtj_trainer.podmetrics), so the operator reads one endpoint per pod, not
one per rank. On the same port it takes the operator's verdicts on lost peer pods (`POST
/lost-pods`) and keeps them in a pod-local file (RTJ_LOST_PODS_FILE, exported to its workers),
from which the workers tell NVRx's in-process wrapper at once (rtj_trainer.podloss). When every
local worker exited 0 the shim marks the pod finished there (`"finished": true`), before the
launcher enters the exit barrier: its ranks' heartbeats stop because training is done, and the
operator must not take the barrier's wait for a hang.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import podloss, podmetrics, termination, warmpool, warmwire
from .stop import PEER_STOPPED_EXIT_CODE, STOP_SIGNAL

PEER_STOP_WAIT_SECONDS = 30.0
"""How long a launcher lets its other workers finish a stop after the first one exited 95."""
STOP_REASON = "trainer_non_retryable_exit"
"""What the rendezvous store records as the reason the job must not be restarted."""
NON_RETRYABLE_FLAG = "--rtj-non-retryable-exit-codes="
EXIT_BARRIER_FLAG = "--rtj-exit-barrier-timeout="

log = logging.getLogger("rtj_trainer.ftlaunch")


@dataclass(frozen=True, slots=True)
class ShimOptions:
    non_retryable: frozenset[int] = field(default_factory=frozenset)
    exit_barrier_timeout: float | None = None


def split_argv(argv: Sequence[str]) -> tuple[ShimOptions, list[str]]:
    """The shim's own leading `--rtj-*` flags, and ft_launcher's arguments after them."""
    codes: set[int] = set()
    barrier: float | None = None
    rest = list(argv)
    while rest and rest[0].startswith("--rtj-"):
        flag = rest.pop(0)
        if flag.startswith(NON_RETRYABLE_FLAG):
            value = flag.removeprefix(NON_RETRYABLE_FLAG)
            try:
                codes.update(int(code) for code in value.split(",") if code.strip())
            except ValueError:
                raise SystemExit(f"ftlaunch: {flag}: expected comma-separated integers") from None
        elif flag.startswith(EXIT_BARRIER_FLAG):
            try:
                barrier = float(flag.removeprefix(EXIT_BARRIER_FLAG))
            except ValueError:
                raise SystemExit(f"ftlaunch: {flag}: expected seconds") from None
        else:
            raise SystemExit(f"ftlaunch: unknown option {flag}")
    return ShimOptions(frozenset(codes), barrier), rest


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


def _record_termination(failed: list[tuple[int, int]]) -> None:
    """Write the pod's termination message unless a worker already did."""
    path = termination.configured_path()
    if path is None or termination.is_written(path):
        return
    rank, code = failed[0]
    try:
        termination.write(path, termination.TerminationMessage(
            outcome=termination.FAILED, reason="NonRetryableExitCode",
            message=f"worker rank {rank} exited with code {code}, which is not retryable",
            exit_code=code,
        ))
    except OSError as exc:
        log.error("cannot write the termination message %s: %s", path, exc)


def reset_aborted_rank_monitors() -> None:
    """A rank monitor that saw its rank's connection drop twice without a message in between
    (a worker that exited while restarting in-process) is ABORTED for good in NVRx 0.7.0, and
    ft_launcher keeps its rank monitors for the launcher's life: every later worker of that local
    rank then has its heartbeats refused ("Broken pipe") and fails, cycle after cycle. A new
    cycle means new worker processes, so the monitor starts afresh when the launcher announces
    one. (The monitors are forked from this process: the patch reaches them.)"""
    from nvidia_resiliency_ext.fault_tolerance import rank_monitor_server
    from nvidia_resiliency_ext.fault_tolerance.rank_monitor_state_machine import (
        RankMonitorState,
        RankMonitorStateMachine,
    )

    server = rank_monitor_server.RankMonitorServer
    original = server._handle_update_config_msg
    if getattr(original, "_rtj_patched", False):
        return

    async def _handle_update_config_msg(self: Any, msg: Any, writer: Any,
                                        send_response: bool = True) -> None:
        cycle = getattr(msg, "current_cycle", None)
        if (cycle is not None and cycle != self.current_cycle
                and self.state_machine.state == RankMonitorState.ABORTED):
            self.logger.warning(f"cycle {cycle}: the rank monitor was aborted in cycle "
                                f"{self.current_cycle}; starting afresh for the new workers")
            self.state_machine = RankMonitorStateMachine(self.rmlogger)
        await original(self, msg, writer, send_response)

    _handle_update_config_msg._rtj_patched = True  # type: ignore[attr-defined]
    server._handle_update_config_msg = _handle_update_config_msg  # type: ignore[method-assign]


RENDEZVOUS_ROUND_POLL_SECONDS = 0.2
"""How often a launcher that restarts its workers looks for the next rendezvous round to open
(NVRx 0.7.0: a hard-coded 1 s, a whole second on every launcher restart, measured 1.01 s on an
H200). Only launchers waiting for a round poll: at 1,000 nodes a few thousand small store reads a
second, for about a second."""


class _RoundPollTime:
    """`time` as NVRx's rendezvous barrier sees it: its two 1 s polls for the next round are
    shorter (its other sleeps, 0.1 s, are left alone)."""

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)

    @staticmethod
    def sleep(seconds: float) -> None:
        time.sleep(RENDEZVOUS_ROUND_POLL_SECONDS if seconds == 1.0 else seconds)


def poll_rendezvous_rounds_faster() -> None:
    """Shorten NVRx's 1 s wait for the next rendezvous round (idempotent)."""
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


PEER_STOP_ROUND_KEY = "rtj_peer_stop_round_"
"""Suffix (after the rendezvous barrier's key prefix) of the store keys that mark the rounds
opened for a peer's stop."""


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


def ask_workers_to_stop(pcontext: Any, timeout: float) -> float:
    """Send STOP_SIGNAL to every live worker process (not its group) and wait up to `timeout`
    seconds for all of them to exit; returns the seconds left."""
    handlers = getattr(pcontext, "subprocess_handlers", None)
    if not handlers:
        return timeout
    began = time.monotonic()
    live = [h.proc for h in handlers.values() if h.proc.poll() is None]
    log.warning("asked to stop: %s to %d workers (checkpoint, then stop), at most %.0f s",
                signal.Signals(STOP_SIGNAL).name, len(live), timeout)
    with sigterm_ignored():
        for proc in live:
            try:
                os.kill(proc.pid, STOP_SIGNAL)
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


def install(options: ShimOptions, on_finished: Callable[[], None] | None = None) -> None:
    """Patch ft_launcher's agent in this process (before `launcher.main()` runs). `on_finished`
    is called once the local worker group succeeded (every worker exited 0), before the exit
    barrier."""
    from nvidia_resiliency_ext.fault_tolerance import ft_rendezvous_barrier, launcher
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.multiprocessing.api import SignalException

    reset_aborted_rank_monitors()
    poll_rendezvous_rounds_faster()

    agent = launcher.LocalElasticAgent
    original_shutdown = agent._shutdown

    def _shutdown(self: Any, death_sig: signal.Signals = signal.SIGTERM,
                  timeout: int = 30) -> None:
        # Called inside ft_launcher's `except SignalException` when the launcher itself got a
        # signal (the pod is ending), from `run`'s `finally` when it failed otherwise (a lost
        # store: no signal), and without an exception when it stops workers to restart them.
        ending = sys.exception()
        if self._pcontext is not None and isinstance(ending, SignalException):
            left = ask_workers_to_stop(self._pcontext, float(timeout))
            timeout = max(1, int(left))
        elif self._pcontext is not None and lost_the_store(ending):
            log.error("the launcher lost the rendezvous store (%s): its workers checkpoint "
                      "their current step before they stop", ending)
            left = ask_workers_to_stop(self._pcontext, float(self._term_timeout))
            timeout = max(1, int(left))
        original_shutdown(self, death_sig, timeout)

    agent._shutdown = _shutdown  # type: ignore[method-assign]
    _install_peer_stop_refunds(agent)
    if options.exit_barrier_timeout is not None:
        original_init = agent.__init__
        timeout = options.exit_barrier_timeout

        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("exit_barrier_timeout", timeout)
            original_init(self, *args, **kwargs)

        agent.__init__ = __init__  # type: ignore[method-assign]

    # Peers accept the stop only for a reason in this set (no_restart_reason()).
    ft_rendezvous_barrier.RDZV_NO_RESTART_REASONS = frozenset(  # type: ignore[attr-defined]
        {*ft_rendezvous_barrier.RDZV_NO_RESTART_REASONS, STOP_REASON})
    original_monitor = agent._monitor_workers

    def _monitor_workers(self: Any, worker_group: Any) -> Any:
        # Before ft_launcher looks (its poll SIGTERMs every running worker once one failed):
        # the others are leaving a stop on their own (see "Letting the local workers finish").
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
        if not options.non_retryable:
            return result
        failed = non_retryable_failures(result.failures, options.non_retryable)
        if not failed:
            return result
        message = ", ".join(f"rank {rank} exited with {code}" for rank, code in failed)
        log.error("a worker exited with a non-retryable code (%s): no restart for the job",
                  message)
        _record_termination(failed)
        self._rdzv_handler.signal_no_restart(STOP_REASON)
        self._stop_workers(worker_group)
        worker_group.state = WorkerState.FAILED
        raise launcher.NoRestartRequested(
            STOP_REASON, f"a worker exited with a non-retryable code ({message})")

    agent._monitor_workers = _monitor_workers  # type: ignore[method-assign]


def _install_peer_stop_refunds(agent: Any) -> None:
    """A restart into a round opened for a peer's stop spends nothing (see the docstring)."""
    original_decision = agent._handle_restart_decision
    original_invoke_run = agent._invoke_run

    def _handle_restart_decision(self: Any, role: str, spec: Any, log_msg: str,
                                 open_rendezvous: bool = False) -> bool:
        if is_peer_stop_round(self, self._rdzv_handler.round()):
            self._remaining_restarts += 1
            log.warning("restarting the workers for a peer's stop (an eviction, not a fault): "
                        "no restart spent, %d left", self._remaining_restarts - 1)
        restarted: bool = original_decision(self, role, spec, log_msg, open_rendezvous)
        return restarted

    def _invoke_run(self: Any, role: str = "default") -> Any:
        # `run` has just set the restarts left from the rounds done so far.
        refunded = peer_stop_rounds_so_far(self)
        if refunded:
            self._remaining_restarts += refunded
            log.info("%d round(s) so far were opened for a peer's stop: %d restarts left",
                     refunded, self._remaining_restarts)
        return original_invoke_run(self, role)

    agent._handle_restart_decision = _handle_restart_decision
    agent._invoke_run = _invoke_run


def start_warm_workers(launcher_args: list[str]) -> list[str]:
    """With `RTJ_WARM_WORKERS=1`: start the pool of warm workers (rtj_trainer.warmpool) and
    return ft_launcher's arguments with the worker command turned into the attach client; else
    (or when the worker command is not `<python> -m rtj_trainer`) the arguments unchanged."""
    if not warmpool.switched_on(os.environ):
        return launcher_args
    rewritten = warmwire.attach_argv(launcher_args)
    if rewritten is None:
        log.warning("%s=1 but the worker command is not `<python> -m %s`: no warm workers",
                    warmwire.SWITCH_ENV, warmwire.WORKER_MODULE)
        return launcher_args
    args, python = rewritten
    pool = warmpool.WarmPool(shutil.which(python) or python, warmpool.pool_size(launcher_args))
    os.environ[warmwire.POOL_DIR_ENV] = pool.directory  # torchelastic passes it to the workers
    atexit.register(pool.close)
    pool.start()
    log.warning("warm workers: a pool of %d in %s", pool.size, pool.directory)
    return args


def verdict_book(env: MutableMapping[str, str]) -> podloss.VerdictBook:
    """The shim's book of the operator's verdicts on lost pods, at RTJ_LOST_PODS_FILE or a new
    pod-local file; the variable is set in `env` so that the workers find the file."""
    path = Path(env.get(podloss.FILE_ENV) or podloss.default_file())
    env[podloss.FILE_ENV] = str(path)
    return podloss.VerdictBook(path, own_uid=env.get("POD_UID", ""))


def main(argv: Sequence[str] | None = None) -> int:
    options, rest = split_argv(sys.argv[1:] if argv is None else argv)
    pod = podmetrics.start_from_environment(os.environ, rest, verdict_book(os.environ))
    rest = start_warm_workers(rest)  # first: their imports overlap the launcher's own
    install(options, pod.mark_finished if pod is not None else None)
    from nvidia_resiliency_ext.fault_tolerance import launcher

    sys.argv = ["ft_launcher", *rest]
    launcher.main()  # exits with ft_launcher's own exit code
    return 0


if __name__ == "__main__":
    sys.exit(main())
