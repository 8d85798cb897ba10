"""The operator's word that a peer pod is gone, turned into what NVRx's sibling monitor would do.

Why: when a whole pod is lost (its launcher, workers and NVRx monitor processes die together),
NVRx's in-process wrapper learns of it only from its sibling heartbeats: the survivors' gloo
collectives fail at once, but they then wait in the wrapper's iteration barrier until the lost
ranks' heartbeats are older than `resiliency.inprocess_pod_loss_timeout_seconds` (10 s), when a
sibling monitor arrives there on their behalf. Only then can a warm spare take the lost ranks
over. Kubernetes knows sooner, and knows for certain: the operator sees the pod `Failed` (every
container ended) or gone from the API within a second or two, and posts a *verdict* to every
other trainer pod of the job, `POST /lost-pods` on the launcher shim's pod endpoint
(rtj_wire.lostpods). The path from there:

- the shim (rtj_trainer.launcher.verdicts) keeps the newest verdicts in a pod-local file,
  `RTJ_LOST_PODS_FILE`, which it exports to its workers (it refuses a verdict naming its own pod);
- every worker under in-process restart runs a `PodLossListener` thread. Once the wrapper runs
  (its first restart iteration begins) it registers its pod's UID for its initial rank in the
  wrapper's store (`rtj_pod_uids`), so a verdict names processes, never a pod name that a
  replacement pod reuses, nor a rank number that a spare takes over. It polls the file; for a
  new verdict it marks the ranks registered with that UID terminated in the restart iteration
  it is in **exactly as NVRx's sibling monitor marks ranks whose heartbeats stopped**
  (rtj_trainer.nvrx.store calls `SiblingMonitor.terminate_unresponsive_ranks`: the
  `UNRESPONSIVE` interruption records, the terminated ranks, the iteration and termination
  barriers on their behalf), so the barrier
  completes and `FillGaps` moves the spare in at once. Active ranks and waiting spares alike.

Safety: a verdict is evidence, not a timeout. The operator sends one only when Kubernetes says
the pod's processes are gone (rtj_operator.decisions.podloss); a live but slow rank is never
named. A verdict only ever names the ranks registered with that pod's UID in this launcher
cycle's store (every cycle has a new store), and it acts only while the iteration it reads is
still in its barrier: so a late or repeated verdict finds nothing to do. Marking is idempotent
(NVRx's barriers count ranks as sets), so every survivor may mark the same ranks. A verdict that
never arrives changes nothing: the sibling heartbeats still declare the ranks lost after the
timeout.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Any

from rtj_wire import env as wire_env
from rtj_wire.lostpods import LostPod, parse_verdict

from .nvrx import store as wrapper_store

log = logging.getLogger(__name__)

FILE_ENV = wire_env.LOST_PODS_FILE
"""Where the launcher shim tells its workers its verdict file is (rtj_trainer.launcher.verdicts)."""
REGISTRY_KEY = "rtj_pod_uids"
"""Key in the wrapper's base store: `<initial rank>=<pod uid>,` for every rank of the cycle."""
RETRY_SECONDS = 60.0
"""How long a worker keeps trying a verdict it could not apply yet (an iteration changing)."""


def read_verdicts(path: Path) -> list[LostPod]:
    """What the shim's file holds now ([] when it does not exist or cannot be read yet)."""
    try:
        return parse_verdict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return []


# -- the worker's side: which ranks a verdict names ------------------------------------------


def registry_entry(initial_rank: int, pod_uid: str) -> str:
    """What a rank appends to `REGISTRY_KEY`."""
    return f"{initial_rank}={pod_uid},"


def parse_registry(text: str) -> dict[int, str]:
    """`REGISTRY_KEY`'s value as {initial rank: pod uid} (a malformed entry is skipped)."""
    registry = {}
    for entry in text.split(","):
        rank, _, uid = entry.partition("=")
        if uid and rank.strip().isdigit():
            registry[int(rank)] = uid
    return registry


def ranks_to_terminate(
    lost_uids: Iterable[str],
    registry: Mapping[int, str],
    initial_rank_of: Sequence[int],
    terminated: Iterable[int],
) -> set[int]:
    """The ranks of the current iteration (indexes of `initial_rank_of`, which gives each one's
    initial rank) that run in a lost pod according to `registry`, less those already marked."""
    lost = set(lost_uids)
    gone = {initial for initial, uid in registry.items() if uid in lost}
    return {rank for rank, initial in enumerate(initial_rank_of) if initial in gone} - set(
        terminated)


class Outcome(Enum):
    MARKED = "marked"
    """Ranks of the lost pod were marked terminated."""
    NOTHING = "nothing"
    """The lost pod has no rank in the current iteration (never registered in this cycle, or
    already removed): the verdict is done."""
    RETRY = "retry"
    """The iteration is changing (its barrier completed, or a rank has not entered it yet)."""


def register(base: Any, *, initial_rank: int, pod_uid: str) -> None:
    """Record in the wrapper's base store that `initial_rank` runs in the pod `pod_uid`."""
    base.append(REGISTRY_KEY, registry_entry(initial_rank, pod_uid))


def terminate_lost_ranks(
    base: Any, *, iteration: int, world_size: int, initial_world_size: int, rank: int,
    lost_uids: Iterable[str],
) -> tuple[Outcome, list[int]]:
    """Mark the ranks of the lost pods terminated in restart iteration `iteration` (world size
    `world_size`), as NVRx's sibling monitor does for ranks whose heartbeats stopped."""
    base.append(REGISTRY_KEY, "")
    registry = parse_registry(base.get(REGISTRY_KEY).decode())
    lost = set(lost_uids)
    if not any(uid in lost for uid in registry.values()):
        return Outcome.NOTHING, []
    view = wrapper_store.iteration_view(base, iteration=iteration, world_size=world_size)
    if not view.open:
        return Outcome.RETRY, []
    ranks = ranks_to_terminate(lost, registry, view.initial_rank_of, view.terminated)
    if not ranks:
        return Outcome.NOTHING, []
    wrapper_store.mark_terminated(base, iteration=iteration, rank=rank, world_size=world_size,
                                  initial_world_size=initial_world_size, ranks=ranks)
    return Outcome.MARKED, sorted(ranks)


class PodLossListener(threading.Thread):
    """A worker's thread: once the wrapper runs (`enter`), register this rank's pod, then apply
    the shim's verdicts in the restart iteration this rank is in."""

    def __init__(self, *, path: Path, pod_uid: str, initial_rank: int,
                 connect: Callable[[], Any], poll_seconds: float = 0.2) -> None:
        super().__init__(name="rtj-pod-loss", daemon=True)
        self.path = path
        self.pod_uid = pod_uid
        self.initial_rank = initial_rank
        self._connect = connect
        self.poll_seconds = poll_seconds
        self._stopping = threading.Event()
        self._entered = threading.Event()
        self._state: Any = None
        self._pending: dict[str, float] = {}
        """Verdicts (pod uid) read and not applied yet, with when first read."""
        self._done: set[str] = set()
        self._seen_file: tuple[int, int] | None = None

    def enter(self, state: Any) -> None:
        """The wrapper began a restart iteration on this rank (NVRx's frozen `State`: its
        iteration, rank and world sizes); the wrapper's store is up from now on."""
        self._state = state
        self._entered.set()

    def stop(self) -> None:
        self._stopping.set()
        self._entered.set()

    def run(self) -> None:
        # Connect only once the store is up: a client that keeps trying to connect before
        # then takes one local port after another, which the store's own ports may need.
        self._entered.wait()
        base = None
        while base is None and not self._stopping.is_set():
            try:
                base = self.connect_and_register()
            except Exception as error:  # the store is gone with its host
                log.warning("pod-loss listener (rank %d): the wrapper's store: %s",
                            self.initial_rank, error)
                self._stopping.wait(2.0)
        while not self._stopping.wait(self.poll_seconds):
            try:
                self.poll_once(base)
            except Exception as error:
                log.warning("pod-loss listener (rank %d): %s", self.initial_rank, error)
                self._stopping.wait(1.0)

    def connect_and_register(self) -> Any:
        """Connect to the wrapper's store and register this rank's pod; returns the client."""
        base = self._connect()
        register(base, initial_rank=self.initial_rank, pod_uid=self.pod_uid)
        return base

    def poll_once(self, base: Any) -> None:
        """Read the shim's file if it changed, and apply what is pending."""
        try:
            stat = self.path.stat()
            fingerprint = (stat.st_mtime_ns, stat.st_size)
        except OSError:
            fingerprint = None
        if fingerprint is not None and fingerprint != self._seen_file:
            self._seen_file = fingerprint
            now = time.monotonic()
            for pod in read_verdicts(self.path):
                if pod.uid not in self._done:
                    self._pending.setdefault(pod.uid, now)
                    log.info("the operator reports pod %s lost (%s)", pod.name or pod.uid,
                             pod.cause or "no cause given")
        state = self._state
        if not self._pending or state is None:
            return
        outcome, ranks = terminate_lost_ranks(
            base, iteration=int(state.iteration), world_size=int(state.world_size),
            initial_world_size=int(state.initial_world_size), rank=int(state.rank),
            lost_uids=list(self._pending))
        if outcome == Outcome.MARKED:
            log.info("marked ranks %s of restart iteration %d terminated (their pod is lost): "
                     "the wrapper restarts without waiting for their heartbeats", ranks,
                     int(state.iteration), extra={"rank": self.initial_rank})
        if outcome != Outcome.RETRY:
            self._done.update(self._pending)
            self._pending.clear()
            return
        now = time.monotonic()
        for uid, first in list(self._pending.items()):
            if now - first > RETRY_SECONDS:
                del self._pending[uid]
                self._done.add(uid)
