"""Hang detection and restarts as one training attempt sees them: `Session` and `Resiliency`.

The step loop never branches on them. NVRx itself is reached only through rtj_trainer.nvrx
(`monitor`, `inprocess`); what is decided here is how the worker uses two NVRx pieces:

- **`RankMonitorClient`** (when running under `ft_launcher`, i.e. FT_RANK_MONITOR_IPC_SOCKET is
  set): a heartbeat per step, `step`/`checkpoint` sections (no-ops unless the launcher configures
  section timeouts), optional learned timeouts after a few steps, and its state saved with every
  checkpoint. Without a rank monitor the same calls do nothing.
- **`inprocess.Wrapper`** (switch: `resiliency.inprocess_restart`, env RTJ_INPROCESS_RESTART): the
  training function is re-entered in the same processes after a soft fault. Each restart iteration
  builds its own process group on a fresh key prefix of an application TCPStore (the wrapper has
  a store of its own; both hosted by worker rank 0 at ports derived from MASTER_PORT:
  rtj_trainer.launchenv.side_store_ports). On CPU the wrapper is built with
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
  (abort the communicator, keep the process) before its first NCCL process group exists
  (rtj_trainer.nvrx.inprocess.run).
- The NVRx rank monitor keeps timing heartbeats while the wrapper recovers (abort, barrier, new
  process group, rebuild, reload), which can outlast `heartbeat_timeout_seconds`: the monitor then
  SIGKILLs a healthy rank. The abort now disconnects this rank from its monitor first
  (`pause_rank_monitor`, the first abort step), and the next iteration reconnects, so the monitor
  applies its *initial* heartbeat timeout to the recovery, as it does to a fresh start.
- NVRx 0.7.0's sibling monitor writes `b'2'`-style ranks into the termination barrier, which makes
  every later barrier raise at exit (and the launcher then restarts a finished job): patched in
  rtj_trainer.nvrx.inprocess.

`Session` is what one training attempt sees; `Resiliency.run(train)` calls `train(session)` once
(plain) or once per restart iteration (in-process). `Resiliency` owns the process's `CarryOver`
(rtj_trainer.carry): what one attempt hands to the next, passed on through `Session.carry`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from . import podloss, timeline
from .carry import CarryOver
from .checkpoint import ProcessWriter, close_interrupted, stage_offered
from .config import Config, ConfigError
from .errors import FatalError
from .hangwatch import HangWatch, LearnedTimeout
from .launchenv import LaunchEnvironment, launch_environment
from .nvrx import inprocess, monitor
from .nvrx import store as wrapper_store
from .nvrx.inprocess import WrapperHandle, waiting_as_spare
from .stop import STOP

__all__ = ["Resiliency", "Session", "StartupAllowance", "waiting_as_spare"]

log = logging.getLogger(__name__)
T = TypeVar("T")


class Session:
    """Hooks for one training attempt (one in-process restart iteration)."""

    def __init__(
        self,
        resiliency: Resiliency,
        *,
        iteration: int,
        wrapper: WrapperHandle | None = None,
        store: Store | None = None,
        startup: StartupAllowance | None = None,
        hang_watch: HangWatch | None = None,
    ) -> None:
        self._resiliency = resiliency
        self.iteration = iteration
        self._wrapper = wrapper
        self.carry = resiliency.carry
        """What this process's attempts hand on to each other (rtj_trainer.carry)."""
        self._store = store
        self._startup = startup
        self._hang_watch = hang_watch
        self.launch = launch_environment()
        self.last_heartbeat = 0.0

    def process_group_store(self) -> Store | None:
        """Store for `init_process_group` (None: the launcher's env:// rendezvous)."""
        return self._store

    @property
    def restarts_in_process(self) -> bool:
        """This attempt runs inside NVRx's in-process wrapper: a soft fault re-enters the
        training function in this process, which keeps its memory (the staging buffer)."""
        return self._wrapper is not None

    def heartbeat(self) -> float:
        """Tell every watchdog this rank made progress; returns the heartbeat time."""
        resiliency = self._resiliency
        with resiliency._client_lock:
            client = resiliency.client
            resiliency.leave_rank_monitor_if_stopping()
            if client is not None and client.is_initialized:
                client.send_heartbeat()
                resiliency._sent_since_connect = True
        if self._wrapper is not None:
            self._wrapper.ping()
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

    def learned_hang_timeout(self) -> dict[str, float | int] | None:
        """What the learned hang timeout knows now (the summary); None when it is off."""
        learned = self._resiliency.learned_timeout
        return learned.summary() if learned is not None else None

    def watched_step(self) -> contextlib.AbstractContextManager[None]:
        """One stretch of the step loop that the learned hang timeout times
        (rtj_trainer.hangwatch); nothing when it is off."""
        if self._hang_watch is None:
            return contextlib.nullcontext()
        return self._hang_watch.stretch()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """Code the in-process wrapper must not interrupt halfway (e.g. staging a checkpoint)."""
        if self._wrapper is None:
            yield
        else:
            with self._wrapper.atomic():
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
        if self._hang_watch is not None:
            self._hang_watch.close()
        if self._startup is not None:
            # An attempt that resumed at the last step ran none: its start-up timer must not
            # switch the timeouts on again on the way out.
            self._startup.cancel()
        if self._wrapper is not None:
            self._wrapper.hang_protection(False)
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
        self.carry = CarryOver()
        """What this process's attempts hand on to each other (rtj_trainer.carry)."""
        if launch.under_rank_monitor:
            self.client = monitor.client()
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
        self.learned_timeout: LearnedTimeout | None = None
        """The steps this process timed for the learned hang timeout, kept across its in-process
        attempts (rtj_trainer.hangwatch); None when that timeout is off."""
        res = cfg.resiliency
        if res.learned_hang_timeout and not res.inprocess_restart:
            raise ConfigError("resiliency.learned_hang_timeout: the learned hang timeout restarts "
                              "a rank in place, which needs resiliency.inprocess_restart")
        learned = res.learned_hang_timeout
        if learned is None:
            learned = (res.inprocess_restart and cfg.train.device != "cpu"
                       and torch.cuda.is_available())
        if learned:
            self.learned_timeout = LearnedTimeout(floor=res.hang_timeout_floor_seconds,
                                                  factor=res.hang_timeout_factor,
                                                  longest_factor=res.hang_timeout_longest_factor,
                                                  learn_steps=res.hang_timeout_learn_steps)
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

    def hang_protection_back_on(self, wrapper: WrapperHandle) -> None:
        """A new in-process attempt after `Session.training_finished` switched the wrapper's
        timeouts off (the wrapper keeps that setting across iterations): switch them on."""
        if self.hang_protection_off:
            self.hang_protection_off = False
            wrapper.hang_protection(True)

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
                port=launch.app_store_port,
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
        res = self.cfg.resiliency
        soft = self._soft_timeout()
        settings = inprocess.WrapperSettings(
            max_iterations=res.inprocess_max_restarts + 1,
            active_world_size=self.active_world_size,
            store_port=self.launch.wrapper_store_port,
            soft_timeout=soft,
            pod_loss_timeout=res.inprocess_pod_loss_timeout_seconds,
            spares=bool(res.spare_nodes),
            on_cuda=self.cfg.train.device != "cpu" and torch.cuda.is_available(),
            gpu_health_checks=res.inprocess_gpu_health_checks,
        )
        listener = self._pod_loss_listener()

        def attempt(wrapper: WrapperHandle) -> T:
            timeline.begin_attempt()  # the wrapper (re-)entered the training function
            iteration = wrapper.iteration
            self.hang_protection_back_on(wrapper)
            startup = StartupAllowance(wrapper, seconds=self._startup_timeout() - soft,
                                       rank=self.launch.rank)
            startup.begin()
            watch: HangWatch | None = None
            try:
                self.resume_rank_monitor()
                store = PrefixStore(f"rtj-iteration-{iteration}", self._application_store())
                timeline.mark("session")
                if self.learned_timeout is not None:
                    watch = HangWatch(self.learned_timeout,
                                      lambda _q, _l: wrapper.report_hang(),
                                      rank=self.launch.rank).start()
                return train(Session(self, iteration=iteration, wrapper=wrapper, store=store,
                                     startup=startup, hang_watch=watch))
            except FatalError:
                raise  # ends the wrapper (inprocess.run's `fatal`)
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
                if watch is not None:
                    watch.close()

        if listener is not None:
            listener.start()
        try:
            # The abort steps run in NVRx's monitor thread, before it aborts NCCL and destroys
            # the process groups: leave the rank monitor, then cut gloo's connections (a no-op
            # on NCCL; rtj_trainer.gloocut).
            steps = (timeline.marker("restart_abort"), self.pause_rank_monitor, self._cut_gloo,
                     timeline.marker("restart_ours_aborted"))
            return inprocess.run(settings, attempt, before_abort=steps,
                                 finalize=self._finish_interrupted_closes,
                                 on_enter=listener.enter if listener is not None else None,
                                 fatal=(FatalError,))
        finally:
            if listener is not None:
                listener.stop()

    def _cut_gloo(self) -> None:
        if cut := self.carry.gloo.cut():
            log.info("cut %d gloo connection(s) of the ended attempt", cut)

    def _finish_interrupted_closes(self) -> None:
        """The wrapper's finalize step: once the monitor thread stopped raising, close what an
        attempt's own cleanup could not finish (its writer: keep it if idle, stop it if busy),
        stage the training state the attempt offered to keep (checkpoint.stage_offered) and
        start the replacement of a writer stopped mid-write."""
        timeline.mark("restart_finalize")
        if close_interrupted(self.carry):
            log.info("finished a checkpointer close that the restart interrupted")
        stage_offered(self.carry)  # the interrupted attempt's training state, for the next one
        ProcessWriter(self.carry).start_replacement()  # of a writer stopped mid-write
        timeline.mark("restart_finalized")

    def _pod_loss_listener(self) -> podloss.PodLossListener | None:
        """The thread that applies the operator's verdicts on lost pods (rtj_trainer.podloss):
        only where the launcher shim keeps them and the pod knows its UID."""
        path, uid = self.cfg.resiliency.lost_pods_file, self.cfg.job.pod_uid
        if not path or not uid:
            return None
        launch = self.launch
        return podloss.PodLossListener(
            path=Path(path), pod_uid=uid, initial_rank=launch.rank,
            connect=lambda: wrapper_store.client(
                launch.master_addr, launch.wrapper_store_port, connect_seconds=30.0,
                op_seconds=10.0))


class StartupAllowance:
    """The in-process wrapper's hang guard is off while an attempt starts, for at most `seconds`.

    NVRx's soft and hard timeouts are measured on the progress watchdog's timestamps, which come
    only while the main thread runs Python. An attempt's start (process group, model, checkpoint
    load) and above all its first step block the main thread in C++ for longer than any later
    step: the allocator, communicators and kernels warm up, ranks wait for the slowest peer, and a
    loaded host is slower still (six CPU ranks' first step took 10.5 s on a 2-core machine, over
    a 10 s soft timeout: a spurious in-process restart at every start). So `begin` disables the
    wrapper's timeouts (`WrapperHandle.hang_protection`, NVRx's own switch for long
    sections) and `end` enables them again with a fresh timestamp: after the first step
    (`Session.after_step`), when the attempt ends, or `seconds` after `begin` (a timer), so that
    a start that is stuck is still restarted in-process, at `seconds` plus the soft timeout (the
    configured start-up timeout) after the attempt began. The rank monitor's own timeouts and
    the wrapper's detection of lost peers stay on throughout."""

    def __init__(self, wrapper: WrapperHandle, *, seconds: float, rank: int) -> None:
        self._wrapper = wrapper
        self.seconds = seconds
        self._rank = rank
        self._lock = threading.Lock()
        self._on = False
        self._timer: threading.Timer | None = None

    def begin(self) -> None:
        if self.seconds <= 0:
            return
        with self._lock:
            self._wrapper.hang_protection(False)
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
                self._wrapper.hang_protection(True)
            return True
