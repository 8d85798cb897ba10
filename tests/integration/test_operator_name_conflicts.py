"""A create answered 409 counts as done only when the object under that name is the job's own
(review-2 F8): on a real kube-apiserver, the operator's `actions.apply` creates a job's
rendezvous Service, takes the 409 of a second create of its own Service as done, and reports a
Service of that name that is not the job's as refused (`NameTaken`), instead of taking it for
its own for ever (job `x`'s rendezvous Service and job `x-rdzv`'s headless Service were the same
object; the CRD now refuses job names ending in `-rdzv`)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator

import pytest
import yaml
from harness.cluster import Cluster
from rtj_operator import actions, builders, intents
from rtj_operator.api.models import ResilientTrainingJob, parse_job
from rtj_operator.config import OperatorSettings

pytestmark = pytest.mark.integration
SETTINGS = OperatorSettings()


@pytest.fixture(scope="module")
def conflicts_namespace(cluster: Cluster) -> Iterator[str]:
    name = cluster.create_namespace("name-conflicts")
    try:
        yield name
    finally:
        cluster.delete_namespace(name)


def _job(cluster: Cluster, namespace: str, name: str) -> ResilientTrainingJob:
    """A real job object (no operator runs in this tier): its UID owns what is created."""
    document = {"apiVersion": "training.resilient.dev/v1alpha1", "kind": "ResilientTrainingJob",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {"nodes": 1, "image": "trainer:1", "checkpoint": {"claimName": "c"}}}
    cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", "-",
                    input=yaml.safe_dump(document))
    stored = json.loads(cluster.kubectl("get", "rtj", name, "-n", namespace, "-o",
                                        "json").stdout)
    return parse_job(stored)


def _create(cluster: Cluster, namespace: str, job: ResilientTrainingJob,
            manifest: dict[str, object]) -> list[intents.CreateRefused]:
    return asyncio.run(actions.apply(cluster.api_client(), namespace=namespace, job_name=job.name,
                                     actions=[intents.CreateObject(manifest)], timeout=10))


def test_the_jobs_own_service_is_created_once_and_a_second_create_is_done(
    cluster: Cluster, conflicts_namespace: str,
) -> None:
    job = _job(cluster, conflicts_namespace, "own")
    service = builders.rendezvous_service(job, settings=SETTINGS)
    assert _create(cluster, conflicts_namespace, job, service) == []
    assert _create(cluster, conflicts_namespace, job, service) == []  # 409, and it is ours
    owners = cluster.core_v1().read_namespaced_service(
        "own-rdzv", conflicts_namespace).metadata.owner_references
    assert [o.uid for o in owners] == [job.metadata.uid]


def test_a_service_of_that_name_that_is_not_the_jobs_is_reported_not_taken_for_its_own(
    cluster: Cluster, conflicts_namespace: str,
) -> None:
    foreign = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": "taken-rdzv", "namespace": conflicts_namespace},
               "spec": {"clusterIP": "None", "selector": {"app": "someone-else"},
                        "ports": [{"port": 80}]}}
    cluster.kubectl("apply", "-n", conflicts_namespace, "-f", "-", input=json.dumps(foreign))
    job = _job(cluster, conflicts_namespace, "taken")
    refused = _create(cluster, conflicts_namespace, job,
                      builders.rendezvous_service(job, settings=SETTINGS))
    assert [(r.kind, r.name, r.name_taken) for r in refused] == [
        ("Service", "taken-rdzv", True)]
    assert "already exists and is not this job's" in refused[0].message
    # Untouched: still the other owner's object.
    kept = cluster.core_v1().read_namespaced_service("taken-rdzv", conflicts_namespace)
    assert kept.spec.selector == {"app": "someone-else"} and not kept.metadata.owner_references

