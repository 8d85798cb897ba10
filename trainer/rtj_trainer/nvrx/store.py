"""The in-process wrapper's store, as the pod-loss listener reads and marks it.

Runs in the training worker's pod-loss thread (rtj_trainer.podloss). The operator's verdict that
a peer pod is gone is applied exactly as NVRx's sibling monitor applies a rank whose heartbeats
stopped: `mark_terminated` calls `SiblingMonitor.terminate_unresponsive_ranks` (the UNRESPONSIVE
interruption records, the terminated ranks, the iteration and termination barriers on their
behalf). To do so it reads two of NVRx's store keys by name (`INITIAL_RANK`, and the key the last
rank to reach an iteration's barrier sets, `ITERATION_DONE_KEY`), guarded in `PATCHES`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .guards import Patch, Target

ITERATION_DONE_KEY = ("inprocess_barrier_prefix:reentrant_barrier:iteration_barrier:"
                      "last_worker_arrived")
"""NVRx's key (inprocess/store.py: BARRIER_PREFIX, the reentrant barrier's name,
ITERATION_BARRIER) that the last rank to arrive at an iteration's barrier sets: the iteration is
over."""

_IP = "nvidia_resiliency_ext.inprocess"
PATCHES = (
    Patch("the wrapper's store read by name",
          "a lost pod's ranks are marked as the sibling monitor marks silent ranks",
          (Target(f"{_IP}.store:StoreMixin", "160f56628c51cdc8"),
           Target(f"{_IP}.store:PrefixStore", "2edbae7184d2ea6a"),
           Target(f"{_IP}.sibling_monitor:SiblingMonitor.terminate_unresponsive_ranks",
                  "8e500f8ef4130594"))),
)


def client(host: str, port: int, *, connect_seconds: float, op_seconds: float) -> Any:
    """A client of the in-process wrapper's TCPStore (NVRx's `StoreMixin` API on it). It never
    counts as one of the store's workers (`wait_for_workers=False`)."""
    from nvidia_resiliency_ext.inprocess.store import StoreMixin
    from torch._C._distributed_c10d import TCPStore

    class WrapperStoreClient(TCPStore, StoreMixin):  # type: ignore[misc]
        pass

    store = WrapperStoreClient(host_name=host, port=port, is_master=False,
                               timeout=timedelta(seconds=connect_seconds),
                               wait_for_workers=False, use_libuv=True)
    store.set_timeout(timedelta(seconds=op_seconds))
    return store


@dataclass(frozen=True, slots=True)
class IterationView:
    """Where restart iteration `iteration` stands in the wrapper's store."""

    open: bool
    """Every rank entered it and its barrier has not completed: ranks can still be marked."""
    initial_rank_of: tuple[int, ...] = ()
    """Each rank's initial rank (index: the rank in this iteration)."""
    terminated: frozenset[int] = frozenset()


def iteration_view(base: Any, *, iteration: int, world_size: int) -> IterationView:
    from nvidia_resiliency_ext.inprocess.store import PrefixStore, StoreMixin

    store = PrefixStore(iteration, base)
    keys = [StoreMixin.INITIAL_RANK.format(rank=r) for r in range(world_size)]
    if store.check([ITERATION_DONE_KEY]) or not store.check(keys):
        return IterationView(open=False)
    return IterationView(open=True,
                         initial_rank_of=tuple(int(v) for v in store.multi_get(keys)),
                         terminated=frozenset(store.get_terminated_ranks()))


def mark_terminated(base: Any, *, iteration: int, rank: int, world_size: int,
                    initial_world_size: int, ranks: Iterable[int]) -> None:
    """Mark `ranks` terminated in `iteration` as NVRx's sibling monitor does."""
    from nvidia_resiliency_ext.inprocess.sibling_monitor import SiblingMonitor
    from nvidia_resiliency_ext.inprocess.store import PrefixStore

    monitor = SiblingMonitor(store=PrefixStore(iteration, base), rank=rank,
                             world_size=world_size, initial_world_size=initial_world_size,
                             timeout=timedelta(0), interval=timedelta(seconds=1))
    monitor.terminate_unresponsive_ranks(set(ranks))
