"""Prometheus metrics of one trainer rank, and the job ledger that makes its counters cumulative.

NVRx exports no metrics, so every rank serves its own endpoint on
`RTJ_METRICS_HOST:(RTJ_METRICS_PORT + LOCAL_RANK)` (one port per rank: a rank that hangs or dies
is visible as such, and nothing has to aggregate inside the pod). Names and labels are the
contract in docs/design.md; every series carries `rank` and `local_rank`.

Cumulative values survive restarts through files on the checkpoint volume:

- `productive_seconds_total` is saved *inside each checkpoint* (the wall seconds of the steps up
  to that checkpoint), so after a resume it counts exactly the steps that were kept;
- `job-state.json` (the ledger, written by rank 0 with tmp+rename) holds when the job started,
  restarts by kind, and lost seconds. Lost seconds at a resume are "now minus the moment the
  resumed step first completed": the recomputed steps, failure detection, restart and reload.

Values are exposed through a custom collector, so a counter that goes down after an in-process
restart (productive seconds rewound to the checkpoint) reads as a counter reset.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

RESTART_KINDS = ("inprocess", "launcher", "pod")
LEDGER_FILE = "job-state.json"


@dataclass(slots=True)
class Ledger:
    """Job-wide facts shared by every attempt (persisted as job-state.json)."""

    started_at: float
    restarts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESTART_KINDS, 0))
    lost_seconds: float = 0.0
    pod_attempts: dict[str, int] = field(default_factory=dict)
    launcher_restart_count: int = 0
    inprocess_iteration: int = 0

    @classmethod
    def read(cls, path: Path) -> Ledger | None:
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return cls(**data)

    def write(self, path: Path) -> None:
        from .checkpoint import write_json_atomic

        write_json_atomic(path, asdict(self))


def classify_restart(
    previous: Ledger | None,
    *,
    pod_attempts: dict[str, int],
    launcher_restart_count: int,
    inprocess_iteration: int,
) -> str | None:
    """Which restart (if any) brought this attempt up, from the last attempt's identity."""
    if previous is None:
        return None
    if any(a > previous.pod_attempts.get(node, 0) for node, a in pod_attempts.items()):
        return "pod"
    if launcher_restart_count != previous.launcher_restart_count:
        return "launcher"
    if inprocess_iteration != previous.inprocess_iteration:
        return "inprocess"
    return "launcher"  # a new worker with an unchanged identity: count it, do not hide it


def advance_ledger(
    previous: Ledger | None,
    *,
    now: float,
    pod_attempts: dict[str, int],
    launcher_restart_count: int,
    inprocess_iteration: int,
    resumed_step_completed_at: float | None,
) -> Ledger:
    """The ledger for a new attempt: count its restart and the seconds the fault cost."""
    ledger = Ledger(started_at=now) if previous is None else Ledger(**asdict(previous))
    kind = classify_restart(previous, pod_attempts=pod_attempts,
                            launcher_restart_count=launcher_restart_count,
                            inprocess_iteration=inprocess_iteration)
    if kind is not None:
        ledger.restarts[kind] = ledger.restarts.get(kind, 0) + 1
        since = resumed_step_completed_at if resumed_step_completed_at else ledger.started_at
        ledger.lost_seconds += max(0.0, now - since)
    ledger.pod_attempts = {**ledger.pod_attempts, **pod_attempts}
    ledger.launcher_restart_count = launcher_restart_count
    ledger.inprocess_iteration = inprocess_iteration
    return ledger


@dataclass(slots=True)
class Snapshot:
    """Current values of one rank; the collector reads it on every scrape."""

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
        s = m.snapshot
        base = ["rank", "local_rank"]
        ids = [str(m.rank), str(m.local_rank)]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=base)
            family.add_metric(ids, value)
            return family

        yield gauge("rtj_trainer_heartbeat_timestamp_seconds",
                    "Unix time of the last heartbeat sent to the NVRx rank monitor",
                    s.heartbeat_timestamp)
        yield gauge("rtj_trainer_step", "Last completed optimizer step", s.step)
        yield gauge("rtj_trainer_step_seconds", "Duration of the last step", s.step_seconds)
        yield gauge("rtj_trainer_tokens_per_second", "Throughput of the last step on this rank",
                    s.tokens_per_second)
        yield gauge("rtj_trainer_checkpoint_stall_seconds",
                    "How long the last checkpoint blocked the step loop",
                    s.checkpoint_stall_seconds)
        yield gauge("rtj_trainer_checkpoint_write_seconds",
                    "How long the last checkpoint took until committed", s.checkpoint_write_seconds)
        yield gauge("rtj_trainer_checkpoint_committed_step",
                    "Step of the newest committed checkpoint (-1 none)",
                    s.checkpoint_committed_step)
        yield gauge("rtj_trainer_checkpoint_committed_timestamp_seconds",
                    "When the newest checkpoint was committed", s.checkpoint_committed_timestamp)
        restarts = CounterMetricFamily("rtj_trainer_restarts", "Restarts seen by this job",
                                       labels=[*base, "kind"])
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
        yield gauge("rtj_trainer_goodput_ratio", "Productive / wall seconds since the job started",
                    s.goodput())
        info = GaugeMetricFamily("rtj_trainer_info", "Trainer identity",
                                 labels=[*base, "job", "attempt"])
        info.add_metric([*ids, m.job, str(m.attempt)], 1)
        yield info


class TrainerMetrics:
    """The rank's snapshot plus (optionally) the HTTP endpoint serving it."""

    def __init__(self, *, rank: int, local_rank: int, job: str, attempt: int) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.job = job
        self.attempt = attempt
        self.snapshot = Snapshot()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_SnapshotCollector(self))
        self._server: Any = None
        self.port: int | None = None

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
