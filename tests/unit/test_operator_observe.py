"""The pure half of observing: API objects into views (`rtj_operator.observe`)."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest
from rtj_operator.observe import observed_from, pod_view

pytestmark = pytest.mark.unit


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
