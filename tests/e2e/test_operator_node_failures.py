"""Node failures end to end (issue 11): a partitioned node, a pod deleted while its node is
partitioned, a node whose pod hung, and a pod that never starts. The real control plane (the
node-lifecycle controller marks a partitioned node Ready=Unknown and taints it unreachable), the
process-backed nodes' fault controls (tests/harness/README.md), the real trainer under
ft_launcher, and the operator as its own process (tests/e2e/conftest.py).

The cluster has three nodes and each job two trainer pods that take a whole node each, so one
node is always free for a replacement. Every test undoes its node fault in a `finally`, so the
session's cluster stays usable.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from e2e.test_operator_jobs import (
    apply,
    cpu_tiny,
    describe,
    events,
    pods_by_role,
    status,
    summary,
    wait_for,
)
from harness.cluster import Cluster
from harness.control import NodeControlError

if TYPE_CHECKING:
    from e2e.conftest import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def pod_or_none(cluster: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    return cluster.api.get_or_none(f"/api/v1/namespaces/{ns}/pods/{name}")


def running_with_checkpoint(cluster: Cluster, ns: str, name: str, step: int,
                            context: Any) -> dict[str, dict[str, Any]]:
    """Wait until both trainer pods run and a checkpoint at `step` or later is committed;
    return the trainer pods by name."""
    wait_for(f"a committed checkpoint at step {step}", lambda: (
        (status(cluster, ns, name).get("lastCheckpoint") or {}).get("step", 0) >= step),
        timeout=240, context=context)
    trainers = pods_by_role(cluster, ns, "trainer")
    assert sorted(trainers) == [f"{name}-0", f"{name}-1"], context()
    assert all(p["status"]["phase"] == "Running" for p in trainers.values()), context()
    return trainers


def replacement(cluster: Cluster, ns: str, pod: str, old_uid: str) -> dict[str, Any] | None:
    """The pod named `pod` once it is a new one (another UID) and Running."""
    found = pod_or_none(cluster, ns, pod)
    if (found and found["metadata"]["uid"] != old_uid
            and found.get("status", {}).get("phase") == "Running"):
        return found
    return None


def rendezvous_node(cluster: Cluster, ns: str, name: str) -> str:
    rendezvous = pods_by_role(cluster, ns, "rendezvous")[f"{name}-rdzv"]
    node: str = rendezvous["spec"]["nodeName"]
    return node


STEPS = 200


@pytest.mark.long
def test_a_partitioned_node_is_left_behind_and_the_job_succeeds_on_another(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """Pins review C1: the node of pod 1 is cut off (no Lease, no status, deletions never
    confirmed, processes frozen) and is NOT healed while the job runs. Before the NodeLost
    handling the operator never read Node objects, deleted with the default grace (which a
    partitioned kubelet never confirms) and stopped every liveness check while a pod was not
    Running: the job hung for ever. Now the pod is force-deleted (its object is gone while the
    node is still partitioned: only a force deletion removes it), recreated on another node and
    the job ends with the loss of a fault-free run."""
    ns, name = namespace, "cut"
    apply(cluster, ns, cpu_tiny(name, steps=STEPS, faults=None))
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    trainers = running_with_checkpoint(cluster, ns, name, 20, context)
    lost_node = trainers[f"{name}-1"]["spec"]["nodeName"]
    assert rendezvous_node(cluster, ns, name) != lost_node, (
        "precondition: the rendezvous pod shares the node of pod 1\n" + context())
    old_uid = trainers[f"{name}-1"]["metadata"]["uid"]

    try:
        frozen = cluster.nodes.partition_node(lost_node)
        assert any(f"{name}-1" in pod for pod in frozen), frozen
        new = wait_for("pod 1 recreated on another node", lambda: replacement(
            cluster, ns, f"{name}-1", old_uid), timeout=150, context=context)
        assert new["spec"]["nodeName"] != lost_node
        # The old pod's object is gone although its node never confirmed anything: it was
        # force-deleted. Its processes are still there, frozen, on the partitioned node.
        states = {n["name"]: n for n in cluster.nodes.node_states()}
        assert states[lost_node]["partitioned"], states
        assert any(p["uid"] == old_uid and p["partitioned"] for p in cluster.nodes.pods())
        node = json.loads(cluster.kubectl("get", "node", lost_node, "-o", "json").stdout)
        ready = next(c for c in node["status"]["conditions"] if c["type"] == "Ready")
        assert ready["status"] == "Unknown", ready

        final = wait_for("the job to finish", lambda: (
            s if (s := status(cluster, ns, name)).get("state") in ("Succeeded", "Failed")
            else None), timeout=300, interval=2, context=context)
        assert final["state"] == "Succeeded", context()
        assert final["step"] == STEPS
        incident = next(i for i in final["incidents"] if i["cause"] == "NodeLost")
        assert incident["nodeIndex"] == 1 and incident["action"] == "RankRestart", incident
        assert lost_node in incident["message"], incident
        assert final["restarts"]["full"] == 0, context()
        excluded = {e["node"]: e for e in final.get("excludedNodes", [])}
        assert excluded[lost_node]["reason"] == "NodeLost", excluded
        done = summary(cluster, ns, f"{name}-0")
    finally:
        cluster.nodes.heal_node(lost_node)

    # The same job without any fault ends with the same loss, bit for bit.
    apply(cluster, ns, cpu_tiny("plain", steps=STEPS, faults=None))
    wait_for("the fault-free job to finish", lambda: status(cluster, ns, "plain").get("state")
             in ("Succeeded", "Failed"), timeout=300, interval=2,
             context=lambda: describe(cluster, ns, "plain", operator))
    assert summary(cluster, ns, "plain-0")["final_loss"] == done["final_loss"]


@pytest.mark.long
def test_a_pod_deleted_while_its_node_is_partitioned_is_replaced(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """Pins review C1's exact shape: a pod deleted (gracefully, as the taint eviction or a
    person does) while its node is partitioned keeps its deletionTimestamp for ever, since no
    kubelet confirms; the old operator waited for its name to free and the job hung. Now it is
    force-deleted once its node is judged lost and `<job>-1` comes back on another node."""
    ns, name = namespace, "stuck"
    apply(cluster, ns, cpu_tiny(name, steps=2000, faults=None))
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    trainers = running_with_checkpoint(cluster, ns, name, 10, context)
    lost_node = trainers[f"{name}-1"]["spec"]["nodeName"]
    assert rendezvous_node(cluster, ns, name) != lost_node, (
        "precondition: the rendezvous pod shares the node of pod 1\n" + context())
    old_uid = trainers[f"{name}-1"]["metadata"]["uid"]

    try:
        cluster.nodes.partition_node(lost_node)
        cluster.kubectl("delete", "pod", f"{name}-1", "-n", ns, "--wait=false")
        time.sleep(5)
        stuck = pod_or_none(cluster, ns, f"{name}-1")
        assert stuck is not None and stuck["metadata"]["uid"] == old_uid, stuck
        assert stuck["metadata"].get("deletionTimestamp"), stuck  # Terminating, unconfirmed

        new = wait_for("pod 1 recreated on another node", lambda: replacement(
            cluster, ns, f"{name}-1", old_uid), timeout=150, context=context)
        assert new["spec"]["nodeName"] != lost_node
        assert cluster.nodes.node_states() and any(
            p["uid"] == old_uid and p["partitioned"] for p in cluster.nodes.pods())
        step_then = status(cluster, ns, name).get("step") or 0
        wait_for("training to go on with the new pod", lambda: (
            (status(cluster, ns, name).get("step") or 0) >= step_then + 20), timeout=150,
            context=context)
        now = status(cluster, ns, name)
        assert now["state"] == "Running", context()
        assert now["restarts"]["full"] == 0, context()
        assert [r["node"] for r in now["ranks"]][1] == new["spec"]["nodeName"]
    finally:
        cluster.nodes.heal_node(lost_node)


@pytest.mark.long
def test_a_node_whose_pod_hung_is_excluded_and_the_pod_replaced_elsewhere(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """Pins review C3: the replacement of a pod that failed its heartbeats went back to the
    same node (no record, no anti-affinity). Now the node is in `status.excludedNodes` with the
    evidence, a `NodeExcluded` Event is posted, and the new pod carries a preferred node
    anti-affinity, so it lands on the free node."""
    ns, name = namespace, "hung"
    manifest = cpu_tiny(name, steps=2000, faults=None)
    ft = manifest["spec"]["faultTolerance"]
    ft["heartbeatTimeoutSeconds"], ft["initialHeartbeatTimeoutSeconds"] = 15, 45
    apply(cluster, ns, manifest)
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    trainers = running_with_checkpoint(cluster, ns, name, 10, context)
    bad_node = trainers[f"{name}-1"]["spec"]["nodeName"]
    old_uid = trainers[f"{name}-1"]["metadata"]["uid"]

    cluster.nodes.freeze_pod(ns, f"{name}-1")  # a hang: no heartbeat, the pod stays Running
    try:
        new = wait_for("pod 1 replaced", lambda: replacement(cluster, ns, f"{name}-1", old_uid),
                       timeout=180, context=context)
    finally:
        with contextlib.suppress(NodeControlError):  # gone when no new pod 1 exists
            cluster.nodes.thaw_pod(ns, f"{name}-1")
    assert new["spec"]["nodeName"] != bad_node, context()
    avoid = new["spec"]["affinity"]["nodeAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert any(bad_node in json.dumps(term) for term in avoid), avoid
    now = status(cluster, ns, name)
    excluded = {e["node"]: e for e in now.get("excludedNodes", [])}
    assert excluded[bad_node]["reason"] == "HeartbeatTimeout", now
    assert excluded[bad_node]["nodeIndex"] == 1, now
    assert "no heartbeat" in excluded[bad_node]["message"], now
    healthy = trainers[f"{name}-0"]["spec"]["nodeName"]
    assert healthy not in excluded, now  # pod 0 only waited for pod 1
    assert now["restarts"]["full"] == 0, now
    incident = next(i for i in now["incidents"] if i["cause"] == "HeartbeatTimeout")
    assert incident["nodeIndex"] == 1, now
    excluded_events = events(cluster, ns, "NodeExcluded")
    assert any(bad_node in e["message"] for e in excluded_events), excluded_events


@pytest.mark.long
def test_a_pod_that_never_starts_is_shown_then_replaced_after_the_start_deadline(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """Pins review C7: a replacement stuck Pending (here: its image never pulls) was shown as
    nothing but `Pending`, and nothing ever timed out. Now `PodsNotStarting` says why at once,
    in the kubelet's word, and after `podStartTimeoutSeconds` the pod is a `PodStartTimeout`
    fault: its node is excluded and the pod recreated on another node, and the job goes on."""
    ns, name = namespace, "nostart"
    manifest = cpu_tiny(name, steps=2000, faults=None)
    manifest["spec"]["faultTolerance"]["podStartTimeoutSeconds"] = 20
    apply(cluster, ns, manifest)
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    trainers = running_with_checkpoint(cluster, ns, name, 10, context)
    refusing = trainers[f"{name}-1"]["spec"]["nodeName"]
    busy = trainers[f"{name}-0"]["spec"]["nodeName"]
    (free,) = set(cluster.nodes.node_names()) - {refusing, busy}
    old_uid = trainers[f"{name}-1"]["metadata"]["uid"]
    pull_error = 'rpc error: code = NotFound desc = failed to pull image "ghcr.io/x/y:dev"'

    cluster.nodes.refuse_pods(refusing, "ErrImagePull", pull_error)
    cluster.cordon_node(free)  # so the replacement can only go to the refusing node
    try:
        cluster.nodes.kill_pod(ns, f"{name}-1")
        stuck = wait_for("PodsNotStarting", lambda: (
            c if (c := next((c for c in status(cluster, ns, name).get("conditions", [])
                             if c["type"] == "PodsNotStarting"), None))
            and c["status"] == "True" else None), timeout=120, context=context)
        cluster.uncordon_node(free)
        assert stuck["reason"] in ("ErrImagePull", "ImagePullBackOff"), stuck
        assert f"pod {name}-1" in stuck["message"] and "failed to pull image" in (
            stuck["message"]), stuck
        # What a user sees with kubectl (parsed: kubectl folds long strings at any space).
        shown = yaml.safe_load(cluster.kubectl("get", "rtj", name, "-n", ns, "-o",
                                               "yaml").stdout)
        seen = next(c for c in shown["status"]["conditions"] if c["type"] == "PodsNotStarting")
        assert "failed to pull image" in seen["message"], seen
        pending = pod_or_none(cluster, ns, f"{name}-1")
        assert pending is not None and pending["spec"]["nodeName"] == refusing, pending
        assert pending["status"]["phase"] == "Pending"
        pending_uid = pending["metadata"]["uid"]

        new = wait_for("pod 1 recreated on another node", lambda: replacement(
            cluster, ns, f"{name}-1", pending_uid), timeout=150, context=context)
    finally:
        cluster.uncordon_node(free)
        cluster.nodes.accept_pods(refusing)
    assert new["spec"]["nodeName"] == free, context()
    now = status(cluster, ns, name)
    incident = next(i for i in now["incidents"] if i["cause"] == "PodStartTimeout")
    assert incident["nodeIndex"] == 1 and refusing in incident["message"], incident
    assert "ImagePullBackOff" in incident["message"] or "ErrImagePull" in incident["message"]
    excluded = {e["node"]: e for e in now.get("excludedNodes", [])}
    assert excluded[refusing]["reason"] == "PodStartTimeout", now
    step_then = now.get("step") or 0
    wait_for("training to go on with the new pod", lambda: (
        (status(cluster, ns, name).get("step") or 0) >= step_then + 20), timeout=150,
        context=context)
    cleared = next(c for c in status(cluster, ns, name)["conditions"]
                   if c["type"] == "PodsNotStarting")
    assert cleared["status"] == "False", cleared
    assert old_uid != new["metadata"]["uid"]


@pytest.mark.long
def test_every_node_cut_off_at_once_is_a_disruption_and_no_pod_is_replaced(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """The 2-hour soak's 48 false alarms: a 16 s etcd stall kept every kubelet from renewing its
    Lease, the node lifecycle controller marked every node Unknown and tainted it, and the
    operator force-deleted healthy pods as lost. Here every node is cut off at once, for longer
    than heartbeatTimeoutSeconds after the nodes went Unknown: that is a disruption of the
    control plane or the network, not three lost nodes. No pod is deleted, the job says why in
    `ObservationDegraded`, and once the nodes are back it trains on with the same pods."""
    ns, name = namespace, "blackout"
    apply(cluster, ns, cpu_tiny(name, steps=2000, faults=None))
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    running_with_checkpoint(cluster, ns, name, 10, context)

    def uids() -> dict[str, str]:
        pods = pods_by_role(cluster, ns, "trainer") | pods_by_role(cluster, ns, "rendezvous")
        return {n: p["metadata"]["uid"] for n, p in pods.items()}

    before = uids()
    nodes = cluster.nodes.node_names()

    def every_node_down() -> bool:
        found = json.loads(cluster.kubectl("get", "nodes", "-o", "json").stdout)["items"]
        return len(found) == len(nodes) and all(
            next(c for c in n["status"]["conditions"] if c["type"] == "Ready")["status"]
            != "True" and any(t["key"] == "node.kubernetes.io/unreachable"
                              for t in n["spec"].get("taints") or [])
            for n in found)

    def degraded() -> str | None:
        found = next((c for c in status(cluster, ns, name).get("conditions", [])
                      if c["type"] == "ObservationDegraded"), None)
        message: str | None = found["message"] if found and found["status"] == "True" else None
        return message if message and "is NotReady at once" in message else None

    try:
        for node in nodes:
            cluster.nodes.partition_node(node)
        wait_for("every node Unknown and tainted unreachable", every_node_down, timeout=90,
                 context=context)
        message = wait_for("the job to say why nothing is lost", degraded, timeout=60,
                           context=context)
        assert f"every node ({len(nodes)})" in message, message
        # Past heartbeatTimeoutSeconds (20 s) since the nodes went Unknown: the operator used to
        # force-delete every pod here.
        time.sleep(35)
        assert uids() == before, context()
        now = status(cluster, ns, name)
        assert not [i for i in now.get("incidents") or [] if i["cause"] in (
            "NodeLost", "RendezvousLost")], context()
    finally:
        for node in nodes:
            cluster.nodes.heal_node(node)
    step_then = status(cluster, ns, name).get("step") or 0
    wait_for("training to go on with the same pods", lambda: (
        (status(cluster, ns, name).get("step") or 0) >= step_then + 20), timeout=240,
        context=context)
    now = status(cluster, ns, name)
    assert uids() == before, context()
    assert now["state"] == "Running" and now["restarts"]["full"] == 0, context()
    assert not [i for i in now.get("incidents") or [] if i["cause"] == "NodeLost"], context()
