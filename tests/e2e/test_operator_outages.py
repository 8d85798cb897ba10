"""Control-plane outages end to end (issue #31): kube-apiserver stopped for longer than kopf's
watch retries (1 + 1 + 2 + 3 + 5 + 8 + 13 + 21 s, about 54 s) while the job trains and finishes.
The real control plane (tests/harness: `ControlPlane.stop_server` / `start_server`, same port,
certificates and etcd data), process-backed nodes, the real trainer under ft_launcher and the
operator as its own process (tests/e2e/conftest.py).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import pytest
from e2e.test_operator_jobs import apply, cpu_tiny, describe, status, wait_for
from harness.cluster import Cluster

if TYPE_CHECKING:
    from e2e.conftest import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

STEPS = 50
OUTAGE_SECONDS = 90


@pytest.mark.long
def test_a_90_s_api_server_outage_while_the_job_finishes_costs_no_restart(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """Found with `bench.chaos --kinds apiserver-stop --apiserver-down-seconds 90`: the trainers
    finished during the outage, the harness's kubelet could not write their pods' final status
    and never tried again, so the pods stayed Running in the API for ever and the job Pending.
    A kubelet's status manager writes again until the API has what it knows; the harness's now
    does too. The operator outlives the outage (the same process), the job ends Succeeded with
    no restart, and its status catches up within seconds of the API server's return."""
    ns, name = namespace, "outage"
    manifest = cpu_tiny(name, steps=STEPS, faults=None)
    manifest["spec"]["args"] += ["--set", "train.min_step_seconds=2"]  # ~100 s of training
    apply(cluster, ns, manifest)
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    wait_for("step 15", lambda: (status(cluster, ns, name).get("step") or 0) >= 15,
             timeout=240, context=context)
    before = status(cluster, ns, name)
    pid = operator.process.pid
    control = cluster.control_plane
    control.stop_server("kube-apiserver")
    try:
        time.sleep(OUTAGE_SECONDS)
    finally:
        control.start_server("kube-apiserver")
    back = time.monotonic()
    final = wait_for("the job to finish", lambda: (
        s if (s := status(cluster, ns, name)).get("state") in ("Succeeded", "Failed") else None),
        timeout=120, interval=1, context=context)
    caught_up = time.monotonic() - back
    assert final["state"] == "Succeeded", context()
    assert final["step"] == STEPS, final
    assert final["restarts"]["total"] == before["restarts"]["total"] == 0, context()
    assert operator.process.poll() is None and operator.process.pid == pid, context()
    assert caught_up < 30, f"{caught_up:.1f} s from the API server's return\n{context()}"
