"""The local cluster behaves like the Kubernetes the operator will meet on p5 nodes: its nodes.

Everything here goes through the real kube-apiserver. The tests that run pods on the harness's
process-backed nodes are in tests/e2e/test_cluster_faults.py.
"""

from __future__ import annotations

import pytest
from harness.cluster import Cluster, node_is_ready
from harness.procs import wait_for

pytestmark = pytest.mark.integration


def test_nodes_look_like_p5_48xlarge_and_are_ready(cluster: Cluster) -> None:
    client = cluster.api_client()
    listed = cluster.core_v1().list_node()
    nodes = client.sanitize_for_serialization(listed)["items"]  # type: ignore[no-untyped-call]
    names = sorted(node["metadata"]["name"] for node in nodes)
    assert names == sorted(cluster.nodes.node_names())
    assert len(names) == 3
    for node in nodes:
        labels = node["metadata"]["labels"]
        assert labels["node.kubernetes.io/instance-type"] == "p5.48xlarge"
        assert labels["kubernetes.io/hostname"] == node["metadata"]["name"]
        assert "topology.kubernetes.io/zone" in labels
        allocatable = node["status"]["allocatable"]
        assert allocatable["nvidia.com/gpu"] == "8"
        assert allocatable["vpc.amazonaws.com/efa"] == "32"
        assert allocatable["cpu"] == "192"
        assert allocatable["memory"] in ("2048Gi", "2Ti")  # the API server canonicalises
        assert allocatable["hugepages-2Mi"] == "8Gi"
        assert allocatable["pods"] == "110"
        assert node_is_ready(node)
    leases = cluster.api.get("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases")
    assert {lease["metadata"]["name"] for lease in leases["items"]} >= set(names)


def test_a_node_can_be_marked_not_ready_and_ready_again(cluster: Cluster) -> None:
    node = cluster.nodes.node_names()[-1]

    def ready() -> bool:
        return node_is_ready(cluster.api.get(f"/api/v1/nodes/{node}"))

    cluster.nodes.set_node_ready(node, False)
    try:
        wait_for(lambda: not ready(), 30, f"{node} to be NotReady")
    finally:
        cluster.nodes.set_node_ready(node, True)
    wait_for(ready, 30, f"{node} to be Ready again")
    wait_for(
        lambda: not cluster.api.get(f"/api/v1/nodes/{node}")["spec"].get("taints"),
        60,
        "the not-ready taint to be removed",
    )
