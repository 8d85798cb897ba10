"""Prometheus metrics of one trainer rank, and the job ledger that makes its counters cumulative.

NVRx exports no metrics, so every rank serves its own endpoint on
`RTJ_METRICS_HOST:(RTJ_METRICS_PORT + LOCAL_RANK)` (one port per rank: a rank that hangs or dies
is visible as such, and nothing has to aggregate inside the pod). Names and labels are the
contract in docs/design.md; every series carries `rank` and `local_rank`.

Cumulative values survive restarts through files on the checkpoint volume:

- `productive_seconds_total` is saved *inside each checkpoint* (the wall seconds of the steps up
  to that checkpoint), so after a resume it counts exactly the steps that were kept;
- `job-state.json` (the ledger, rtj_trainer.ledger) holds when the job started, restarts by kind,
  and lost seconds.

The collector pulls its values from their sources on every scrape: the running attempt
(rtj_trainer.trainer.Trainer.snapshot) reads the heartbeat from `resiliency.Session` (so the
exported heartbeat is the one NVRx received, also while a checkpoint wait sends keepalive beats),
the commit figures from the Checkpointer's stats and the restart figures from the ledger. Values
are exposed through a custom collector, so a counter that goes down after an in-process restart
(productive seconds rewound to the checkpoint) reads as a counter reset.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from rtj_wire import ranks

from .ledger import RESTART_KINDS


def _name(metric: str) -> str:
    """A metric the operator reads, by its wire name (rtj_wire.ranks)."""
    return ranks.METRIC_PREFIX + metric


@dataclass(slots=True)
class Snapshot:
    """The values of one rank at one moment; built from the sources on every scrape."""

    heartbeat_timestamp: float = 0.0
    step: int = 0
    step_seconds: float = 0.0
    tokens_per_second: float = 0.0
    checkpoint_stall_seconds: float = 0.0
    checkpoint_write_seconds: float = 0.0
    checkpoint_committed_step: int = -1
    checkpoint_committed_timestamp: float = 0.0
    restarts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESTART_KINDS, 0))
    productive_seconds: float = 0.0
    lost_seconds: float = 0.0
    job_started_at: float = field(default_factory=time.time)

    def goodput(self, now: float | None = None) -> float:
        wall = (now or time.time()) - self.job_started_at
        return self.productive_seconds / wall if wall > 0 else 0.0


class _SnapshotCollector(Collector):
    def __init__(self, metrics: TrainerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        m = self.metrics
        s = m.snapshot()
        base = [ranks.RANK_LABEL, "local_rank"]
        ids = [str(m.rank), str(m.local_rank)]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=base)
            family.add_metric(ids, value)
            return family

        yield gauge(_name(ranks.HEARTBEAT),
                    "Unix time of the last heartbeat sent to the NVRx rank monitor",
                    s.heartbeat_timestamp)
        yield gauge(_name(ranks.STEP), "Last completed optimizer step", s.step)
        yield gauge("rtj_trainer_step_seconds", "Duration of the last step", s.step_seconds)
        yield gauge("rtj_trainer_tokens_per_second", "Throughput of the last step on this rank",
                    s.tokens_per_second)
        yield gauge("rtj_trainer_checkpoint_stall_seconds",
                    "How long the last checkpoint blocked the step loop",
                    s.checkpoint_stall_seconds)
        yield gauge("rtj_trainer_checkpoint_write_seconds",
                    "How long the last checkpoint took until committed", s.checkpoint_write_seconds)
        yield gauge(_name(ranks.COMMITTED_STEP),
                    "Step of the newest committed checkpoint (-1 none)",
                    s.checkpoint_committed_step)
        yield gauge(_name(ranks.COMMITTED_TIME),
                    "When the newest checkpoint was committed", s.checkpoint_committed_timestamp)
        restarts = CounterMetricFamily(_name(ranks.RESTARTS).removesuffix("_total"),
                                       "Restarts seen by this job",
                                       labels=[*base, ranks.KIND_LABEL])
        for kind in RESTART_KINDS:
            restarts.add_metric([*ids, kind], s.restarts.get(kind, 0))
        yield restarts
        productive = CounterMetricFamily("rtj_trainer_productive_seconds",
                                         "Wall seconds spent in steps that were kept", labels=base)
        productive.add_metric(ids, s.productive_seconds)
        yield productive
        lost = CounterMetricFamily("rtj_trainer_lost_seconds",
                                   "Wall seconds lost to faults (recomputed steps, restarts)",
                                   labels=base)
        lost.add_metric(ids, s.lost_seconds)
        yield lost
        yield gauge(_name(ranks.GOODPUT), "Productive / wall seconds since the job started",
                    s.goodput())
        yield gauge(_name(ranks.STANDBY),
                    "1 while this rank waits as a warm spare (inactive in the in-process wrapper)",
                    1.0 if m.standby() else 0.0)
        info = GaugeMetricFamily("rtj_trainer_info", "Trainer identity",
                                 labels=[*base, "job_name", "attempt"])
        info.add_metric([*ids, m.job, str(m.attempt)], 1)
        yield info


class TrainerMetrics:
    """The rank's metrics source plus (optionally) the HTTP endpoint serving it.

    One per worker process; each attempt (in-process restarts make several) `watch`es it with
    its own source and `unwatch`es it when it ends, which keeps the attempt's last values."""

    def __init__(self, *, rank: int, local_rank: int, job: str, attempt: int) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.job = job
        self.attempt = attempt
        initial = Snapshot()
        self._source: Callable[[], Snapshot] = lambda: initial
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SnapshotCollector(self))
        self._server: Any = None
        self.port: int | None = None
        self.standby: Callable[[], bool] = lambda: False
        """Whether this rank is a warm spare right now (set by __main__ from the wrapper)."""

    def snapshot(self) -> Snapshot:
        """The current values, read from the source now."""
        return self._source()

    def watch(self, source: Callable[[], Snapshot]) -> None:
        """Read the values from `source` from now on (called by every scrape)."""
        self._source = source

    def unwatch(self) -> None:
        """Keep the values as they are now and let go of the source (and what it holds)."""
        last = self._source()
        self._source = lambda: last

    def serve(self, host: str, base_port: int) -> int:
        """Start the endpoint on host:(base_port + local_rank); returns the port."""
        port = base_port + self.local_rank if base_port else 0
        result = start_http_server(port, addr=host, registry=self.registry)
        self._server = result[0] if isinstance(result, tuple) else None
        if self._server is not None:
            port = self._server.server_address[1]
        self.port = port
        return port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
