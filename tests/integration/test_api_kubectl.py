"""What a user sees through kubectl: the short name, printer columns and `kubectl explain`.

A status is built with the operator's own models and written through the status subresource, so
this also proves that what the operator writes is accepted by the CRD schema.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import yaml
from harness.cluster import Cluster
from rtj_operator.api import models

pytestmark = pytest.mark.integration

NOW = datetime(2026, 11, 29, 10, 50, tzinfo=UTC)


@pytest.fixture(scope="module")
def kubectl_namespace(cluster: Cluster) -> Iterator[str]:
    name = cluster.create_namespace("api-kubectl")
    try:
        yield name
    finally:
        cluster.delete_namespace(name)


def example_status() -> models.ResilientTrainingJobStatus:
    return models.ResilientTrainingJobStatus(
        observed_generation=1,
        conditions=[
            models.Condition(
                type="Ready",
                status="False",
                observed_generation=1,
                last_transition_time=NOW,
                reason="Recovering",
                message="Pod demo-1 failed; replacing it.",
            ),
            models.Condition(
                type="Recovering",
                status="True",
                observed_generation=1,
                last_transition_time=NOW,
                reason="RankRestart",
                message="Replacing node 1.",
            ),
        ],
        state="Recovering",
        nodes_ready=1,
        nodes_desired=2,
        nodes="1/2",
        step=31,
        last_checkpoint=models.LastCheckpoint(step=30, time=NOW),
        restarts=models.RestartCounts(total=2, rank=1, launcher=1),
        ranks=[
            models.RankStatus(node_index=0, pod="demo-0", state="Running", step=31),
            models.RankStatus(node_index=1, pod="demo-1", state="Failed", attempt=0),
        ],
        incidents=[
            models.Incident(
                cause="PodFailed",
                node_index=1,
                rank=3,
                detected_time=NOW,
                acted_time=NOW,
                action="RankRestart",
                seconds=1.5,
            ),
            models.Incident(cause="HeartbeatTimeout", node_index=1, rank=2, detected_time=NOW),
        ],
        goodput="93.1%",
        start_time=NOW,
        reason="RankRestart",
        message="Replacing pod demo-1.",
    )


@pytest.fixture(scope="module")
def job_with_status(cluster: Cluster, kubectl_namespace: str) -> str:
    manifest = {
        "apiVersion": "training.resilient.dev/v1alpha1",
        "kind": "ResilientTrainingJob",
        "metadata": {"name": "demo"},
        "spec": {"nodes": 2, "image": "rtj-trainer:dev", "checkpoint": {"claimName": "fsx"}},
    }
    cluster.kubectl(
        "apply", "--server-side", "-n", kubectl_namespace, "-f", "-", input=yaml.safe_dump(manifest)
    )
    patch = json.dumps({"status": example_status().to_api()})
    cluster.kubectl(
        "patch",
        "rtj",
        "demo",
        "-n",
        kubectl_namespace,
        "--subresource=status",
        "--type=merge",
        "-p",
        patch,
    )
    return "demo"


def test_a_status_written_from_the_models_is_stored_unchanged(
    cluster: Cluster, kubectl_namespace: str, job_with_status: str
) -> None:
    stored = json.loads(
        cluster.kubectl("get", "rtj", job_with_status, "-n", kubectl_namespace, "-o", "json").stdout
    )
    assert models.parse_status(stored["status"]) == example_status()


def test_kubectl_get_rtj_shows_state_nodes_step_restarts_goodput_and_last_checkpoint(
    cluster: Cluster, kubectl_namespace: str, job_with_status: str
) -> None:
    out = cluster.kubectl("get", "rtj", "-n", kubectl_namespace).stdout.splitlines()
    assert out[0].split() == [
        "NAME",
        "STATE",
        "NODES",
        "STEP",
        "RESTARTS",
        "SPARES",
        "GOODPUT",
        "LAST-CKPT",
        "AGE",
    ]
    assert out[1].split()[:7] == ["demo", "Recovering", "1/2", "31", "2", "93.1%", "30"]


def test_kubectl_get_wide_adds_instance_reason_last_incident_and_message(
    cluster: Cluster, kubectl_namespace: str, job_with_status: str
) -> None:
    out = cluster.kubectl(
        "get", "resilienttrainingjobs", "-n", kubectl_namespace, "-o", "wide"
    ).stdout.splitlines()
    header = out[0].split()
    assert header[-4:] == ["INSTANCE", "REASON", "LAST-INCIDENT", "MESSAGE"]
    row = out[1]
    for value in ("p5.48xlarge", "RankRestart", "HeartbeatTimeout", "Replacing pod demo-1."):
        assert value in row


def test_the_job_is_listed_in_the_training_category(
    cluster: Cluster, kubectl_namespace: str, job_with_status: str
) -> None:
    out = cluster.kubectl("get", "training", "-n", kubectl_namespace, "-o", "name").stdout
    assert "resilienttrainingjob.training.resilient.dev/demo" in out


def test_kubectl_explain_prints_the_checkpoint_descriptions(cluster: Cluster) -> None:
    deadline = time.monotonic() + 30  # the OpenAPI document follows the CRD within seconds
    while True:
        result = cluster.kubectl("explain", "rtj.spec.checkpoint", check=False)
        if result.returncode == 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # explain wraps lines
    for phrase in (
        "Name of an existing ReadWriteMany PersistentVolumeClaim",
        "StorageClass of a ReadWriteMany volume that the operator creates",
        "Write a checkpoint every this many optimizer steps. Default: `100`.",
        "enum: Async, Sync",
    ):
        assert phrase in text, phrase
