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

**A short exit barrier, for jobs with warm spares** (`--rtj-exit-barrier-timeout=30`). When every
worker of a launcher has finished, torchelastic's agent waits in an exit barrier for every other
launcher of the rendezvous round (`exit_barrier_timeout`, 300 s, not a command-line flag). After a
spare took over a lost pod inside the running processes, the lost pod's launcher never arrives
there, so every surviving pod would stay Running five minutes after the job finished. The barrier
only keeps a store-hosting launcher alive for the others; our store lives in the rendezvous pod
(nvrx-control), so a short wait loses nothing.

**The pod's liveness endpoint.** The shim also serves `GET /ranks` on
RTJ_METRICS_HOST:(RTJ_METRICS_PORT - 1): every local rank's heartbeat, step and counters in one
small JSON document (rtj_trainer.podmetrics), so the operator reads one endpoint per pod, not
one per rank.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from . import podmetrics, termination

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
    """(global rank, exit code) of the failed workers whose code is in `codes`."""
    found = []
    for rank, failure in sorted((failures or {}).items()):
        code = getattr(failure, "exitcode", None)
        if isinstance(code, int) and code in codes:
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


def install(options: ShimOptions) -> None:
    """Patch ft_launcher's agent in this process (before `launcher.main()` runs)."""
    from nvidia_resiliency_ext.fault_tolerance import ft_rendezvous_barrier, launcher
    from torch.distributed.elastic.agent.server.api import WorkerState

    agent = launcher.LocalElasticAgent
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
    if not options.non_retryable:
        return
    original_monitor = agent._monitor_workers

    def _monitor_workers(self: Any, worker_group: Any) -> Any:
        result = original_monitor(self, worker_group)
        if result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY):
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


def main(argv: Sequence[str] | None = None) -> int:
    options, rest = split_argv(sys.argv[1:] if argv is None else argv)
    podmetrics.start_from_environment(os.environ, rest)
    install(options)
    from nvidia_resiliency_ext.fault_tolerance import launcher

    sys.argv = ["ft_launcher", *rest]
    launcher.main()  # exits with ft_launcher's own exit code
    return 0


if __name__ == "__main__":
    sys.exit(main())
