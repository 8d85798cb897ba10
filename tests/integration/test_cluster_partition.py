"""The local cluster fails like a real one: partitioned nodes, pods that cannot start, cordons.

Everything is judged by what the real control plane does: the node-lifecycle controller of the
real kube-controller-manager marks a partitioned node Ready=Unknown and taints it unreachable, the
real API server keeps a deleted pod Terminating while no kubelet finishes it, and the real
scheduler leaves a pod Unschedulable on a cordoned node.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from harness.cluster import Cluster, node_is_ready
from harness.control import NodeControlError
from harness.controlplane import NODE_MONITOR_GRACE_SECONDS
from harness.kubelet.nodes import LEASE_RENEW_SECONDS
from harness.procs import wait_for

pytestmark = pytest.mark.integration

JsonObject = dict[str, Any]
UNREACHABLE = "node.kubernetes.io/unreachable"
TICKER = "import time\nfor i in range(10**6):\n    print(i, flush=True)\n    time.sleep(0.05)"
GRACEFUL = 'trap "echo got TERM; exit 0" TERM; echo started; while true; do sleep 0.1; done'


def pod_on(node: str, name: str, command: list[str], *, bind: bool = False) -> JsonObject:
    """A pod for `node`: through the scheduler (nodeSelector), or bound directly (nodeName)."""
    spec: JsonObject = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 10,
        "containers": [{"name": "main", "image": "registry.local/app:1", "command": command}],
    }
    if bind:
        spec["nodeName"] = node
    else:
        spec["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": spec}


def process_exists(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def pgid_of(pod: JsonObject) -> int:
    return int(pod["metadata"]["annotations"]["harness.local/pgid"])


def condition(obj: JsonObject, kind: str) -> JsonObject:
    conditions = obj.get("status", {}).get("conditions", []) or []
    return next((c for c in conditions if c["type"] == kind), {})


def waiting_state(pod: JsonObject | None) -> JsonObject:
    statuses = (pod or {}).get("status", {}).get("containerStatuses") or [{}]
    state: JsonObject = statuses[0].get("state", {}).get("waiting", {})
    return state


@pytest.fixture
def node(cluster: Cluster) -> Iterator[str]:
    """The node a test disturbs; healed, accepting and uncordoned again afterwards."""
    name = cluster.nodes.node_names()[-1]
    try:
        yield name
    finally:
        cluster.nodes.heal_node(name)
        cluster.nodes.accept_pods(name)
        cluster.uncordon_node(name)
        wait_for(
            lambda: not cluster.api.get(f"/api/v1/nodes/{name}")["spec"].get("taints"),
            60,
            f"{name} to lose its taints",
        )


def test_a_partitioned_node_goes_unknown_keeps_deletions_pending_and_catches_up_when_healed(
    cluster: Cluster, namespace: str, node: str
) -> None:
    pods = f"/api/v1/namespaces/{namespace}/pods"
    for name, command in (
        ("ticker", ["python", "-c", TICKER]),
        ("graceful", ["sh", "-c", GRACEFUL]),
        ("forced", ["sleep", "600"]),
    ):
        cluster.api.create(pods, pod_on(node, name, command))
    running = {name: cluster.wait_for_pod(namespace, name) for name in ("ticker", "graceful")}
    forced_pgid = wait_for(
        lambda: cluster.api.get(f"{pods}/forced")["metadata"].get("annotations", {}).get(
            "harness.local/pgid"
        ),
        30,
        "the forced pod to run",
    )
    forced_pgid = int(forced_pgid)
    ticker_log = cluster.pod_log_path(namespace, "ticker")
    wait_for(lambda: "started" in cluster.pod_log(namespace, "graceful"), 30, "graceful to start")
    wait_for(lambda: ticker_log.exists() and ticker_log.stat().st_size > 0, 30, "ticker output")
    lease_path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{node}"

    frozen = cluster.nodes.partition_node(node)
    partitioned_at = time.monotonic()

    assert sorted(frozen) == sorted(f"{namespace}/{n}" for n in ("ticker", "graceful", "forced"))
    renewed = cluster.api.get(lease_path)["spec"]["renewTime"]
    size = ticker_log.stat().st_size
    cgroup = running["ticker"]["metadata"]["annotations"].get("harness.local/cgroup")
    if cgroup is not None:  # else frozen by SIGSTOP; the silent log below shows it either way
        assert "frozen 1" in (Path(cgroup) / "cgroup.events").read_text()

    # Deleted while partitioned: the API keeps it Terminating, nobody stops its processes.
    cluster.api.delete(f"{pods}/graceful")
    # Force-deleted: gone from the API at once; its (frozen) processes stay until the heal.
    cluster.api.delete(f"{pods}/forced", {"gracePeriodSeconds": 0})
    assert cluster.api.get_or_none(f"{pods}/forced") is None
    # Bound to the partitioned node meanwhile: not started.
    cluster.api.create(pods, pod_on(node, "late", ["sleep", "600"], bind=True))

    def unreachable() -> JsonObject | None:
        found = cluster.api.get(f"/api/v1/nodes/{node}")
        taints = {(t["key"], t["effect"]) for t in found["spec"].get("taints") or []}
        wanted = {(UNREACHABLE, "NoSchedule"), (UNREACHABLE, "NoExecute")}
        return found if wanted <= taints else None

    seen = wait_for(unreachable, NODE_MONITOR_GRACE_SECONDS + 30, "the unreachable taints")
    # measured from the last renewal the controller saw, at most one interval before the cut
    assert time.monotonic() - partitioned_at >= NODE_MONITOR_GRACE_SECONDS - LEASE_RENEW_SECONDS
    ready = condition(seen, "Ready")
    assert (ready["status"], ready["reason"]) == ("Unknown", "NodeStatusUnknown")
    assert cluster.api.get(lease_path)["spec"]["renewTime"] == renewed, "no Lease renewal"
    wait_for(
        lambda: condition(cluster.api.get(f"{pods}/ticker"), "Ready").get("status") == "False",
        30,
        "the controller to mark the ticker NotReady",
    )
    graceful = cluster.api.get(f"{pods}/graceful")
    assert graceful["metadata"].get("deletionTimestamp"), "still Terminating"
    assert graceful["status"]["phase"] == "Running"
    assert "got TERM" not in cluster.pod_log(namespace, "graceful")
    assert process_exists(forced_pgid), "a force-deleted pod's processes wait for the kubelet"
    late = cluster.api.get(f"{pods}/late")
    assert late["status"].get("phase") == "Pending" and not late["status"].get("containerStatuses")
    assert ticker_log.stat().st_size == size, "frozen: no output during the partition"

    killed = cluster.nodes.heal_node(node)

    assert killed == [f"{namespace}/forced"]
    wait_for(lambda: not process_exists(forced_pgid), 30, "the force-deleted pod's processes")
    wait_for(lambda: node_is_ready(cluster.api.get(f"/api/v1/nodes/{node}")), 30, "Ready again")
    cluster.wait_for_pod_gone(namespace, "graceful", timeout=30)
    assert "got TERM" in cluster.pod_log(namespace, "graceful")
    wait_for(lambda: ticker_log.stat().st_size > size, 30, "the thawed ticker to print")
    if cgroup is not None:
        assert "frozen 0" in (Path(cgroup) / "cgroup.events").read_text()
    wait_for(
        lambda: condition(cluster.api.get(f"{pods}/ticker"), "Ready").get("status") == "True",
        30,
        "the ticker to be reported Ready again",
    )
    cluster.wait_for_pod(namespace, "late", timeout=30)
    wait_for(lambda: unreachable() is None, 60, "the unreachable taints to go")


def test_a_node_refusing_pods_leaves_them_pending_with_kubelets_waiting_reason(
    cluster: Cluster, namespace: str, node: str
) -> None:
    pods = f"/api/v1/namespaces/{namespace}/pods"
    with pytest.raises(NodeControlError, match="reason must be one of"):
        cluster.nodes.refuse_pods(node, "Sulking", "no")
    message = 'failed to pull and unpack image "registry.local/app:1": not found'
    cluster.nodes.refuse_pods(node, "ErrImagePull", message)
    cluster.api.create(pods, pod_on(node, "pull", ["sleep", "600"]))

    def waiting_with(name: str, reason: str) -> JsonObject | None:
        pod = cluster.api.get_or_none(f"{pods}/{name}")
        return pod if waiting_state(pod).get("reason") == reason else None

    pulled = wait_for(lambda: waiting_with("pull", "ErrImagePull"), 30, "ErrImagePull")
    assert waiting_state(pulled)["message"] == message
    backoff = wait_for(lambda: waiting_with("pull", "ImagePullBackOff"), 30, "ImagePullBackOff")
    assert waiting_state(backoff)["message"] == (
        f'Back-off pulling image "registry.local/app:1": ErrImagePull: {message}'
    )
    assert backoff["status"]["phase"] == "Pending"
    assert condition(backoff, "PodScheduled")["status"] == "True"
    assert condition(backoff, "Ready")["status"] == "False"

    cluster.nodes.refuse_pods(node, "CreateContainerConfigError", 'secret "creds" not found')
    cluster.api.create(pods, pod_on(node, "config", ["sleep", "600"]))
    config = wait_for(
        lambda: waiting_with("config", "CreateContainerConfigError"), 30, "the config error"
    )
    assert waiting_state(config)["message"] == 'secret "creds" not found'
    time.sleep(2)  # retried every half second meanwhile; never started
    for name in ("pull", "config"):
        pod = cluster.api.get(f"{pods}/{name}")
        assert pod["status"]["phase"] == "Pending"
        assert "harness.local/pgid" not in pod["metadata"].get("annotations", {})
        assert not cluster.pod_log_path(namespace, name).exists()

    cluster.nodes.accept_pods(node)  # the image "arrives": the waiting pods start

    for name in ("pull", "config"):
        pod = cluster.wait_for_pod(namespace, name, timeout=30)
        assert pod["status"]["containerStatuses"][0]["state"].get("running")


def test_a_cordoned_node_leaves_a_pod_unschedulable_until_uncordoned(
    cluster: Cluster, namespace: str, node: str
) -> None:
    pods = f"/api/v1/namespaces/{namespace}/pods"
    cluster.cordon_node(node)
    cluster.api.create(pods, pod_on(node, "pinned", ["sleep", "600"]))

    def unschedulable() -> JsonObject | None:
        scheduled = condition(cluster.api.get(f"{pods}/pinned"), "PodScheduled")
        return scheduled if scheduled.get("reason") == "Unschedulable" else None

    scheduled = wait_for(unschedulable, 30, "PodScheduled=False, Unschedulable")
    assert scheduled["status"] == "False"
    assert "unschedulable" in scheduled["message"]
    assert not cluster.api.get(f"{pods}/pinned")["spec"].get("nodeName")

    cluster.uncordon_node(node)

    pod = cluster.wait_for_pod(namespace, "pinned", timeout=60)
    assert pod["spec"]["nodeName"] == node
