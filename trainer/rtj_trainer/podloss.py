"""The operator's word that a peer pod is gone, turned into what NVRx's sibling monitor would do.

Why: when a whole pod is lost (its launcher, workers and NVRx monitor processes die together),
NVRx's in-process wrapper learns of it only from its sibling heartbeats: the survivors' gloo
collectives fail at once, but they then wait in the wrapper's iteration barrier until the lost
ranks' heartbeats are older than `resiliency.inprocess_pod_loss_timeout_seconds` (10 s), when a
sibling monitor arrives there on their behalf. Only then can a warm spare take the lost ranks
over. Kubernetes knows sooner, and knows for certain: the operator sees the pod `Failed` (every
container ended) or gone from the API within a second or two, and posts a *verdict* to every
other trainer pod of the job, `POST /lost-pods` on the launcher shim's pod endpoint
(rtj_trainer.podmetrics):

    {"pods": [{"uid": "5b0c...", "name": "job-1", "cause": "PodFailed"}]}

The path from there:

- the shim (`VerdictBook`) keeps the newest verdicts in a pod-local file, `RTJ_LOST_PODS_FILE`,
  which it exports to its workers (it refuses a verdict naming its own pod);
- every worker under in-process restart runs a `PodLossListener` thread. Once the wrapper runs
  (its first restart iteration begins) it registers its pod's UID for its initial rank in the
  wrapper's store (`rtj_pod_uids`), so a verdict names processes, never a pod name that a
  replacement pod reuses, nor a rank number that a spare takes over. It polls the file; for a
  new verdict it marks the ranks registered with that UID terminated in the restart iteration
  it is in **exactly as NVRx's sibling monitor marks ranks whose heartbeats stopped** (it calls
  `SiblingMonitor.terminate_unresponsive_ranks`: the `UNRESPONSIVE` interruption records, the
  terminated ranks, the iteration and termination barriers on their behalf), so the barrier
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
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from enum import Enum
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PATH = "/lost-pods"
"""Where the shim's pod endpoint accepts verdicts (POST)."""
FILE_ENV = "RTJ_LOST_PODS_FILE"
"""The variable through which the shim tells its workers where its verdict file is."""
MAX_PODS = 64
"""Most pods one verdict may name, and most verdicts the shim keeps."""
MAX_FIELD_CHARS = 253
REGISTRY_KEY = "rtj_pod_uids"
"""Key in the wrapper's base store: `<initial rank>=<pod uid>,` for every rank of the cycle."""
RETRY_SECONDS = 60.0
"""How long a worker keeps trying a verdict it could not apply yet (an iteration changing)."""


class VerdictError(ValueError):
    """A verdict document of the wrong shape; the message names the field."""


@dataclass(frozen=True, slots=True)
class LostPod:
    """One pod the operator found gone: every process of it ended."""

    uid: str
    name: str
    cause: str

    def to_json(self) -> dict[str, str]:
        return {"uid": self.uid, "name": self.name, "cause": self.cause}


def _text(record: Mapping[str, Any], key: str, where: str, *, required: bool) -> str:
    value = record.get(key, "")
    if not isinstance(value, str) or len(value) > MAX_FIELD_CHARS or (required and not value):
        raise VerdictError(f"{where}.{key}: expected a {'non-empty ' if required else ''}string "
                           f"of at most {MAX_FIELD_CHARS} characters, got {value!r}")
    return value


def parse_verdict(document: Any) -> list[LostPod]:
    """The pods a `POST /lost-pods` body names; VerdictError names the bad field."""
    if not isinstance(document, dict):
        raise VerdictError("expected a JSON object with a `pods` list")
    pods = document.get("pods")
    if not isinstance(pods, list) or not 1 <= len(pods) <= MAX_PODS:
        raise VerdictError(f"pods: expected a list of 1 to {MAX_PODS} objects, got {pods!r}")
    found = []
    for n, record in enumerate(pods):
        where = f"pods[{n}]"
        if not isinstance(record, dict):
            raise VerdictError(f"{where}: expected an object, got {record!r}")
        found.append(LostPod(uid=_text(record, "uid", where, required=True),
                             name=_text(record, "name", where, required=False),
                             cause=_text(record, "cause", where, required=False)))
    return found


def default_file() -> Path:
    """The shim's verdict file when none is configured: pod-local, one per launcher process."""
    return Path(tempfile.gettempdir()) / f"rtj-lost-pods-{os.getpid()}.json"


def read_verdicts(path: Path) -> list[LostPod]:
    """What the shim's file holds now ([] when it does not exist or cannot be read yet)."""
    try:
        return parse_verdict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return []


class VerdictBook:
    """The shim's side: keep the newest verdicts in the pod-local file its workers poll."""

    def __init__(self, path: Path, *, own_uid: str = "") -> None:
        self.path = path
        self.own_uid = own_uid
        self._pods: dict[str, LostPod] = {}
        self._lock = threading.Lock()

    def record(self, pods: Iterable[LostPod]) -> list[LostPod]:
        """Add the verdicts this pod had not heard yet (never one naming this pod itself) and
        rewrite the file at once (readers see the old file or the new one); returns them."""
        with self._lock:
            new = [p for p in pods if p.uid != self.own_uid and p.uid not in self._pods]
            if not new:
                return []
            for pod in new:
                self._pods[pod.uid] = pod
            while len(self._pods) > MAX_PODS:
                del self._pods[next(iter(self._pods))]
            tmp = self.path.with_name(f".{self.path.name}.tmp")
            tmp.write_text(json.dumps({"pods": [p.to_json() for p in self._pods.values()]}))
            os.replace(tmp, self.path)
            return new


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


ITERATION_DONE_KEY = ("inprocess_barrier_prefix:reentrant_barrier:iteration_barrier:"
                      "last_worker_arrived")
"""NVRx's key (inprocess/store.py: BARRIER_PREFIX, the reentrant barrier's name,
ITERATION_BARRIER) that the last rank to arrive at an iteration's barrier sets: the iteration is
over."""


def store_client(host: str, port: int, *, connect_seconds: float, op_seconds: float) -> Any:
    """A client of the in-process wrapper's TCPStore (NVRx's `StoreMixin` API on it). It never
    counts as one of the store's workers (`wait_for_workers=False`)."""
    from nvidia_resiliency_ext.inprocess.store import StoreMixin
    from torch._C._distributed_c10d import TCPStore

    class WrapperStoreClient(TCPStore, StoreMixin):  # type: ignore[misc]
        pass

    client = WrapperStoreClient(host_name=host, port=port, is_master=False,
                                timeout=timedelta(seconds=connect_seconds),
                                wait_for_workers=False, use_libuv=True)
    client.set_timeout(timedelta(seconds=op_seconds))
    return client


def register(base: Any, *, initial_rank: int, pod_uid: str) -> None:
    """Record in the wrapper's base store that `initial_rank` runs in the pod `pod_uid`."""
    base.append(REGISTRY_KEY, registry_entry(initial_rank, pod_uid))


def terminate_lost_ranks(
    base: Any, *, iteration: int, world_size: int, initial_world_size: int, rank: int,
    lost_uids: Iterable[str],
) -> tuple[Outcome, list[int]]:
    """Mark the ranks of the lost pods terminated in restart iteration `iteration` (world size
    `world_size`), as NVRx's sibling monitor does for ranks whose heartbeats stopped."""
    from nvidia_resiliency_ext.inprocess.sibling_monitor import SiblingMonitor
    from nvidia_resiliency_ext.inprocess.store import PrefixStore, StoreMixin

    base.append(REGISTRY_KEY, "")
    registry = parse_registry(base.get(REGISTRY_KEY).decode())
    lost = set(lost_uids)
    if not any(uid in lost for uid in registry.values()):
        return Outcome.NOTHING, []
    store = PrefixStore(iteration, base)
    keys = [StoreMixin.INITIAL_RANK.format(rank=r) for r in range(world_size)]
    if store.check([ITERATION_DONE_KEY]) or not store.check(keys):
        return Outcome.RETRY, []
    initial_rank_of = [int(value) for value in store.multi_get(keys)]
    ranks = ranks_to_terminate(lost, registry, initial_rank_of, store.get_terminated_ranks())
    if not ranks:
        return Outcome.NOTHING, []
    monitor = SiblingMonitor(store=store, rank=rank, world_size=world_size,
                             initial_world_size=initial_world_size, timeout=timedelta(0),
                             interval=timedelta(seconds=1))
    monitor.terminate_unresponsive_ranks(ranks)
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
