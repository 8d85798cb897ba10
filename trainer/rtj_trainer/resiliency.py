"""The one NVRx adapter for hang detection and restarts; the step loop never branches on it.

Two NVRx pieces meet here:

- **`RankMonitorClient`** (when running under `ft_launcher`, i.e. FT_RANK_MONITOR_IPC_SOCKET is
  set): a heartbeat per step, `step`/`checkpoint` sections (no-ops unless the launcher configures
  section timeouts), optional learned timeouts after a few steps, and its state saved with every
  checkpoint. Without a rank monitor the same calls do nothing.
- **`inprocess.Wrapper`** (switch: `resiliency.inprocess_restart`, env RTJ_INPROCESS_RESTART): the
  training function is re-entered in the same processes after a soft fault. Each restart iteration
  builds its own process group on a fresh key prefix of an application TCPStore at
  MASTER_PORT+1 (the wrapper's own store is at MASTER_PORT+2). On CPU the wrapper is built with
  LOCAL_RANK unset (otherwise it chains NVML health checks that fail without a GPU; docs/nvrx.md
  I1), gloo uses a short timeout and, since gloo cannot be aborted, the wrapper's abort cuts the
  attempt's gloo connections (rtj_trainer.gloocut) so that no rank waits that timeout out. On
  CUDA it adds `CudaHealthCheck`.
  The wrapper gives up (and the process exits, so ft_launcher restarts the job) when fewer than
  all ranks are left: our checkpoints are per-rank shards for a fixed world size.

What makes the in-process path hold on CUDA/NCCL (each of these turned an in-process restart into
an ft_launcher restart; docs/nvrx.md, "Why an in-process restart falls back"):

- ft_launcher starts workers with TORCH_NCCL_ASYNC_ERROR_HANDLING=1 (tear the process down on an
  NCCL error). The wrapper's abort of the communicators is such an error, so the survivors died
  before the wrapper could restart them. With in-process restart on CUDA the worker switches to 2
  (abort the communicator, keep the process) before its first NCCL process group exists.
- The NVRx rank monitor keeps timing heartbeats while the wrapper recovers (abort, barrier, new
  process group, rebuild, reload), which can outlast `heartbeat_timeout_seconds`: the monitor then
  SIGKILLs a healthy rank. The abort now disconnects this rank from its monitor first
  (`PauseRankMonitor`), and the next iteration reconnects, so the monitor applies its *initial*
  heartbeat timeout to the recovery, as it does to a fresh start.
- NVRx 0.7.0's sibling monitor writes `b'2'`-style ranks into the termination barrier, which makes
  every later barrier raise at exit (and the launcher then restarts a finished job): patched here.

`Session` is what one training attempt sees; `Resiliency.run(train)` calls `train(session)` once
(plain) or once per restart iteration (in-process).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from . import podloss, timeline
from .config import Config, ConfigError, LaunchEnvironment, launch_environment
from .errors import FatalError
from .stop import STOP

log = logging.getLogger(__name__)
T = TypeVar("T")


class Session:
    """Hooks for one training attempt (one in-process restart iteration)."""

    def __init__(
        self,
        resiliency: Resiliency,
        *,
        iteration: int,
        call_wrapper: Any = None,
        store: Store | None = None,
        startup: StartupAllowance | None = None,
    ) -> None:
        self._resiliency = resiliency
        self.iteration = iteration
        self._call_wrapper = call_wrapper
        self._store = store
        self._startup = startup
        self.launch = launch_environment()
        self.last_heartbeat = 0.0

    def process_group_store(self) -> Store | None:
        """Store for `init_process_group` (None: the launcher's env:// rendezvous)."""
        return self._store

    @property
    def restarts_in_process(self) -> bool:
        """This attempt runs inside NVRx's in-process wrapper: a soft fault re-enters the
        training function in this process, which keeps its memory (the staging buffer)."""
        return self._call_wrapper is not None

    def heartbeat(self) -> float:
        """Tell every watchdog this rank made progress; returns the heartbeat time."""
        resiliency = self._resiliency
        with resiliency._client_lock:
            client = resiliency.client
            resiliency.leave_rank_monitor_if_stopping()
            if client is not None and client.is_initialized:
                client.send_heartbeat()
                resiliency._sent_since_connect = True
        if self._call_wrapper is not None:
            self._call_wrapper.ping()
        self.last_heartbeat = time.time()
        return self.last_heartbeat

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """An NVRx timed section (no-op unless the launcher configured a timeout for `name`)."""
        resiliency = self._resiliency
        client = resiliency.client
        started = False
        with resiliency._client_lock:
            resiliency.leave_rank_monitor_if_stopping()
            if client is not None and client.is_initialized:
                client.start_section(name)
                started = True
                resiliency._sent_since_connect = True
        try:
            yield
        finally:
            # The in-process wrapper's abort may have disconnected the client meanwhile (from
            # its monitor thread); then there is no section left to end.
            with resiliency._client_lock:
                if started and client.is_initialized:
                    client.end_section(name)

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """Code the in-process wrapper must not interrupt halfway (e.g. staging a checkpoint)."""
        if self._call_wrapper is None:
            yield
        else:
            with self._call_wrapper.atomic():
                yield

    def training_finished(self) -> None:
        """Every rank reached the end of training with its last checkpoint committed: leave the
        rank monitor (it times nothing once the connection is gone) and switch off the in-process
        wrapper's soft and hard timeouts, so that the way out (discarding node-local copies,
        releasing GBs of page-locked memory, NVRx's completion barrier, the launcher's exit
        barrier, a loaded host) is not taken for a hang and a finished worker is neither
        restarted nor killed. Seen on one H200: with the timeouts on, the 5 s soft timeout
        restarted a finished 1B job in place while it deleted its node-local copies, and the job
        ended through one more attempt. An in-process restart after this reconnects and switches
        them on again (`Resiliency.hang_protection_back_on`)."""
        with self._resiliency._client_lock:
            self._resiliency.leave_rank_monitor()
        if self._startup is not None:
            # An attempt that resumed at the last step ran none: its start-up timer must not
            # switch the timeouts on again on the way out.
            self._startup.cancel()
        if self._call_wrapper is not None:
            self._call_wrapper._disable_hang_protection()
            self._resiliency.hang_protection_off = True

    def after_step(self, steps_this_attempt: int) -> None:
        """End the start-up allowance after the first step; learn heartbeat timeouts once, after
        the configured number of steps (collective)."""
        if self._startup is not None and steps_this_attempt == 1:
            self._startup.end()
        client = self._resiliency.client
        learn_after = self._resiliency.cfg.resiliency.learn_timeouts_after_steps
        if (
            client is not None
            and client.is_initialized
            and learn_after
            and steps_this_attempt == learn_after
            and client.calculate_and_set_hb_timeouts(skip_if_not_ready=True)
        ):
            log.info("learned NVRx heartbeat timeouts: %s", client.hb_timeouts)

    def monitor_state(self) -> dict[str, Any]:
        client = self._resiliency.client
        return dict(client.state_dict()) if client is not None else {}

    def load_monitor_state(self, state: dict[str, Any]) -> None:
        client = self._resiliency.client
        if client is not None and state:
            client.load_state_dict(state)


class Resiliency:
    """Built once per worker process; owns the rank-monitor client and the in-process wrapper."""

    def __init__(self, cfg: Config, launch: LaunchEnvironment) -> None:
        self.cfg = cfg
        self.launch = launch
        self.client: Any = None
        self._client_lock = threading.Lock()
        self._sent_since_connect = True
        """Whether the client sent a heartbeat or section message since it last (re)connected."""
        self.hang_protection_off = False
        """`Session.training_finished` switched the in-process wrapper's timeouts off."""
        if launch.under_rank_monitor:
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

            self.client = RankMonitorClient()
            # With in-process restart the client connects inside the wrapped function, i.e. on
            # active ranks only: a warm spare never beats, and its monitor must not time it.
            if not cfg.resiliency.inprocess_restart:
                self.client.init_workload_monitoring()
        self._app_store: TCPStore | None = None
        spares = cfg.resiliency.spare_nodes
        self.active_world_size = launch.world_size - spares * launch.local_world_size
        """Ranks that train; the last `spare_nodes` launchers' ranks wait as warm spares."""
        if spares and not cfg.resiliency.inprocess_restart:
            raise ConfigError("resiliency.spare_nodes: warm spares need resiliency.inprocess_"
                              "restart (they take over inside the in-process wrapper's world)")
        if self.active_world_size < 1:
            raise ConfigError(
                f"resiliency.spare_nodes: {spares} spare launchers of {launch.local_world_size} "
                f"ranks leave no active rank in a world of {launch.world_size}")

    def pause_rank_monitor(self) -> None:
        """Disconnect from the rank monitor (it stops timing this rank) until `resume`.

        NVRx's monitor treats a lost connection as "the rank is restarting" until the rank's next
        heartbeat or section message, and a second lost connection before that as an aborted
        rank for good (every later message is refused). So a rank that reconnected but has not
        sent anything yet (a restart that failed again at once) stays connected: the monitor is
        still in its restarting state and times nothing."""
        with self._client_lock:
            if (self.client is not None and self.client.is_initialized
                    and self._sent_since_connect):
                with contextlib.suppress(Exception):
                    self.client.shutdown_workload_monitoring()

    def leave_rank_monitor_if_stopping(self) -> None:
        """Once this worker was asked to stop (rtj_trainer.stop), disconnect from its rank
        monitor (call with `_client_lock` held) and send it nothing more. The monitor treats the
        lost connection as a restarting rank and times nothing, so the last save may take
        longer than a heartbeat timeout; and where a signal reached the monitors too (a
        SIGTERM sent to the launcher's whole process group, not to it alone) they are closing,
        and a message that fails halfway leaves NVRx 0.7.0's client with a pickled buffer that
        later crashes the interpreter ("deallocated BytesIO object has exported buffers")."""
        if STOP.requested:
            self.leave_rank_monitor()

    def leave_rank_monitor(self) -> None:
        """Disconnect from the rank monitor for good (call with `_client_lock` held); an
        in-process restart reconnects (`resume_rank_monitor`)."""
        if self.client is not None and self.client.is_initialized:
            with contextlib.suppress(Exception):
                self.client.shutdown_workload_monitoring()

    def hang_protection_back_on(self, call_wrapper: Any) -> None:
        """A new in-process attempt after `Session.training_finished` switched the wrapper's
        timeouts off (the wrapper keeps that setting across iterations): switch them on."""
        if self.hang_protection_off:
            self.hang_protection_off = False
            call_wrapper._enable_hang_protection()

    def resume_rank_monitor(self) -> None:
        """Reconnect after an in-process restart; the monitor applies its initial timeout again."""
        with self._client_lock:
            if self.client is not None and not self.client.is_initialized:
                self.client.init_workload_monitoring()
                self._sent_since_connect = False

    def run(self, train: Callable[[Session], T]) -> T:
        if not self.cfg.resiliency.inprocess_restart:
            timeline.begin_attempt()
            return train(Session(self, iteration=0))
        return self._run_inprocess(train)

    def close(self) -> None:
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.shutdown_workload_monitoring()

    # -- in-process restart ---------------------------------------------------------------------

    def _application_store(self) -> TCPStore:
        if self._app_store is None:
            launch = launch_environment()
            self._app_store = TCPStore(
                host_name=launch.master_addr,
                port=launch.master_port + 1,
                # Hosted by the process that started as rank 0; spares never connect to it.
                is_master=self.launch.rank == 0,
                multi_tenant=True,
                wait_for_workers=False,
                use_libuv=True,
                timeout=timedelta(seconds=120),
            )
        return self._app_store

    def _soft_timeout(self) -> float:
        res = self.cfg.resiliency
        return res.inprocess_soft_timeout_seconds or max(2.0, res.heartbeat_timeout_seconds / 2)

    def _startup_timeout(self) -> float:
        res = self.cfg.resiliency
        return res.inprocess_startup_timeout_seconds or res.heartbeat_timeout_seconds

    def _run_inprocess(self, train: Callable[[Session], T]) -> T:
        from nvidia_resiliency_ext import inprocess
        from nvidia_resiliency_ext.inprocess import abort as inprocess_abort

        _patch_nvrx_initial_ranks()
        _patch_nvrx_reserve_wait(RESERVE_WAIT)
        # NVRx runs `while gc.collect(): pass` between two restart iterations, on every rank at
        # once. With torch imported a full collection walks some 360,000 objects: 0.8-1.5 s on a
        # loaded 2-core host, paid by every in-process restart and every warm spare's take-over.
        # What exists now (modules, the session) lives as long as the process: leave it out of
        # every later collection. The attempts' own objects are collected as before. Unfrozen
        # at exit: objects still frozen then are never finalised, and native extensions report
        # them on stderr as leaks (nanobind's lines cut into the summary line in a pod's log).
        gc.freeze()
        atexit.register(gc.unfreeze)
        res = self.cfg.resiliency
        soft = self._soft_timeout()
        watchdog = min(1.0, soft / 4)
        on_cuda = self.cfg.train.device != "cpu" and torch.cuda.is_available()
        if on_cuda:
            # Abort the communicator on an NCCL error but keep the process: the wrapper restarts
            # it. ft_launcher's default (1) kills the process, i.e. a launcher restart of all.
            os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        active = self.active_world_size
        listener = self._pod_loss_listener()
        retry = inprocess.initialize.RetryController(
            max_iterations=res.inprocess_max_restarts + 1,
            min_world_size=active,
            min_active_world_size=active,
        )
        wrapper_kwargs: dict[str, Any] = {
            "store_kwargs": {"port": self.launch.master_port + 2,
                             "timeout": timedelta(seconds=120)},
            "initialize": retry if listener is None else inprocess.Compose(
                retry, _entering(listener)),
            # Compose runs right to left: leave the rank monitor first, then cut gloo's
            # connections (a no-op on NCCL; rtj_trainer.gloocut), then abort NCCL and destroy the
            # process groups. The checkpoint writer is not aborted here (NVRx's
            # AbortPersistentCheckpointProcesses): the attempt's own close keeps an idle one for
            # the next attempt and stops a busy one (rtj_trainer.checkpoint.ProcessWriter),
            # before the next attempt can stage anything.
            "abort": inprocess.Compose(
                inprocess_abort.AbortTorchDistributed(),
                _cut_gloo_abort(),
                _pause_rank_monitor_abort(self),
            ),
            # After the monitor thread stopped raising into the main thread: finish any
            # checkpointer close() its repeated exceptions cut short (checkpoint.close_interrupted).
            "finalize": _finish_interrupted_closes(),
            "soft_timeout": timedelta(seconds=soft),
            "hard_timeout": timedelta(seconds=soft * 2 + 5),
            "heartbeat_timeout": timedelta(seconds=res.inprocess_pod_loss_timeout_seconds),
            "barrier_timeout": timedelta(seconds=soft * 4 + 60),
            "completion_timeout": timedelta(seconds=soft * 4 + 60),
            "last_call_wait": timedelta(seconds=0.2),
            # NVRx's monitor process checks the soft and hard timeouts only after an interval
            # with no message from the rank; the progress watchdog sends one every interval (and
            # every ping): with equal intervals the checks hardly ever ran and a hang was left
            # to the rank monitor (a launcher restart). Half the watchdog's interval leaves room.
            "monitor_process_interval": timedelta(seconds=watchdog / 2),
            # How soon the other ranks notice a fault (one store read each per interval).
            "monitor_thread_interval": timedelta(seconds=min(0.5, soft / 4)),
            "progress_watchdog_interval": timedelta(seconds=watchdog),
            "heartbeat_interval": timedelta(seconds=min(1.0, soft / 4)),
        }
        if res.spare_nodes:
            # Spares hold the highest ranks (the last launchers) and start inactive; after a loss
            # FillGaps keeps every survivor's rank and moves spares into exactly the lost ranks
            # (Compose runs right to left). docs/nvrx.md 3.2.
            from nvidia_resiliency_ext.inprocess import rank_assignment

            wrapper_kwargs["rank_assignment"] = inprocess.Compose(
                rank_assignment.MaxActiveWorldSize(active),
                rank_assignment.FillGaps(),
            )
        if on_cuda:
            wrapper_kwargs["health_check"] = inprocess.health_check.CudaHealthCheck()
        # With LOCAL_RANK set the wrapper chains NVML GPU/NVLink/NIC checks into every restart;
        # they fail closed where NVML cannot be read (a CPU host), so they are opt-in off CUDA.
        keep_local_rank = on_cuda and res.inprocess_gpu_health_checks
        local_rank = None if keep_local_rank else os.environ.pop("LOCAL_RANK", None)
        try:
            wrapper = inprocess.Wrapper(**wrapper_kwargs)
        finally:
            if local_rank is not None:
                os.environ["LOCAL_RANK"] = local_rank

        fatal: list[FatalError] = []

        def attempt(call_wrapper=None):  # type: ignore[no-untyped-def]
            timeline.begin_attempt()  # the wrapper (re-)entered the training function
            iteration = int(call_wrapper.iteration)
            self.hang_protection_back_on(call_wrapper)
            startup = StartupAllowance(call_wrapper, seconds=self._startup_timeout() - soft,
                                       rank=self.launch.rank)
            startup.begin()
            self.resume_rank_monitor()
            store = PrefixStore(f"rtj-iteration-{iteration}", self._application_store())
            timeline.mark("session")
            try:
                return train(Session(self, iteration=iteration, call_wrapper=call_wrapper,
                                     store=store, startup=startup))
            except FatalError as exc:
                # Restarting in place cannot help either: end the wrapper, not just this
                # iteration, and hand the error to the caller below.
                fatal.append(exc)
                raise inprocess.exception.RestartAbort(str(exc)) from exc
            except BaseException as exc:
                # Where the attempt was when it ended (a soft timeout during the start names
                # the phase a rank was stuck in): its marks, and when it ended.
                log.info("restart iteration %d ended by %s at %.3f; timeline %s", iteration,
                         type(exc).__name__, time.time(), timeline.render(),
                         extra={"rank": self.launch.rank})
                raise
            finally:
                # The wrapper keeps the monitor's setting across iterations: never leave it off.
                startup.end()

        # The wrapper finds the CallWrapper parameter by its (real, not string) annotation.
        attempt.__annotations__ = {"call_wrapper": inprocess.CallWrapper}
        wrapped = wrapper(attempt)
        if listener is not None:
            listener.start()
        try:
            result: T = wrapped()
        except BaseException:
            if fatal:
                raise fatal[0] from None
            raise
        finally:
            if listener is not None:
                listener.stop()
        return result

    def _pod_loss_listener(self) -> podloss.PodLossListener | None:
        """The thread that applies the operator's verdicts on lost pods (rtj_trainer.podloss):
        only where the launcher shim keeps them and the pod knows its UID."""
        path, uid = self.cfg.resiliency.lost_pods_file, self.cfg.job.pod_uid
        if not path or not uid:
            return None
        launch = self.launch
        return podloss.PodLossListener(
            path=Path(path), pod_uid=uid, initial_rank=launch.rank,
            connect=lambda: podloss.store_client(
                launch.master_addr, launch.master_port + 2, connect_seconds=30.0,
                op_seconds=10.0))


class StartupAllowance:
    """The in-process wrapper's hang guard is off while an attempt starts, for at most `seconds`.

    NVRx's soft and hard timeouts are measured on the progress watchdog's timestamps, which come
    only while the main thread runs Python. An attempt's start (process group, model, checkpoint
    load) and above all its first step block the main thread in C++ for longer than any later
    step: the allocator, communicators and kernels warm up, ranks wait for the slowest peer, and a
    loaded host is slower still (six CPU ranks' first step took 10.5 s on a 2-core machine, over
    a 10 s soft timeout: a spurious in-process restart at every start). So `begin` disables the
    wrapper's timeouts (`CallWrapper._disable_hang_protection`, NVRx's own switch for long
    sections) and `end` enables them again with a fresh timestamp: after the first step
    (`Session.after_step`), when the attempt ends, or `seconds` after `begin` (a timer), so that
    a start that is stuck is still restarted in-process, at `seconds` plus the soft timeout (the
    configured start-up timeout) after the attempt began. The rank monitor's own timeouts and
    the wrapper's detection of lost peers stay on throughout."""

    def __init__(self, call_wrapper: Any, *, seconds: float, rank: int) -> None:
        self._call_wrapper = call_wrapper
        self.seconds = seconds
        self._rank = rank
        self._lock = threading.Lock()
        self._on = False
        self._timer: threading.Timer | None = None

    def begin(self) -> None:
        if self.seconds <= 0:
            return
        with self._lock:
            self._call_wrapper._disable_hang_protection()
            self._on = True
            self._timer = threading.Timer(self.seconds, self._expire)
            self._timer.daemon = True
            self._timer.start()

    def _expire(self) -> None:
        if self.end():
            log.warning("the attempt's start took over %.1f s: the in-process soft timeout "
                        "applies again before the first step ended", self.seconds,
                        extra={"rank": self._rank})

    def cancel(self) -> None:
        """End the allowance without enabling the wrapper's timeouts (the caller keeps them
        off: `Session.training_finished`)."""
        with self._lock:
            self._on = False
            if self._timer is not None:
                self._timer.cancel()

    def end(self) -> bool:
        """Enable the wrapper's timeouts again (idempotent); whether this call did."""
        with self._lock:
            if not self._on:
                return False
            self._on = False
            if self._timer is not None:
                self._timer.cancel()
            with contextlib.suppress(Exception):
                self._call_wrapper._enable_hang_protection()
            return True


def _pause_rank_monitor_abort(resiliency: Resiliency) -> Any:
    """An NVRx `Abort` step that disconnects this rank from its NVRx rank monitor."""
    from nvidia_resiliency_ext.inprocess.abort import Abort

    class PauseRankMonitor(Abort):  # type: ignore[misc]
        def __call__(self, state: Any) -> Any:
            resiliency.pause_rank_monitor()
            return state

    return PauseRankMonitor()


def _cut_gloo_abort() -> Any:
    """An NVRx `Abort` step that cuts this rank's gloo connections (rtj_trainer.gloocut), so
    that no rank waits out gloo's timeout in a collective that will never complete."""
    from nvidia_resiliency_ext.inprocess.abort import Abort

    from . import gloocut

    class CutGlooConnections(Abort):  # type: ignore[misc]
        def __call__(self, state: Any) -> Any:
            if cut := gloocut.cut():
                log.info("cut %d gloo connection(s) of the ended attempt", cut)
            return state

    return CutGlooConnections()


def _finish_interrupted_closes() -> Any:
    """An NVRx `Finalize` step: once the monitor thread stopped raising, close what an attempt's
    own cleanup could not finish (its writer: keep it if idle, stop it if busy), stage the
    training state the attempt offered to keep (checkpoint.stage_offered) and start the
    replacement of a writer stopped mid-write."""
    from nvidia_resiliency_ext.inprocess.finalize import Finalize

    class FinishInterruptedCloses(Finalize):  # type: ignore[misc]
        def __call__(self, state: Any) -> Any:
            from .checkpoint import ProcessWriter, close_interrupted, stage_offered

            if close_interrupted():
                log.info("finished a checkpointer close that the restart interrupted")
            stage_offered()  # the interrupted attempt's training state, for the next attempt
            ProcessWriter.start_replacement()  # of a writer stopped mid-write
            return state

    return FinishInterruptedCloses()


def _entering(listener: podloss.PodLossListener) -> Any:
    """An NVRx `Initialize` step (run at the start of every restart iteration, on active and
    inactive ranks) that tells the pod-loss listener where this rank stands."""
    from nvidia_resiliency_ext.inprocess.initialize import Initialize

    class EnterIteration(Initialize):  # type: ignore[misc]
        def __call__(self, state: Any) -> Any:
            listener.enter(state)
            return state

    return EnterIteration()


RESERVE_WAIT = timedelta(seconds=0.2)
"""How long one store wait of an inactive (warm spare) rank lasts in NVRx's `reserve_fn`."""


def _patch_nvrx_reserve_wait(chunk: timedelta) -> None:
    """NVRx 0.7.0: an inactive rank (a warm spare) waits in `wrap.reserve_fn` with store waits
    of `progress_watchdog_interval` (1 s here), each one C++ call: the restart's asynchronous
    exception reaches it only when the wait returns, so a spare joined a take-over up to 1 s
    after the survivors (seen: 1.3-1.7 s on the local cluster). Wait in chunks of at most
    `chunk` instead (one store request per chunk and spare rank; idempotent)."""
    from nvidia_resiliency_ext.inprocess import wrap

    original = wrap.reserve_fn
    if getattr(original, "_rtj_patched", False):
        return

    def reserve_fn(state: Any, store: Any, progress_watchdog: Any, interval: timedelta) -> Any:
        return original(state, store, progress_watchdog, min(interval, chunk))

    reserve_fn._rtj_patched = True  # type: ignore[attr-defined]
    wrap.reserve_fn = reserve_fn


def _patch_nvrx_initial_ranks() -> None:
    """NVRx 0.7.0: `StoreMixin.get_initial_ranks` returns raw bytes, which the sibling monitor
    writes into the termination barrier (`b'2',`); every later barrier then fails to parse it.
    Return ints instead (idempotent; the wrapper's monitor processes are forked and inherit it)."""
    from nvidia_resiliency_ext.inprocess.store import StoreMixin

    original = StoreMixin.get_initial_ranks
    if getattr(original, "_rtj_patched", False):
        return

    def get_initial_ranks(self: Any, ranks: Any) -> list[int]:
        return [int(r) for r in original(self, ranks)]

    get_initial_ranks._rtj_patched = True  # type: ignore[attr-defined]
    StoreMixin.get_initial_ranks = get_initial_ranks  # type: ignore[method-assign]


def waiting_as_spare() -> bool:
    """True while this process is an inactive rank of the in-process wrapper (a warm spare):
    NVRx sets RANK to the active rank, which is `None` for inactive ranks (inprocess/state.py)."""
    return os.environ.get("RANK") == "None"
