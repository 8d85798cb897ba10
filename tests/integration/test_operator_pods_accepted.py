"""The pods the operator builds are accepted by a real kube-apiserver (server-side dry run):
its validation has rules that a unit test comparing dicts cannot know, such as "a
`metadata.name` field selector takes exactly one value"."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from harness.cluster import Cluster
from rtj_operator import builders
from rtj_operator.api.models import parse_job
from rtj_operator.config import OperatorSettings
from rtj_operator.podplan import plan_for

pytestmark = pytest.mark.integration
SETTINGS = OperatorSettings()


@pytest.fixture(scope="module")
def pods_namespace(cluster: Cluster) -> Iterator[str]:
    name = cluster.create_namespace("pods-accepted")
    try:
        yield name
    finally:
        cluster.delete_namespace(name)


@pytest.mark.parametrize("excluded", [0, 1, 2, 32])
def test_a_trainer_pod_avoiding_excluded_nodes_is_accepted(
    cluster: Cluster, pods_namespace: str, excluded: int
) -> None:
    job = parse_job({
        "apiVersion": "training.resilient.dev/v1alpha1",
        "kind": "ResilientTrainingJob",
        "metadata": {"name": "avoid", "namespace": pods_namespace, "uid": "u-1", "generation": 1},
        "spec": {"nodes": 2, "instanceType": "p5.48xlarge", "image": "trainer:1",
                 "checkpoint": {"claimName": "ckpt"}},
    })
    nodes = [f"ip-10-0-1-{i}" for i in range(excluded)]
    pod = builders.trainer_pod(job, plan=plan_for(job, SETTINGS), node_index=1, attempt=1,
                               settings=SETTINGS, avoid_nodes=nodes)
    pod["metadata"]["ownerReferences"] = []  # the job does not exist here
    result = cluster.kubectl("create", "--dry-run=server", "-n", pods_namespace, "-o", "json",
                             "-f", "-", input=json.dumps(pod), check=False)
    assert result.returncode == 0, result.stderr
    accepted = json.loads(result.stdout)
    avoided = [value for term in accepted["spec"].get("affinity", {}).get("nodeAffinity", {})
               .get("preferredDuringSchedulingIgnoredDuringExecution", [])
               for requirement in term["preference"].get("matchFields", [])
               for value in requirement["values"]]
    assert sorted(avoided) == sorted(nodes)
