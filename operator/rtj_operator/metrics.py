"""The operator's own Prometheus metrics, served on their own port (`RTJ_OPERATOR_METRICS_PORT`).

They describe the operator, not the training (the trainers serve their own): how many passes it
runs and how long they take, which actions it applies, and how many jobs are in each state.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from rtj_operator.api.status import JobState

REGISTRY = CollectorRegistry()

RECONCILE_PASSES = Counter(
    "rtj_operator_reconcile_passes", "Reconcile passes, by outcome.", ["outcome"],
    registry=REGISTRY,
)
RECONCILE_SECONDS = Histogram(
    "rtj_operator_reconcile_seconds", "Duration of one reconcile pass (observe, decide, act).",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10), registry=REGISTRY,
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


def serve(host: str, port: int) -> None:
    """Start the metrics HTTP server in a daemon thread (port 0: do nothing)."""
    if port:
        start_http_server(port, addr=host, registry=REGISTRY)
