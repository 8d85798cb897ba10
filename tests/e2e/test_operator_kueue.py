"""Queueing through real Kueue, end to end: real control plane, process-backed p5 nodes, Kueue's
controller manager (harness.kueue), the operator as its own process and the real trainer.

A ClusterQueue whose one ResourceFlavor (nodes labelled p5.48xlarge, plus a toleration) has the
quota of exactly one 2-node p5 job, and two such jobs applied to its LocalQueue together: the one
Kueue admits runs to `Succeeded` with the flavor's placement; the other stays suspended, `Queued`
with Kueue's "insufficient quota" message in its status and in `kubectl get rtj`, until the first
has finished and its Workload is `Finished`; then Kueue admits it and it runs to `Succeeded` too.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
from e2e.test_operator_jobs import apply, cpu_tiny, job, pods_by_role, status, wait_for
from harness.cluster import Cluster
from harness.kueue import Kueue, queue_manifests
from rtj_operator import naming

if TYPE_CHECKING:
    from e2e.conftest import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ONE_JOB_QUOTA = {
    # 2 trainer pods of the p5.48xlarge profile + the rendezvous pod (250m, 512Mi): one job.
    "cpu": "369", "memory": "3601Gi", "nvidia.com/gpu": "16",
    "vpc.amazonaws.com/efa": "64", "hugepages-2Mi": "10Gi",
}
FLAVOR_TOLERATION = {"key": "example.com/reserved", "operator": "Exists", "effect": "NoSchedule"}


def workload(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    uid = job(cluster, ns, name)["metadata"]["uid"]
    return cluster.api.get(f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{ns}/workloads/"
                           f"{naming.workload_name(name, uid)}")


def finished_condition(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    conditions = workload(cluster, ns, name).get("status", {}).get("conditions", [])
    return next((c for c in conditions if c["type"] == "Finished"), {})


def test_two_jobs_in_a_queue_for_one_run_one_after_the_other(
    cluster: Cluster, kueue: Kueue, namespace: str, operator: OperatorProcess
) -> None:
    ns, queue = namespace, f"q-{namespace}"
    for item in queue_manifests(queue, namespace=ns, quota=ONE_JOB_QUOTA,
                                node_labels={"node.kubernetes.io/instance-type": "p5.48xlarge"},
                                tolerations=[FLAVOR_TOLERATION]):
        cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(item))
    context = lambda: (  # noqa: E731
        cluster.kubectl("get", "rtj,workloads,pods", "-n", ns, "-o", "wide").stdout
        + f"\n--- operator log (tail)\n{operator.log()[-4000:]}"
        + f"\n--- kueue log (tail)\n{kueue.log()[-3000:]}")
    try:
        for name in ("first", "second"):
            manifest = cpu_tiny(name, steps=20, faults=None)
            manifest["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": queue}
            apply(cluster, ns, manifest)

        # Both are queued at once (Kueue orders Workloads created in the same second as it
        # likes): one runs with the flavor's placement, the other waits for quota and says why.
        def trainers_of_a_running_job() -> tuple[str, dict[str, Any]] | None:
            pods = pods_by_role(cluster, ns, "trainer")
            for name in ("first", "second"):
                mine = {n: p for n, p in pods.items() if n.startswith(f"{name}-")}
                if len(mine) == 2:
                    return name, mine
            return None

        running, trainers = wait_for("one job's trainer pods", trainers_of_a_running_job,
                                     timeout=90, context=context)
        waiting = "second" if running == "first" else "first"
        for pod in trainers.values():
            assert FLAVOR_TOLERATION in pod["spec"]["tolerations"]
            assert pod["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"] == "p5.48xlarge"
        queued = wait_for(f"{waiting} Queued with Kueue's reason", lambda: (
            s if (s := status(cluster, ns, waiting)).get("state") == "Queued"
            and "insufficient" in s.get("message", "") else None), timeout=60, context=context)
        assert queued["reason"] == "WaitingForAdmission"
        condition = next(c for c in queued["conditions"] if c["type"] == "Queued")
        assert condition["status"] == "True" and "insufficient" in condition["message"]
        printed = cluster.kubectl("get", "rtj", waiting, "-n", ns).stdout
        assert printed.splitlines()[1].split()[:2] == [waiting, "Queued"], printed
        wide = cluster.kubectl("get", "rtj", waiting, "-n", ns, "-o", "wide").stdout
        assert "WaitingForAdmission" in wide and "insufficient" in wide, wide

        # Until the running one has finished, the other has no pod and stays suspended. The
        # waiting job is read first and the running one's state after it: the operator marks the
        # Workload Finished (which lets Kueue start the waiting job) only once the running job's
        # status says it finished, so a waiting job found started means a running job found
        # finished.
        def running_done() -> bool:
            suspended = job(cluster, ns, waiting)["spec"]["suspend"]
            started = [n for n in pods_by_role(cluster, ns, "trainer")
                       if n.startswith(f"{waiting}-")]
            if status(cluster, ns, running).get("state") in ("Succeeded", "Failed"):
                return True
            assert suspended is True and not started, (suspended, started)
            return False

        wait_for(f"{running} to finish", running_done, timeout=300, interval=2, context=context)
        assert status(cluster, ns, running)["state"] == "Succeeded", context()
        # The Workload is marked Finished by the pass after the one that wrote Succeeded.
        wait_for(f"{running}'s Workload Finished", lambda: finished_condition(
            cluster, ns, running).get("reason") == "Succeeded", timeout=60, context=context)

        # Its quota released, the other is admitted and runs to the end.
        wait_for(f"{waiting} to finish", lambda: status(cluster, ns, waiting).get("state")
                 in ("Succeeded", "Failed"), timeout=300, interval=2, context=context)
        final = status(cluster, ns, waiting)
        assert final["state"] == "Succeeded", context()
        assert final["step"] == 20
        assert next(c for c in final["conditions"] if c["type"] == "Queued")["reason"] \
            == "Admitted"
        wait_for(f"{waiting}'s Workload Finished", lambda: finished_condition(
            cluster, ns, waiting).get("reason") == "Succeeded", timeout=60, context=context)
    finally:
        for kind in ("clusterqueue", "resourceflavor"):
            cluster.kubectl("delete", kind, queue, "--wait=false", "--ignore-not-found",
                            check=False)
