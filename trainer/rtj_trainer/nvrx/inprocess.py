"""NVRx's in-process restart wrapper (`nvidia_resiliency_ext.inprocess.Wrapper`) as the training
worker uses it: built here, with its settings, steps and the two patches it needs.

Runs in the training worker (rtj_trainer.resiliency calls `run`). The wrapper re-enters the
training function in the same process after a soft fault; what the worker does at each abort,
finalize and iteration start it hands in as callables, so this module imports nothing of the
worker. What an attempt sees of NVRx's `CallWrapper` is a `WrapperHandle`: the iteration, a ping,
atomic sections and the hang-protection switch (a private method of NVRx's).

Patches (NVRx 0.7.0 behaviour → what we need → cost measured), declared in `PATCHES`:

1. `inprocess.wrap.reserve_fn` (`patch_reserve_wait`): an inactive rank (a warm spare) waits in
   store waits of `progress_watchdog_interval` (1 s here), each one C++ call, so the restart's
   asynchronous exception reaches it only when the wait returns: a spare joined a take-over up to
   1 s after the survivors (seen 1.3-1.7 s on the local cluster) → wait in chunks of at most
   `RESERVE_WAIT` (one store request per chunk and spare rank).
2. `inprocess.store.StoreMixin.get_initial_ranks` (`patch_initial_ranks`): returns raw bytes, which
   the sibling monitor writes into the termination barrier (`b'2',`); every later barrier then
   fails to parse it, and the launcher restarts a finished job → return ints. A bug: upstream
   report R3 in docs/nvrx.md.

Private attributes used: `CallWrapper._disable_hang_protection` / `_enable_hang_protection`
(`WrapperHandle.hang_protection`), guarded with `CallWrapper` itself; `CallWrapper.monitor_process`
and its `record_interrupted` (`WrapperHandle.report_hang`, the learned hang timeout), guarded
with `MonitorProcess` and the store's `record_interrupted`.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

from .guards import Patch, Target, replace

T = TypeVar("T")

RESERVE_WAIT = timedelta(seconds=0.2)
"""How long one store wait of an inactive (warm spare) rank lasts in NVRx's `reserve_fn`."""

_IP = "nvidia_resiliency_ext.inprocess"
PATCHES = (
    Patch("spares wait in short chunks",
          "a spare learns of a take-over only when its 1 s store wait returns",
          (Target(f"{_IP}.wrap:reserve_fn", "51027306b8f72fa4"),)),
    Patch("initial ranks as ints",
          "bytes in the termination barrier make every later barrier fail to parse",
          (Target(f"{_IP}.store:StoreMixin.get_initial_ranks", "94fec7845eab6ec1"),
           Target(f"{_IP}.sibling_monitor:SiblingMonitor", "69e2d7e9855448cb"))),
    Patch("hang protection switched off and on",
          "the start-up allowance and the end of training switch the wrapper's timeouts",
          (Target(f"{_IP}.wrap:CallWrapper", "6b2b34f13ce80082"),)),
    Patch("a learned hang timeout reports a soft timeout",
          "the wrapper's soft timeout is fixed when it is built; rtj_trainer.hangwatch records "
          "the same interruption through the wrapper's monitor process",
          (Target(f"{_IP}.monitor_process:MonitorProcess", "23727cc51d83c5f6"),
           Target(f"{_IP}.store:StoreMixin.record_interrupted", "f5117e00093323f6"))),
)


@dataclass(frozen=True, slots=True)
class WrapperSettings:
    """What the worker decides about the wrapper (rtj_trainer.resiliency)."""

    max_iterations: int
    """Attempts in all (restarts + 1)."""
    active_world_size: int
    """Ranks that train; the others (warm spares) wait inactive."""
    store_port: int
    """Port of the wrapper's own TCPStore (rtj_trainer.launchenv `side_store_ports`)."""
    soft_timeout: float
    """Seconds without progress after which the wrapper restarts the attempt in place."""
    pod_loss_timeout: float
    """Seconds of silence after which a rank's whole pod counts as lost."""
    spares: bool
    on_cuda: bool
    gpu_health_checks: bool
    """On CUDA, chain NVML's GPU/NVLink/NIC checks into every restart."""


class WrapperHandle:
    """What one attempt holds of NVRx's `CallWrapper`."""

    def __init__(self, call_wrapper: Any) -> None:
        self._call_wrapper = call_wrapper

    @property
    def iteration(self) -> int:
        return int(self._call_wrapper.iteration)

    def ping(self) -> None:
        """Tell the wrapper's progress watchdog that this rank made progress."""
        self._call_wrapper.ping()

    @contextlib.contextmanager
    def atomic(self) -> Iterator[None]:
        """Code the wrapper must not interrupt halfway (e.g. staging a checkpoint)."""
        with self._call_wrapper.atomic():
            yield

    def report_hang(self) -> None:
        """Record a soft-timeout interruption of this rank, as NVRx's monitor process does when
        its own soft timeout expires: every rank's monitor thread then restarts its attempt in
        place (the learned hang timeout, rtj_trainer.hangwatch). Through the wrapper's
        `monitor_process` (an attribute of NVRx's, guarded in `PATCHES`)."""
        from nvidia_resiliency_ext.inprocess.attribution import Interruption, InterruptionRecord

        call_wrapper = self._call_wrapper
        call_wrapper.monitor_process.record_interrupted(
            [InterruptionRecord(call_wrapper.state.rank, Interruption.SOFT_TIMEOUT)])

    def hang_protection(self, on: bool) -> None:
        """Switch the wrapper's soft and hard timeouts (NVRx's own switch for long sections; the
        wrapper keeps the setting across iterations)."""
        if on:
            self._call_wrapper._enable_hang_protection()
        else:
            self._call_wrapper._disable_hang_protection()


def waiting_as_spare() -> bool:
    """True while this process is an inactive rank of the wrapper (a warm spare): NVRx sets RANK
    to the active rank, which is `None` for inactive ranks (inprocess/state.py)."""
    return os.environ.get("RANK") == "None"




def patch_reserve_wait(chunk: timedelta = RESERVE_WAIT) -> None:
    """Patch 1 (idempotent)."""
    from nvidia_resiliency_ext.inprocess import wrap

    original = wrap.reserve_fn

    def reserve_fn(state: Any, store: Any, progress_watchdog: Any, interval: timedelta) -> Any:
        return original(state, store, progress_watchdog, min(interval, chunk))

    replace(wrap, "reserve_fn", reserve_fn)


def patch_initial_ranks() -> None:
    """Patch 2 (idempotent; the wrapper's monitor processes are forked and inherit it)."""
    from nvidia_resiliency_ext.inprocess.store import StoreMixin

    original = StoreMixin.get_initial_ranks

    def get_initial_ranks(self: Any, ranks: Any) -> list[int]:
        return [int(r) for r in original(self, ranks)]

    replace(StoreMixin, "get_initial_ranks", get_initial_ranks)


def _wrapper_kwargs(settings: WrapperSettings, *, before_abort: Sequence[Callable[[], None]],
                    finalize: Callable[[], None],
                    on_enter: Callable[[Any], None] | None) -> dict[str, Any]:
    """The wrapper's arguments: its timeouts and intervals derived from the soft timeout, and its
    steps."""
    from nvidia_resiliency_ext import inprocess
    from nvidia_resiliency_ext.inprocess import abort as inprocess_abort
    from nvidia_resiliency_ext.inprocess.abort import Abort
    from nvidia_resiliency_ext.inprocess.finalize import Finalize
    from nvidia_resiliency_ext.inprocess.initialize import Initialize

    class AbortStep(Abort):  # type: ignore[misc]
        def __init__(self, fn: Callable[[], None]) -> None:
            self.fn = fn

        def __call__(self, state: Any) -> Any:
            self.fn()
            return state

    class FinalizeStep(Finalize):  # type: ignore[misc]
        def __call__(self, state: Any) -> Any:
            finalize()
            return state

    class EnterIteration(Initialize):  # type: ignore[misc]
        def __call__(self, state: Any) -> Any:
            assert on_enter is not None
            on_enter(state)
            return state

    soft = settings.soft_timeout
    watchdog = min(1.0, soft / 4)
    active = settings.active_world_size
    retry = inprocess.initialize.RetryController(
        max_iterations=settings.max_iterations, min_world_size=active,
        min_active_world_size=active)
    kwargs: dict[str, Any] = {
        "store_kwargs": {"port": settings.store_port, "timeout": timedelta(seconds=120)},
        "initialize": retry if on_enter is None else inprocess.Compose(retry, EnterIteration()),
        # Compose runs right to left: the worker's steps first, in the order given (leave the
        # rank monitor, cut gloo's connections), then abort NCCL and destroy the process groups.
        # The checkpoint writer is not aborted here (NVRx's AbortPersistentCheckpointProcesses):
        # the worker keeps an idle one for the next attempt and stops a busy one.
        "abort": inprocess.Compose(inprocess_abort.AbortTorchDistributed(),
                                   *[AbortStep(fn) for fn in reversed(before_abort)]),
        # After the monitor thread stopped raising into the main thread.
        "finalize": FinalizeStep(),
        "soft_timeout": timedelta(seconds=soft),
        "hard_timeout": timedelta(seconds=soft * 2 + 5),
        "heartbeat_timeout": timedelta(seconds=settings.pod_loss_timeout),
        "barrier_timeout": timedelta(seconds=soft * 4 + 60),
        "completion_timeout": timedelta(seconds=soft * 4 + 60),
        # After a fault is recorded, the monitor thread waits this long for the other ranks'
        # concurrent failures before it aborts: with one rank and no spare there are none.
        "last_call_wait": timedelta(seconds=0.2 if active > 1 or settings.spares else 0.0),
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
    if settings.spares:
        # Spares hold the highest ranks (the last launchers) and start inactive; after a loss
        # FillGaps keeps every survivor's rank and moves spares into exactly the lost ranks
        # (Compose runs right to left). docs/nvrx.md 3.2.
        from nvidia_resiliency_ext.inprocess import rank_assignment

        kwargs["rank_assignment"] = inprocess.Compose(
            rank_assignment.MaxActiveWorldSize(active), rank_assignment.FillGaps())
    if settings.on_cuda:
        kwargs["health_check"] = inprocess.health_check.CudaHealthCheck()
    return kwargs


def run(
    settings: WrapperSettings,
    attempt: Callable[[WrapperHandle], T],
    *,
    before_abort: Sequence[Callable[[], None]] = (),
    finalize: Callable[[], None] = lambda: None,
    on_enter: Callable[[Any], None] | None = None,
    fatal: tuple[type[BaseException], ...] = (),
) -> T:
    """Run `attempt` inside the wrapper: once, and again in this process after every soft fault,
    up to `settings.max_iterations` times. `before_abort` run (in order) when an attempt is
    aborted, before NVRx destroys the process groups; `finalize` once NVRx's monitor thread no
    longer raises into the main thread; `on_enter(state)` at the start of every iteration, on
    active and inactive ranks (NVRx's frozen `State`). An exception of a `fatal` type ends the
    wrapper (no restart in place could help) and is raised here."""
    from nvidia_resiliency_ext import inprocess

    patch_initial_ranks()
    patch_reserve_wait()
    # NVRx runs `while gc.collect(): pass` between two restart iterations, on every rank at
    # once. With torch imported a full collection walks some 360,000 objects: 0.8-1.5 s on a
    # loaded 2-core host, paid by every in-process restart and every warm spare's take-over.
    # What exists now (modules, the session) lives as long as the process: leave it out of
    # every later collection. The attempts' own objects are collected as before. Unfrozen
    # at exit: objects still frozen then are never finalised, and native extensions report
    # them on stderr as leaks (nanobind's lines cut into the summary line in a pod's log).
    gc.freeze()
    atexit.register(gc.unfreeze)
    if settings.on_cuda:
        # Abort the communicator on an NCCL error but keep the process: the wrapper restarts
        # it. ft_launcher's default (1) kills the process, i.e. a launcher restart of all.
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    kwargs = _wrapper_kwargs(settings, before_abort=before_abort, finalize=finalize,
                             on_enter=on_enter)
    # With LOCAL_RANK set the wrapper chains NVML GPU/NVLink/NIC checks into every restart;
    # they fail closed where NVML cannot be read (a CPU host), so they are opt-in off CUDA.
    keep_local_rank = settings.on_cuda and settings.gpu_health_checks
    local_rank = None if keep_local_rank else os.environ.pop("LOCAL_RANK", None)
    try:
        wrapper = inprocess.Wrapper(**kwargs)
    finally:
        if local_rank is not None:
            os.environ["LOCAL_RANK"] = local_rank
    ended_for_good: list[BaseException] = []

    def wrapped_attempt(call_wrapper=None):  # type: ignore[no-untyped-def]
        try:
            return attempt(WrapperHandle(call_wrapper))
        except fatal as exc:
            # Restarting in place cannot help either: end the wrapper, not just this
            # iteration, and hand the error to the caller below.
            ended_for_good.append(exc)
            raise inprocess.exception.RestartAbort(str(exc)) from exc

    # The wrapper finds the CallWrapper parameter by its (real, not string) annotation.
    wrapped_attempt.__annotations__ = {"call_wrapper": inprocess.CallWrapper}
    try:
        result: T = wrapper(wrapped_attempt)()
    except BaseException:
        if ended_for_good:
            raise ended_for_good[0] from None
        raise
    return result
