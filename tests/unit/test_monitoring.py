"""The chart's alerts and Grafana dashboard read only metrics the code exports, and the
operator's per-job metrics say what the job's status says."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from rtj_operator import metrics
from rtj_operator.api.status import (
    Incident,
    LastCheckpoint,
    RankStatus,
    ResilientTrainingJobStatus,
    RestartCounts,
    SpareStatus,
)
from rtj_operator.api.vocabulary import IncidentCause, RecoveryAction
from rtj_trainer.metrics import Snapshot, TrainerMetrics

pytestmark = pytest.mark.unit

CHART = Path(__file__).resolve().parents[2] / "charts" / "rtj-operator"
RULES = CHART / "templates" / "prometheusrule.yaml"
DASHBOARD = CHART / "files" / "rtj-dashboard.json"
NAME = re.compile(r"\b(rtj_[a-z0-9_]+)\b(?![.])")  # not a module (rtj_operator.metrics)
T = datetime(2026, 11, 29, 12, 0, tzinfo=UTC)


def a_status() -> ResilientTrainingJobStatus:
    return ResilientTrainingJobStatus(
        state="Running", goodput="93.5%", step=420,
        last_checkpoint=LastCheckpoint(step=400, time=T),
        restarts=RestartCounts(total=3, rank=2, full=0, launcher=1, in_process=0),
        ranks=[RankStatus(node_index=0, state="Running"), RankStatus(node_index=1, state="Running"),
               RankStatus(node_index=2, state="Standby")],
        spares=SpareStatus(desired=1, ready=1),
        incidents=[Incident(cause=IncidentCause.POD_FAILED, node_index=1, detected_time=T,
                            acted_time=T, recovered_time=T, seconds=12.5,
                            action=RecoveryAction.RANK_RESTART)],
    )


def exported(text: str) -> set[str]:
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines()
            if line and not line.startswith("#")}


def exported_by_the_code() -> set[str]:
    metrics.record_job_status("ml", "llama", a_status())
    try:
        operator = exported(generate_latest(metrics.REGISTRY).decode())
    finally:
        metrics.record_job_status("ml", "llama", None)
    trainer = TrainerMetrics(rank=0, local_rank=0, job="llama", attempt=0)
    trainer.watch(lambda: Snapshot(heartbeat_timestamp=1.0, step=3, step_seconds=0.1,
                                   tokens_per_second=1.0, checkpoint_stall_seconds=0.0,
                                   checkpoint_write_seconds=0.0, checkpoint_committed_step=2,
                                   checkpoint_committed_timestamp=1.0,
                                   restarts={"pod": 0, "launcher": 0, "inprocess": 0},
                                   productive_seconds=1.0, lost_seconds=0.0, job_started_at=0.0))
    return operator | exported(generate_latest(trainer.registry).decode())


def test_every_metric_in_the_alerts_and_the_dashboard_is_exported() -> None:
    names = exported_by_the_code()
    rules = RULES.read_text()
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    used = set(NAME.findall(rules)) | {n for e in exprs for n in NAME.findall(e)}
    assert {"rtj_job_state", "rtj_job_checkpoint_committed_timestamp_seconds",
            "rtj_job_restarts_total"} <= used
    assert used - names == set(), f"not exported: {sorted(used - names)}"


def test_the_alerts_cover_stale_checkpoints_restart_storms_and_stuck_jobs() -> None:
    alerts = set(re.findall(r"- alert: (\w+)", RULES.read_text()))
    assert alerts == {"RTJCheckpointStale", "RTJRestartStorm", "RTJJobStuckRecovering",
                      "RTJJobStuckPending"}


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_the_per_job_metrics_follow_the_status() -> None:
    before = metrics.RECOVERY_SECONDS.labels(action="RankRestart")._sum.get()
    metrics.record_job_status("ml", "llama", a_status())
    metrics.record_job_status("ml", "llama", a_status())  # the same incident counts once
    try:
        found = samples(generate_latest(metrics.REGISTRY).decode())
    finally:
        metrics.record_job_status("ml", "llama", None)

    def value(name: str, **labels: str) -> float:
        return found[(name, frozenset({"namespace": "ml", "job_name": "llama", **labels}.items()))]

    assert value("rtj_job_state", state="Running") == 1.0
    assert value("rtj_job_state", state="Recovering") == 0.0
    assert value("rtj_job_goodput_ratio") == pytest.approx(0.935)
    assert value("rtj_job_checkpoint_committed_step") == 400
    assert value("rtj_job_checkpoint_committed_timestamp_seconds") == T.timestamp()
    assert value("rtj_job_restarts_total", kind="rank") == 2
    assert value("rtj_job_ranks", state="Standby") == 1
    assert value("rtj_job_spares", kind="ready") == 1
    after = metrics.RECOVERY_SECONDS.labels(action="RankRestart")._sum.get()
    assert after - before == pytest.approx(12.5)
    assert 'job_name="llama"' not in generate_latest(metrics.REGISTRY).decode()


def test_every_request_of_the_operators_api_client_is_counted_by_verb() -> None:
    import kubernetes.client
    import urllib3

    configuration = kubernetes.client.Configuration()
    configuration.host = "http://127.0.0.1:9"  # discard: nothing answers
    configuration.retries = False
    api = metrics.count_api_requests(kubernetes.client.ApiClient(configuration))
    core = kubernetes.client.CoreV1Api(api)

    def count(verb: str) -> float:
        return metrics.REGISTRY.get_sample_value("rtj_operator_api_requests_total",
                                                 {"verb": verb}) or 0.0

    lists, deletes = count("GET"), count("DELETE")
    for call in (lambda: core.list_namespaced_pod("ns", _request_timeout=1),
                 lambda: core.delete_namespaced_pod("p", "ns", _request_timeout=1)):
        with pytest.raises(urllib3.exceptions.HTTPError):
            call()
    assert (count("GET"), count("DELETE")) == (lists + 1, deletes + 1)
