"""The simulated ranks of `bench.rdzv_store`, and what every simulated client shares.

Shared: `OpStats` (the store calls by phase and name: count, seconds, the slowest, bytes read),
`TimedStore` (a launcher's TCPStore, every call timed into an OpStats), `error_text`, `spread`.
The ranks are the in-process wrapper's: in each worker process, `RankClients` runs one thread per
`nvidia_resiliency_ext.inprocess.store.TCPStore` client of the wrapper's own store, each making
its ranks' calls as `CallWrapper` does (`timed_rank_store_classes`: NVRx's classes, every call
timed). On the parent's side, `rank_clients_by_worker` deals the clients out to the workers and
`rank_barrier_figures` turns their records into the rank phase's figures.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any


class OpStats:
    """Store calls by phase and name: count, seconds in all, the slowest, bytes read."""

    def __init__(self) -> None:
        self.table: dict[str, dict[str, list[float]]] = {}

    def note(self, phase: str, op: str, seconds: float, read: int = 0) -> None:
        row = self.table.setdefault(phase, {}).setdefault(op, [0, 0.0, 0.0, 0])
        row[0] += 1
        row[1] += seconds
        row[2] = max(row[2], seconds)
        row[3] += read

    def merge(self, other: dict[str, dict[str, list[float]]]) -> None:
        for phase, ops in other.items():
            for op, (count, seconds, slowest, read) in ops.items():
                row = self.table.setdefault(phase, {}).setdefault(op, [0, 0.0, 0.0, 0])
                row[0] += count
                row[1] += seconds
                row[2] = max(row[2], slowest)
                row[3] += read

    @staticmethod
    def merged(parts: Iterable[OpStats]) -> OpStats:
        """One OpStats of every call in `parts` (the threads' own)."""
        merged = OpStats()
        for stats in parts:
            merged.merge(stats.table)
        return merged

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        return {phase: {op: {"count": int(count), "seconds": round(seconds, 3),
                             "mean_ms": round(1000 * seconds / count, 3) if count else 0.0,
                             "max_ms": round(1000 * slowest, 1), "bytes_read": int(read)}
                        for op, (count, seconds, slowest, read) in sorted(ops.items())}
                for phase, ops in self.table.items()}


def _read_size(value: Any) -> int:
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    if isinstance(value, list):
        return sum(len(v) for v in value if isinstance(v, (bytes, bytearray)))
    return 0


STORE_CALLS = frozenset({"add", "append", "check", "compare_set", "delete_key", "get",
                         "multi_get", "multi_set", "num_keys", "set", "wait"})


class TimedStore:
    """A launcher's TCPStore as NVRx's barrier state uses it: every call timed by name, under
    the phase the launcher is in."""

    def __init__(self, store: Any, stats: OpStats) -> None:
        self._store = store
        self._stats = stats
        self.phase = "connect"

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if name not in STORE_CALLS:
            return attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            began = time.perf_counter()
            result = None
            try:
                result = attr(*args, **kwargs)
                return result
            finally:
                self._stats.note(self.phase, name, time.perf_counter() - began,
                                 _read_size(result))
        return timed


def error_text(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}".replace("\n", " ")[:300]


def spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))], 3)

    return {"p50": at(0.5), "p99": at(0.99), "max": round(ordered[-1], 3)}


def timed_rank_store_classes() -> tuple[type, type]:
    """NVRx's in-process store classes (inprocess.store.TCPStore and PrefixStore, StoreMixin's
    barriers on them) with every call timed: StoreMixin calls `self.add`, `self.wait`, ..."""
    from nvidia_resiliency_ext.inprocess import store as inprocess_store

    class Timed:
        _stats: OpStats | None = None
        _phase = "connect"

        def _call(self, name: str, call: Callable[..., Any], *args: Any, **kw: Any) -> Any:
            began = time.perf_counter()
            result = None
            try:
                result = call(*args, **kw)
                return result
            finally:
                if self._stats is not None:
                    self._stats.note(self._phase, name, time.perf_counter() - began,
                                     _read_size(result))

        def add(self, *a: Any, **k: Any) -> Any:
            return self._call("add", super().add, *a, **k)  # type: ignore[misc]

        def append(self, *a: Any, **k: Any) -> Any:
            return self._call("append", super().append, *a, **k)  # type: ignore[misc]

        def check(self, *a: Any, **k: Any) -> Any:
            return self._call("check", super().check, *a, **k)  # type: ignore[misc]

        def get(self, *a: Any, **k: Any) -> Any:
            return self._call("get", super().get, *a, **k)  # type: ignore[misc]

        def multi_get(self, *a: Any, **k: Any) -> Any:
            return self._call("multi_get", super().multi_get, *a, **k)  # type: ignore[misc]

        def set(self, *a: Any, **k: Any) -> Any:
            return self._call("set", super().set, *a, **k)  # type: ignore[misc]

        def wait(self, *a: Any, **k: Any) -> Any:
            return self._call("wait", super().wait, *a, **k)  # type: ignore[misc]

    class RankStore(Timed, inprocess_store.TCPStore):  # type: ignore[misc]
        pass

    class RankPrefixStore(Timed, inprocess_store.PrefixStore):  # type: ignore[misc]
        pass

    return RankStore, RankPrefixStore


class RankClients:
    """One worker process's share of the ranks: a thread per client of the wrapper's store, each
    making its ranks' calls. Results go to `results` as (phase, client, dict)."""

    def __init__(self, results: queue.Queue[tuple[str, int, dict[str, Any]]]) -> None:
        self.results = results
        self.stats: list[OpStats] = []
        self.go = threading.Event()
        self.threads: list[threading.Thread] = []

    def start(self, arg: dict[str, Any]) -> None:
        """Connect every client of `arg["clients"]` ((client, its ranks) each); each reports
        "ranks-connect", then waits for `go` to make its calls and report "ranks-run"."""
        os.environ["RANK"] = "1"  # inprocess.store.TCPStore: a rank other than 0 is a client
        store_class, prefix_class = timed_rank_store_classes()
        for client, ranks in arg["clients"]:
            thread = threading.Thread(target=self._ranks, daemon=True, name=f"ranks-{client}",
                                      args=(client, ranks, arg, store_class, prefix_class))
            self.threads.append(thread)
            thread.start()

    def _ranks(self, client: int, ranks: list[int], arg: dict[str, Any], store_class: Any,
               prefix_class: Any) -> None:
        world = int(arg["world"])
        wait = timedelta(seconds=float(arg["barrier_timeout"]))
        stats = OpStats()
        self.stats.append(stats)
        phase = "ranks-connect"
        try:
            began = time.monotonic()
            # The trainer's store_kwargs (port, 120 s); NVRx's defaults otherwise
            # (wait_for_workers: each client adds itself to the store's init key).
            base = store_class(host_name=arg["host"], port=int(arg["port"]), world_size=world,
                               timeout=timedelta(seconds=120))
            base._stats, base._phase = stats, "connect"
            self.results.put((phase, client, {"start": began, "end": time.monotonic()}))
            phase = "ranks-run"
            self.go.wait()
            base._phase = "initial_barrier"
            initial = time.monotonic()
            for rank in ranks:  # CallWrapper.__init__
                base.initial_barrier(ranks=[rank], rendezvous_count=world,
                                     timeout=wait if rank == ranks[-1] else timedelta(0))
                base.set_initial_rank(rank, rank)
            passed = time.monotonic()
            store = prefix_class(0, base)  # CallWrapper.__call__, iteration 0
            store._stats, store._phase = stats, "iteration_barrier"
            for rank in ranks:
                store.set_initial_rank(rank, rank)
            faulted = time.monotonic()
            for rank in ranks:  # a restart in place: every rank at the iteration barrier
                store.iteration_barrier(ranks=[rank], rendezvous_count=world,
                                        timeout=wait if rank == ranks[-1] else timedelta(0))
            for _rank in ranks:
                store.get_terminated_ranks()
            self.results.put((phase, client, {"initial": initial, "passed": passed,
                                              "faulted": faulted, "done": time.monotonic()}))
        except BaseException as exc:
            self.results.put((phase, client, {"error": error_text(exc)}))


def rank_clients_by_worker(ranks: int, rank_clients: int, workers: int
                           ) -> tuple[int, list[tuple[int, list[int]]],
                                      list[list[tuple[int, list[int]]]]]:
    """The ranks per client, the clients (client, its ranks) and each worker's share of them."""
    per_client = -(-ranks // rank_clients)
    clients = [(c, list(range(c * per_client, min(ranks, (c + 1) * per_client))))
               for c in range(rank_clients) if c * per_client < ranks]
    share: list[list[tuple[int, list[int]]]] = [[] for _ in range(workers)]
    for position, client in enumerate(clients):
        share[position % workers].append(client)
    return per_client, clients, share


def rank_barrier_figures(ranks: int, per_client: int, clients: int,
                         connected: dict[int, dict[str, Any]], records: dict[int, dict[str, Any]]
                         ) -> dict[str, Any]:
    """The rank phase's figures from the clients' "ranks-connect" and "ranks-run" records."""
    ok = [r for r in records.values() if "error" not in r]
    complete = len(ok) == clients
    starts = [r["start"] for r in connected.values() if "error" not in r]
    latencies = sorted(r["end"] - r["start"] for r in connected.values() if "error" not in r)
    return {
        "ranks": ranks, "clients": clients, "ranks_per_client": per_client,
        "completed_clients": len(ok),
        "connect_seconds": round(max(r["end"] for r in connected.values() if "error" not in r)
                                 - min(starts), 3) if starts else None,
        "per_client_connect_seconds": spread(latencies),
        "initial_barrier_seconds": round(max(r["passed"] for r in ok)
                                         - min(r["initial"] for r in ok), 3)
        if complete else None,
        "iteration_barrier_seconds": round(max(r["done"] for r in ok)
                                           - min(r["faulted"] for r in ok), 3)
        if complete else None,
    }
