"""The operator's own Prometheus metrics, served on their own port (`RTJ_OPERATOR_METRICS_PORT`).

The `rtj_operator_*` families describe the operator: how many passes it runs and how long they
take, which actions it applies, how many jobs are in each state, and how long recoveries took.
The `rtj_job_*` families describe each job as its last pass wrote its status (labels
`namespace` and `job_name`, not `job`, which Prometheus gives the scrape job;
`record_job_status`): its state, goodput, restarts by kind, newest committed checkpoint, ranks by
state and spares. They are what the chart's alerts and Grafana dashboard read
(charts/rtj-operator/files/); the trainers' own `rtj_trainer_*` metrics (per rank) are scraped by
the operator and may be scraped by Prometheus too.

Names follow Prometheus conventions: base units (seconds, ratios), `_total` on counters (the
client library adds it to the Counter names below), `_timestamp_seconds` for Unix times.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from rtj_operator.api.status import RankStatus, ResilientTrainingJobStatus
from rtj_operator.api.vocabulary import JobState, RankState

REGISTRY = CollectorRegistry()

RECONCILE_PASSES = Counter(
    "rtj_operator_reconcile_passes", "Reconcile passes, by outcome.", ["outcome"],
    registry=REGISTRY,
)
RECONCILE_SECONDS = Histogram(
    "rtj_operator_reconcile_seconds",
    "Duration of one reconcile pass (observe, decide, act), by what woke it: `start` (a new "
    "job, a spec change, the operator's start: it reads every pod's liveness itself), "
    "`interval` (the level-based pass, on a read of every pod made just before), `pods` (a "
    "pod changed: last reads reused), `deadline` (reads only the pods whose heartbeat "
    "deadline came).",
    ["trigger"], buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10), registry=REGISTRY,
)
for _trigger in ("start", "interval", "pods", "deadline"):
    RECONCILE_SECONDS.labels(trigger=_trigger)  # every series exists from the start
LIVENESS_READ_SECONDS = Histogram(
    "rtj_operator_liveness_read_seconds",
    "Duration of reading the liveness of every running trainer pod of one job (in the "
    "background, before the interval's pass).",
    buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30), registry=REGISTRY,
)
DEADLINE_READS = Counter(
    "rtj_operator_deadline_reads",
    "Pods read at their heartbeat deadline by the job's loop itself, by outcome: `renewed` (a "
    "newer, fresh heartbeat and nothing else new: the deadline moved, no pass ran) or `pass` "
    "(the read needs a pass: a stale heartbeat, no answer, a restart, a spare's change).",
    ["outcome"], registry=REGISTRY,
)
HEARTBEAT_STALE = Counter(
    "rtj_operator_heartbeat_stale",
    "Episodes of a pod's heartbeat going stale (rank state Unresponsive, Event HeartbeatStale).",
    registry=REGISTRY,
)
HEARTBEAT_STALE_DETECTION_SECONDS = Histogram(
    "rtj_operator_heartbeat_stale_detection_seconds",
    "Seconds from the moment a pod's heartbeat went stale (its last heartbeat + "
    "heartbeatTimeoutSeconds) to the pass that saw it.",
    buckets=(0.1, 0.25, 0.5, 1, 2, 3, 5, 10, 30), registry=REGISTRY,
)
ACTIONS = Counter(
    "rtj_operator_actions", "Actions applied, by kind.", ["action"], registry=REGISTRY,
)
RESTARTS = Counter(
    "rtj_operator_restarts", "Recoveries the operator started, by action.", ["action"],
    registry=REGISTRY,
)
JOBS = Gauge(
    "rtj_operator_jobs", "Jobs by state, as of their last pass.", ["state"], registry=REGISTRY,
)
LEADER = Gauge(
    "rtj_operator_leader",
    "1 while this replica holds the leader-election Lease (or runs without leader election).",
    registry=REGISTRY,
)

RECOVERY_SECONDS = Histogram(
    "rtj_operator_recovery_seconds",
    "Seconds from detecting a fault to the job training again (an incident's `seconds`), by "
    "recovery action.",
    ["action"],
    buckets=(1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, 1800),
    registry=REGISTRY,
)

API_REQUESTS = Counter(
    "rtj_operator_api_requests",
    "Kubernetes API requests made by the operator's own client (its passes' LISTs, creates, "
    "deletes and status patches, the node list, the Lease), by HTTP verb; kopf's watches and "
    "Event posts are not counted.",
    ["verb"],
    registry=REGISTRY,
)


def count_api_requests(api: Any) -> Any:
    """`api` (a kubernetes ApiClient), its every request counted in API_REQUESTS."""
    rest = api.rest_client
    send = rest.request

    def request(method: str, *args: Any, **kwargs: Any) -> Any:
        API_REQUESTS.labels(str(method).upper()).inc()
        return send(method, *args, **kwargs)

    rest.request = request
    return api


_job_states: dict[str, str] = {}


def record_job_state(job_key: str, state: str | None) -> None:
    """Remember a job's state (None when the job is gone) and refresh the per-state gauge."""
    if state is None:
        _job_states.pop(job_key, None)
    else:
        _job_states[job_key] = str(state)
    counts: dict[str, int] = {}
    for value in _job_states.values():
        counts[value] = counts.get(value, 0) + 1
    for known in JobState:
        JOBS.labels(state=known.value).set(counts.get(known.value, 0))


RESTART_KINDS = ("rank", "full", "launcher", "in_process", "spare")


@dataclass
class _JobView:
    state: str | None = None
    goodput: float | None = None
    step: int | None = None
    checkpoint_step: int | None = None
    checkpoint_time: float | None = None
    restarts: dict[str, int] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)
    spares_desired: int = 0
    spares_ready: int = 0
    recovered: set[tuple[str, str]] = field(default_factory=set)
    """Incidents (cause, detected time) already observed in RECOVERY_SECONDS."""


_jobs: dict[tuple[str, str], _JobView] = {}
_jobs_lock = threading.Lock()


def _goodput_ratio(text: str | None) -> float | None:
    if not text:
        return None
    try:
        return float(text.rstrip("%")) / 100.0
    except ValueError:
        return None


def record_job_status(namespace: str, name: str,
                      status: ResilientTrainingJobStatus | None) -> None:
    """Remember what a pass wrote to a job's status (None: the job is gone), and observe each
    incident that recovered since the last pass in RECOVERY_SECONDS (once)."""
    key = (namespace, name)
    with _jobs_lock:
        if status is None:
            _jobs.pop(key, None)
            return
        view = _jobs.setdefault(key, _JobView())
        view.state = str(status.state) if status.state is not None else None
        view.goodput = _goodput_ratio(status.goodput)
        view.step = status.step
        checkpoint = status.last_checkpoint
        view.checkpoint_step = checkpoint.step if checkpoint is not None else None
        view.checkpoint_time = (checkpoint.time.timestamp()
                                if checkpoint is not None and checkpoint.time is not None
                                else None)
        restarts = status.restarts
        view.restarts = ({kind: int(getattr(restarts, kind) or 0) for kind in RESTART_KINDS}
                         if restarts is not None else {})
        counts: dict[str, int] = {}
        for rank in status.ranks:
            if rank.state is not None:
                counts[str(rank.state)] = counts.get(str(rank.state), 0) + 1
        view.ranks = counts
        spares = status.spares
        view.spares_desired = spares.desired if spares is not None else 0
        view.spares_ready = spares.ready if spares is not None else 0
        for incident in status.incidents:
            if incident.seconds is None or incident.recovered_time is None:
                continue
            seen = (str(incident.cause), incident.detected_time.isoformat())
            if seen in view.recovered:
                continue
            view.recovered.add(seen)
            RECOVERY_SECONDS.labels(action=str(incident.action or "None")).observe(
                float(incident.seconds))


def record_pass(namespace: str, name: str, *, trigger: str, seconds: float,
                status: ResilientTrainingJobStatus, applied: Iterable[object],
                restarts: Iterable[str], stale: Iterable[RankStatus],
                stale_after_seconds: float) -> None:
    """What one reconcile pass of job `namespace/name` adds to the metrics: the ranks whose
    heartbeat it saw go stale (`stale`; how long after their last heartbeat +
    `stale_after_seconds`), the actions and Events it applied (`applied`, by type), the
    recoveries it started (`restarts`, by action), its duration (`seconds`, by `trigger`) and the
    job's new status."""
    for rank in stale:
        HEARTBEAT_STALE.inc()
        if rank.last_heartbeat_time is not None:
            HEARTBEAT_STALE_DETECTION_SECONDS.observe(max(0.0, time.time() - (
                rank.last_heartbeat_time.timestamp() + stale_after_seconds)))
    for item in applied:
        ACTIONS.labels(action=type(item).__name__).inc()  # PostEvent counted too
    for action in restarts:
        RESTARTS.labels(action=action).inc()
    RECONCILE_SECONDS.labels(trigger=trigger).observe(seconds)
    record_job_state(f"{namespace}/{name}", status.state)
    record_job_status(namespace, name, status)


class _JobCollector(Collector):
    """The `rtj_job_*` families, read from the remembered statuses at each scrape."""

    def collect(self) -> Iterator[Metric]:
        labels = ["namespace", "job_name"]
        state = GaugeMetricFamily("rtj_job_state", "1 for the job's current state (status.state).",
                                  labels=[*labels, "state"])
        goodput = GaugeMetricFamily("rtj_job_goodput_ratio",
                                    "Share of wall time spent in steps that were kept.",
                                    labels=labels)
        step = GaugeMetricFamily("rtj_job_step", "Last step completed by every rank.",
                                 labels=labels)
        checkpoint_step = GaugeMetricFamily("rtj_job_checkpoint_committed_step",
                                            "Step of the newest committed checkpoint.",
                                            labels=labels)
        checkpoint_time = GaugeMetricFamily(
            "rtj_job_checkpoint_committed_timestamp_seconds",
            "When the newest committed checkpoint was committed (Unix seconds); its age is "
            "time() minus this.", labels=labels)
        restarts = CounterMetricFamily("rtj_job_restarts",
                                       "Restarts of the job by kind (cumulative).",
                                       labels=[*labels, "kind"])
        ranks = GaugeMetricFamily("rtj_job_ranks", "Node indexes (trainer pods) by state.",
                                  labels=[*labels, "state"])
        spares = GaugeMetricFamily("rtj_job_spares", "Warm spares: desired and ready.",
                                   labels=[*labels, "kind"])
        with _jobs_lock:
            jobs = sorted(_jobs.items())
        for (namespace, name), view in jobs:
            base = [namespace, name]
            for known in JobState:
                state.add_metric([*base, known.value], 1.0 if view.state == known.value else 0.0)
            if view.goodput is not None:
                goodput.add_metric(base, view.goodput)
            if view.step is not None:
                step.add_metric(base, float(view.step))
            if view.checkpoint_step is not None:
                checkpoint_step.add_metric(base, float(view.checkpoint_step))
            if view.checkpoint_time is not None:
                checkpoint_time.add_metric(base, view.checkpoint_time)
            for kind in RESTART_KINDS:
                restarts.add_metric([*base, kind], float(view.restarts.get(kind, 0)))
            for known_rank in RankState:
                ranks.add_metric([*base, known_rank.value],
                                 float(view.ranks.get(known_rank.value, 0)))
            spares.add_metric([*base, "desired"], float(view.spares_desired))
            spares.add_metric([*base, "ready"], float(view.spares_ready))
        yield from (state, goodput, step, checkpoint_step, checkpoint_time, restarts, ranks,
                    spares)


REGISTRY.register(_JobCollector())


def serve(host: str, port: int) -> None:
    """Start the metrics HTTP server in a daemon thread (port 0: do nothing)."""
    if port:
        start_http_server(port, addr=host, registry=REGISTRY)
