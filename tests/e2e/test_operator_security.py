"""docs/security.md end to end: a CPU job trains to success in a namespace that enforces Pod
Security `restricted`, and a second job pointed at its checkpoints refuses them unless its spec
names the first job (`checkpoint.resumeFromJobs`).

The harness's pods run as the harness's user whatever their securityContext says: what this shows
is that the pods are admitted under `restricted` and the job works with them, not that the kernel
enforces the contexts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
from e2e.test_operator_jobs import (
    apply,
    cpu_tiny,
    describe,
    status,
    wait_for,
)
from harness.cluster import Cluster

if TYPE_CHECKING:
    from e2e.conftest import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def finished(cluster: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    current = status(cluster, ns, name)
    return current if current.get("state") in ("Succeeded", "Failed") else None


@pytest.mark.long
def test_a_job_in_a_restricted_namespace_succeeds_and_another_job_refuses_its_checkpoints(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns = namespace
    cluster.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted")

    first = cpu_tiny("first", steps=20, faults=None, interval_steps=10)
    apply(cluster, ns, first)
    done = wait_for("the first job to finish", lambda: finished(cluster, ns, "first"),
                    timeout=420, interval=2,
                    context=lambda: describe(cluster, ns, "first", operator))
    assert done["state"] == "Succeeded", describe(cluster, ns, "first", operator)
    assert done["lastCheckpoint"]["step"] == 20
    refused = next(c for c in done["conditions"] if c["type"] == "AdmissionRefused")
    assert refused["status"] == "False"
    policy = cluster.kubectl("get", "networkpolicy", "first", "-n", ns, "-o", "name").stdout
    assert policy.strip() == "networkpolicy.networking.k8s.io/first"

    # The same volume and directory, another job: refused, naming the job that wrote them.
    shared = {"claimName": "first-checkpoints", "path": f"{ns}/first", "intervalSteps": 10}
    second = cpu_tiny("second", steps=20, faults=None, interval_steps=10)
    second["spec"]["checkpoint"] = dict(shared)
    apply(cluster, ns, second)
    failed = wait_for("the second job to fail", lambda: finished(cluster, ns, "second"),
                      timeout=420, interval=2,
                      context=lambda: describe(cluster, ns, "second", operator))
    assert failed["state"] == "Failed" and failed["reason"] == "TrainerFatalError", failed
    assert "ForeignCheckpoint" in failed["message"], failed["message"]
    assert f"{ns}/first" in failed["message"], failed["message"]

    # Named on purpose: it starts from the first job's step 20 (and has nothing left to do).
    third = cpu_tiny("third", steps=20, faults=None, interval_steps=10)
    third["spec"]["checkpoint"] = {**shared, "resumeFromJobs": [f"{ns}/first"]}
    apply(cluster, ns, third)
    resumed = wait_for("the third job to finish", lambda: finished(cluster, ns, "third"),
                       timeout=420, interval=2,
                       context=lambda: describe(cluster, ns, "third", operator))
    assert resumed["state"] == "Succeeded", describe(cluster, ns, "third", operator)
    assert "resumed from step-000000020" in cluster.pod_log(ns, "third-0"), \
        cluster.pod_log(ns, "third-0")[-3000:]
