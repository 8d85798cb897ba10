"""`python -m rtj_trainer.launcher [--rtj-...] <ft_launcher arguments>`: NVRx's ft_launcher (0.7.0)
with the additions below (the NVRx patches that make them: rtj_trainer.nvrx.launcher). Every trainer
pod runs it (and trainer/scripts/train-local.sh).

**Restarts counted in a window.** NVRx's `--max-restarts` counts the job's rendezvous rounds over
its whole life (a launcher starts with `max_restarts - <rounds so far>`), so a long job fails
after a fixed number of faults however far apart they are. With `--rtj-restart-window=SECONDS`
(the operator passes `rankRestartBudget.windowSeconds`) each restart is given back that long after
it was spent (rtj_trainer.nvrx.launcher, patch 7; rounds before the launcher started count as spent
at its start).

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

**Checkpoint now, then stop, when the pod is ended** (for workers that ask for it). On SIGTERM (the
kubelet ending the pod: a suspend, preemption, deletion or drain) ft_launcher stops its workers with
the same signal and SIGKILLs them after `--term-timeout`: the torchrun convention, which every
worker gets by default. A worker that handles the checkpoint-and-stop signal says so when it starts
(`rtj_trainer.stop.register`: the trainer, and a script using the trainer's library); to those the
shim sends `rtj_wire.pod.CHECKPOINT_AND_STOP_SIGNAL` (SIGUSR2) first, to each worker process only
(not its process group: the worker's checkpoint writer must outlive the signal), and waits up to
`--term-timeout` for them to commit a checkpoint of their current step and exit (rtj_trainer.stop);
whatever is left then gets ft_launcher's own SIGTERM and SIGKILL. The shim tells its workers that
timeout (`stop.TERM_TIMEOUT_ENV`), so that a stop never waits for its checkpoint longer than it
may live (a peer killed before it wrote its shard: rtj_trainer.stop). A second SIGTERM meanwhile
(the operator deleting a pod that is already stopping) does not cut the wait short. The same
happens when the launcher loses the rendezvous store (its pod evicted, or lost): the launcher
cannot go on, but its workers are healthy and their process group needs no store, so they
checkpoint their current step first. Stopping workers to restart them after a fault is
unchanged (SIGTERM: they die at once).

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
(rtj_trainer.launcher.warmpool) and turns the worker command `<python> -m rtj_trainer ...` into the
attach client `<python> -m rtj_trainer.warm.attach ...`, which hands each worker over to one of them
(docs/trainer.md, "Warm workers"). ft_launcher still starts, signals and waits for the client.

**Device keepers** (`RTJ_DEVICE_KEEPER=1`). The shim starts one keeper process per local rank
(rtj_trainer.keeper): it holds the node-local snapshots' buffer in device memory, so a worker
killed on the node leaves its last snapshot on the GPU for the next one (docs/trainer.md,
"Device keepers"). ft_launcher's wait for a dead worker's GPU memory allows for what the keepers
hold (rtj_trainer.nvrx.launcher, patch 9).

**The pod's liveness endpoint.** The shim also serves `GET /ranks` on
RTJ_METRICS_HOST:(RTJ_METRICS_PORT - 1): every local rank's heartbeat, step and counters in one
small JSON document (rtj_trainer.launcher.podmetrics), so the operator reads one endpoint per pod,
not one per rank. A rank that serves no metrics page but sends NVRx heartbeats (a team's own script)
is listed from what its rank monitor received (rtj_trainer.nvrx.launcher, patch 8). On the same port
it takes the operator's verdicts on lost peer pods (`POST /lost-pods`) and keeps them in a pod-local
file (RTJ_LOST_PODS_FILE, exported to its workers), from which the workers tell NVRx's in-process
wrapper at once (rtj_trainer.podloss). When every local worker exited 0 the shim marks the pod
finished there (`"finished": true`), before the launcher enters the exit barrier: its ranks'
heartbeats stop because training is done, and the operator must not take the barrier's wait for a
hang.
"""


from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, MutableMapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from rtj_wire import env as wire_env

from .. import keeper, stop, termination
from ..nvrx import launcher as nvrx_launcher
from ..nvrx import monitorstate
from ..warm import device as warm_device
from ..warm import wire as warmwire
from . import podmetrics, verdicts, warmpool

NON_RETRYABLE_FLAG = "--rtj-non-retryable-exit-codes="
EXIT_BARRIER_FLAG = "--rtj-exit-barrier-timeout="
RESTART_WINDOW_FLAG = "--rtj-restart-window="

log = logging.getLogger("rtj_trainer.launcher")


@dataclass(frozen=True, slots=True)
class ShimOptions:
    non_retryable: frozenset[int] = field(default_factory=frozenset)
    exit_barrier_timeout: float | None = None
    restart_window: float | None = None


def _seconds(flag: str, prefix: str) -> float:
    try:
        return float(flag.removeprefix(prefix))
    except ValueError:
        raise SystemExit(f"launcher: {flag}: expected seconds") from None


def split_argv(argv: Sequence[str]) -> tuple[ShimOptions, list[str]]:
    """The shim's own leading `--rtj-*` flags, and ft_launcher's arguments after them."""
    codes: set[int] = set()
    barrier: float | None = None
    window: float | None = None
    rest = list(argv)
    while rest and rest[0].startswith("--rtj-"):
        flag = rest.pop(0)
        if flag.startswith(NON_RETRYABLE_FLAG):
            value = flag.removeprefix(NON_RETRYABLE_FLAG)
            try:
                codes.update(int(code) for code in value.split(",") if code.strip())
            except ValueError:
                raise SystemExit(f"launcher: {flag}: expected comma-separated integers") from None
        elif flag.startswith(EXIT_BARRIER_FLAG):
            barrier = _seconds(flag, EXIT_BARRIER_FLAG)
        elif flag.startswith(RESTART_WINDOW_FLAG):
            window = _seconds(flag, RESTART_WINDOW_FLAG)
            if not window > 0:
                raise SystemExit(f"launcher: {flag}: expected seconds > 0")
        else:
            raise SystemExit(f"launcher: unknown option {flag}")
    return ShimOptions(frozenset(codes), barrier, window), rest


TERM_TIMEOUT_FLAGS = ("--term-timeout", "--term_timeout")


def term_timeout(launcher_args: Sequence[str]) -> str | None:
    """ft_launcher's `--term-timeout` in its arguments (`--term-timeout=S` or `--term-timeout S`),
    or None when it is not given (or not a number)."""
    for index, arg in enumerate(launcher_args):
        name, sep, value = arg.partition("=")
        if name not in TERM_TIMEOUT_FLAGS:
            continue
        if not sep:
            value = launcher_args[index + 1] if index + 1 < len(launcher_args) else ""
        try:
            return str(float(value)) if float(value) > 0 else None
        except ValueError:
            return None
    return None


def record_termination(failed: list[tuple[int, int]]) -> None:
    """Write the pod's termination message naming the first non-retryable worker exit, unless a
    worker already wrote one."""
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


def start_warm_workers(launcher_args: list[str]) -> list[str]:
    """With `RTJ_WARM_WORKERS=1`: start the pool of warm workers (rtj_trainer.launcher.warmpool) and
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
    pool = warmpool.WarmPool(shutil.which(python) or python, warmpool.pool_size(launcher_args),
                             preload=warmwire.model_preloads(launcher_args))
    os.environ[warmwire.POOL_DIR_ENV] = pool.directory  # torchelastic passes it to the workers
    atexit.register(pool.close)
    pool.start()
    log.warning("warm workers: a pool of %d in %s", pool.size, pool.directory)
    return args


def start_device_keepers(launcher_args: list[str]) -> str | None:
    """With `RTJ_DEVICE_KEEPER=1`: start one device keeper per local rank (rtj_trainer.keeper)
    in a private directory, exported to the workers; returns the directory (None: off)."""
    if not keeper.switched_on(os.environ):
        return None
    directory = tempfile.mkdtemp(prefix="rtj-keeper-")  # mode 0700
    processes = [subprocess.Popen(
        [sys.executable, "-m", "rtj_trainer.keeper", f"--directory={directory}",
         f"--local-rank={rank}", f"--parent={os.getpid()}"],
        stdin=subprocess.DEVNULL, start_new_session=True)
        for rank in range(warmpool.pool_size(launcher_args))]
    os.environ[keeper.DIR_ENV] = directory

    def stop_keepers() -> None:
        for process in processes:
            with contextlib.suppress(OSError):
                process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(5)
        shutil.rmtree(directory, ignore_errors=True)

    atexit.register(stop_keepers)
    log.warning("device keepers: %d in %s", len(processes), directory)
    return directory


def verdict_book(env: MutableMapping[str, str]) -> verdicts.VerdictBook:
    """The shim's book of the operator's verdicts on lost pods, at RTJ_LOST_PODS_FILE or a new
    pod-local file; the variable is set in `env` so that the workers find the file."""
    path = Path(env.get(verdicts.FILE_ENV) or verdicts.default_file())
    env[verdicts.FILE_ENV] = str(path)
    return verdicts.VerdictBook(path, own_uid=env.get("POD_UID", ""))


def pod_local_directory(env: MutableMapping[str, str], name: str, purpose: str) -> str:
    """A private directory for the pod's processes, its path exported in `env[name]` (the
    rank monitors and the workers inherit it); an existing value is kept."""
    directory = env.get(name) or tempfile.mkdtemp(prefix=f"rtj-{purpose}-")
    env[name] = directory
    return directory


def held_on_device(keepers: str | None, warm_contexts: bool) -> Callable[[], float]:
    """What ft_launcher's restart may find still held on each GPU (MiB) besides a dead worker's
    memory: the device keeper's buffer and context, and the CUDA context of the warm worker
    meant for that rank (rtj_trainer.warm.device), which a replacement creates while the
    restart waits."""
    context = float(keeper.CONTEXT_ALLOWANCE_MB) if warm_contexts else 0.0
    return lambda: (keeper.held_mb(keepers) if keepers is not None else 0.0) + context


def main(argv: Sequence[str] | None = None) -> int:
    options, rest = split_argv(sys.argv[1:] if argv is None else argv)
    if (timeout := term_timeout(rest)) is not None:
        os.environ[stop.TERM_TIMEOUT_ENV] = timeout  # the workers' stop budget (rtj_trainer.stop)
    monitors = pod_local_directory(os.environ, monitorstate.MONITOR_STATE_DIR_ENV, "monitors")
    stoppable = pod_local_directory(os.environ, wire_env.STOP_SIGNAL_DIR, "stop")
    pod = podmetrics.start_from_environment(os.environ, rest, verdict_book(os.environ),
                                            monitor_dir=monitors)
    warm = start_warm_workers(rest)  # first: their imports overlap the launcher's own
    warm_contexts = warm is not rest and warm_device.switched_on(os.environ)
    rest = warm
    keepers = start_device_keepers(rest)
    nvrx_launcher.install(
        non_retryable=options.non_retryable,
        exit_barrier_timeout=options.exit_barrier_timeout,
        restart_window=options.restart_window,
        stoppable=lambda: stop.registered_local_ranks(stoppable),
        on_finished=pod.mark_finished if pod is not None else None,
        on_non_retryable=record_termination,
        keeper_mb=held_on_device(keepers, warm_contexts) if keepers or warm_contexts else None,
    )
    nvrx_launcher.run(rest)  # exits with ft_launcher's own exit code
    return 0
