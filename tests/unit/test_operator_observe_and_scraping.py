"""The pure halves of observing: API objects into views, /metrics text into rank samples."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from rtj_operator.observe import observed_from, pod_view
from rtj_operator.scraping import rank_sample_from_text
from rtj_operator.views import RankSample

pytestmark = pytest.mark.unit

METRICS = """\
# HELP rtj_trainer_heartbeat_timestamp_seconds unix time of the last heartbeat
# TYPE rtj_trainer_heartbeat_timestamp_seconds gauge
rtj_trainer_heartbeat_timestamp_seconds{local_rank="1",rank="3"} 1.7e+09
# TYPE rtj_trainer_step gauge
rtj_trainer_step{local_rank="1",rank="3"} 42.0
# TYPE rtj_trainer_checkpoint_committed_step gauge
rtj_trainer_checkpoint_committed_step{local_rank="1",rank="3"} 40.0
# TYPE rtj_trainer_checkpoint_committed_timestamp_seconds gauge
rtj_trainer_checkpoint_committed_timestamp_seconds{local_rank="1",rank="3"} 1.69999e+09
# TYPE rtj_trainer_goodput_ratio gauge
rtj_trainer_goodput_ratio{local_rank="1",rank="3"} 0.93
# TYPE rtj_trainer_restarts counter
rtj_trainer_restarts_total{kind="launcher",local_rank="1",rank="3"} 2.0
rtj_trainer_restarts_total{kind="inprocess",local_rank="1",rank="3"} 1.0
rtj_trainer_restarts_total{kind="pod",local_rank="1",rank="3"} 0.0
# TYPE python_gc_objects_collected counter
python_gc_objects_collected_total{generation="0"} 100.0
"""


def test_a_metrics_page_becomes_a_rank_sample() -> None:
    sample = rank_sample_from_text(METRICS, local_rank=1)
    assert sample == RankSample(
        local_rank=1, rank=3, heartbeat=1.7e9, step=42, committed_step=40,
        committed_time=1.69999e9, goodput_ratio=0.93,
        restarts={"launcher": 2, "inprocess": 1, "pod": 0},
    )


def test_no_checkpoint_and_no_heartbeat_yet_read_as_unknown() -> None:
    text = ('rtj_trainer_checkpoint_committed_step{local_rank="0",rank="0"} -1.0\n'
            'rtj_trainer_heartbeat_timestamp_seconds{local_rank="0",rank="0"} 0.0\n')
    sample = rank_sample_from_text(text, local_rank=0)
    assert sample.committed_step is None and sample.heartbeat is None and sample.step is None



def pod(name: str, role: str, index: int | None = None, **status: object) -> dict[str, object]:
    labels = {"training.resilient.dev/job": "j", "training.resilient.dev/role": role}
    if index is not None:
        labels |= {"training.resilient.dev/node-index": str(index),
                   "training.resilient.dev/attempt": "2"}
    return {"metadata": {"name": name, "uid": f"uid-{name}", "labels": labels},
            "spec": {"nodeName": "node-a"}, "status": status}


def test_a_failed_trainer_pod_shows_its_exit_code_and_times() -> None:
    view = pod_view(pod("j-1", "trainer", 1, phase="Failed", podIP="10.0.0.5", containerStatuses=[
        {"name": "trainer", "state": {"terminated": {
            "exitCode": 137, "reason": "Error", "startedAt": "2026-11-29T12:00:00Z",
            "finishedAt": "2026-11-29T12:05:00Z"}}}]))
    assert (view.node_index, view.attempt, view.phase, view.exit_code) == (1, 2, "Failed", 137)
    assert view.finished_at == datetime(2026, 11, 29, 12, 5, tzinfo=UTC)
    assert view.started_at == datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    assert view.terminated and not view.deleting and view.pod_ip == "10.0.0.5"


def test_children_are_sorted_into_trainers_rendezvous_services_and_claim() -> None:
    observed = observed_from(
        job_name="j", job_uid="job-uid",
        pods=[pod("j-0", "trainer", 0, phase="Running"), pod("j-rdzv", "rendezvous"),
              pod("other-0", "trainer", 0)],
        services=[{"metadata": {"name": "j"}}, {"metadata": {"name": "j-rdzv"}}],
        claims=[{"metadata": {"name": "j-checkpoints",
                              "ownerReferences": [{"uid": "job-uid"}]}}],
    )
    assert list(observed.trainer_pods) == [0]
    assert observed.trainer_pods[0].name == "j-0"
    assert observed.rendezvous_pod is not None and observed.rendezvous_pod.name == "j-rdzv"
    assert observed.headless_service and observed.rendezvous_service
    assert observed.claim is not None and observed.claim.owned_by_job


def test_the_status_patch_holds_only_changed_fields_and_removals() -> None:
    from rtj_operator.reconcile import status_patch

    current = {"state": "Running", "step": 10, "startTime": "2026-11-29T12:00:00Z"}
    desired = {"state": "Running", "step": 11, "startTime": None, "nodes": "2/2"}
    assert status_patch(current, desired) == {"step": 11, "startTime": None, "nodes": "2/2"}
