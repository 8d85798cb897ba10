"""The Kueue integration against the real API server and real Kueue (harness.kueue), one reconcile
pass at a time (`reconcile.run_pass`, as the operator's handlers call it; the status it returns
is written as the handler writes it). No pass ever runs on a started job, so no pod is made and
no trainer runs: what is checked is the job, its Workload and what Kueue does with them.

One ClusterQueue whose quota fits exactly one 2-node p5 job (CPU, memory, GPUs, EFA devices and
hugepages of both trainer pods and the rendezvous pod); two jobs:

- both are held (suspended) and get a Workload whose pod sets ask for what their pods ask for;
- Kueue admits the first: one pass starts it in one update (the flavor's node labels and
  toleration merged into its placement, `suspend: false`); the second stays `Queued`, with
  Kueue's "insufficient quota" message in its condition, its status and `kubectl get rtj -o wide`;
- the first Workload is deactivated (an eviction): the job is suspended, then, with no pod left,
  gets its own placement back and its Workload's admission is cleared; Kueue admits the second,
  and the first waits, `Queued` as deactivated.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import yaml
from harness.cluster import Cluster
from harness.kueue import Kueue, queue_manifests
from rtj_operator import naming, reconcile, scraping
from rtj_operator.config import OperatorSettings

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SETTINGS = OperatorSettings()
T = TypeVar("T")
ONE_JOB_QUOTA = {
    # 2 trainer pods of the p5.48xlarge profile (184 CPU, 1800Gi, 8 GPUs, 32 EFA, 5120Mi of
    # 2 MiB hugepages each) + the rendezvous pod (250m, 512Mi): one job fits, two do not.
    "cpu": "369", "memory": "3601Gi", "nvidia.com/gpu": "16",
    "vpc.amazonaws.com/efa": "64", "hugepages-2Mi": "10Gi",
}
FLAVOR_TOLERATION = {"key": "example.com/reserved", "operator": "Exists", "effect": "NoSchedule"}


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 60) -> T:
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.5)


class Job:
    """One labelled job and its passes (its memo kept between them, as the operator does)."""

    def __init__(self, cluster: Cluster, namespace: str, name: str, queue: str) -> None:
        self.cluster, self.namespace, self.name = cluster, namespace, name
        self.memo = reconcile.JobMemo()
        manifest = yaml.safe_load((REPO / "examples" / "cpu-tiny.yaml").read_text())
        manifest["metadata"] = {"name": name, "namespace": namespace,
                                "labels": {"kueue.x-k8s.io/queue-name": queue}}
        manifest["spec"]["checkpoint"] = {"claimName": f"{name}-none"}
        manifest["spec"]["podTemplate"] = {"nodeSelector": {"team": "research"}}
        cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(manifest))

    def body(self) -> dict[str, Any]:
        result: dict[str, Any] = json.loads(self.cluster.kubectl(
            "get", "rtj", self.name, "-n", self.namespace, "-o", "json").stdout)
        return result

    def run_pass(self) -> reconcile.PassResult:
        scraper = scraping.Scraper(concurrency=1, timeout_seconds=1)
        result = asyncio.run(reconcile.run_pass(
            body=self.body(), memo=self.memo, api=self.cluster.api_client(), settings=SETTINGS,
            scraper=scraper))
        if result.status_patch:  # what the handler does with it
            self.cluster.api.patch(
                f"/apis/training.resilient.dev/v1alpha1/namespaces/{self.namespace}"
                f"/resilienttrainingjobs/{self.name}/status", {"status": result.status_patch})
        return result

    def workload(self) -> dict[str, Any] | None:
        uid = self.body()["metadata"]["uid"]
        return self.cluster.api.get_or_none(
            f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{self.namespace}/workloads/"
            f"{naming.workload_name(self.name, uid)}")

    def condition(self, kind: str) -> dict[str, Any]:
        for condition in (self.workload() or {}).get("status", {}).get("conditions", []):
            if condition["type"] == kind:
                return dict(condition)
        return {}

    def queued(self) -> dict[str, Any]:
        conditions = self.body().get("status", {}).get("conditions", [])
        return next(c for c in conditions if c["type"] == "Queued")


def test_one_job_runs_the_other_waits_for_quota_and_an_eviction_requeues(
    cluster: Cluster, kueue: Kueue, namespace: str
) -> None:
    queue = f"q-{namespace}"
    for item in queue_manifests(queue, namespace=namespace, quota=ONE_JOB_QUOTA,
                                node_labels={"node.kubernetes.io/instance-type": "p5.48xlarge"},
                                tolerations=[FLAVOR_TOLERATION]):
        cluster.kubectl("apply", "--server-side", "-f", "-", input=json.dumps(item))
    try:
        first, second = (Job(cluster, namespace, name, queue) for name in ("first", "second"))

        # Created: held, with a Workload that asks for what the pods ask for.
        first.run_pass()
        body = first.body()
        assert body["spec"]["suspend"] is True
        assert body["status"]["state"] == "Queued"
        workload = first.workload()
        assert workload is not None
        assert workload["spec"]["queueName"] == queue
        assert workload["metadata"]["labels"]["kueue.x-k8s.io/job-uid"] == body["metadata"]["uid"]
        owner = workload["metadata"]["ownerReferences"][0]
        assert (owner["kind"], owner["name"], owner["controller"]) == (
            "ResilientTrainingJob", "first", True)
        trainer, rendezvous = workload["spec"]["podSets"]
        assert (trainer["name"], trainer["count"]) == ("trainer", 2)
        requests = trainer["template"]["spec"]["containers"][0]["resources"]["requests"]
        assert requests == {"cpu": "184", "memory": "1800Gi", "nvidia.com/gpu": "8",
                            "vpc.amazonaws.com/efa": "32", "hugepages-2Mi": "5120Mi"}
        assert trainer["template"]["spec"]["nodeSelector"] == {
            "node.kubernetes.io/instance-type": "p5.48xlarge", "team": "research"}
        assert (rendezvous["name"], rendezvous["count"]) == ("rendezvous", 1)

        # Kueue admits the first; one pass starts it with the flavor's placement.
        wait_for("the first Workload admitted",
                 lambda: first.condition("Admitted").get("status") == "True")
        first.run_pass()
        body = first.body()
        assert body["spec"]["suspend"] is False
        assert body["spec"]["podTemplate"]["nodeSelector"] == {
            "team": "research", "node.kubernetes.io/instance-type": "p5.48xlarge"}
        assert body["spec"]["podTemplate"]["tolerations"] == [FLAVOR_TOLERATION]
        assert json.loads(body["metadata"]["annotations"][naming.PLACEMENT_ANNOTATION]) == {
            "nodeSelector": {"team": "research"}, "tolerations": []}
        assert first.queued()["status"] == "False" and first.queued()["reason"] == "Admitted"

        # The second waits for quota, and says so.
        second.run_pass()
        pending = wait_for("Kueue's verdict on the second Workload",
                           lambda: second.condition("QuotaReserved").get("message"))
        assert "insufficient" in pending, pending
        second.run_pass()
        body = second.body()
        assert body["spec"]["suspend"] is True
        assert body["status"]["state"] == "Queued"
        assert body["status"]["reason"] == "WaitingForAdmission"
        assert pending in body["status"]["message"]
        assert second.queued()["status"] == "True" and pending in second.queued()["message"]
        printed = cluster.kubectl("get", "rtj", "second", "-n", namespace, "-o", "wide").stdout
        assert "Queued" in printed and "insufficient" in printed, printed

        # Evict the first (deactivate its Workload): suspended, then requeued without pods.
        cluster.api.patch(
            f"/apis/kueue.x-k8s.io/v1beta2/namespaces/{namespace}/workloads/"
            f"{first.workload()['metadata']['name']}",  # type: ignore[index]
            {"spec": {"active": False}})
        wait_for("the first Workload evicted",
                 lambda: first.condition("Evicted").get("status") == "True")
        first.run_pass()
        assert first.body()["spec"]["suspend"] is True
        first.run_pass()
        body = first.body()
        assert body["spec"]["podTemplate"]["nodeSelector"] == {"team": "research"}
        assert body["spec"]["podTemplate"]["tolerations"] == []
        assert naming.PLACEMENT_ANNOTATION not in body["metadata"].get("annotations", {})
        assert body["status"]["state"] == "Queued"
        assert body["status"]["reason"] == "Evicted"
        workload = first.workload()
        assert workload is not None and "admission" not in workload["status"]
        assert first.condition("QuotaReserved")["status"] == "False"

        # Its quota went back: Kueue admits the second, which starts.
        wait_for("the second Workload admitted",
                 lambda: second.condition("Admitted").get("status") == "True")
        second.run_pass()
        assert second.body()["spec"]["suspend"] is False
        # The evicted one now waits as any queued job, in Kueue's terms: deactivated.
        first.run_pass()
        body = first.body()
        assert (body["status"]["state"], body["status"]["reason"]) == (
            "Queued", "WaitingForAdmission")
        assert "deactivated" in body["status"]["message"]
    finally:
        for kind in ("clusterqueue", "resourceflavor"):
            cluster.kubectl("delete", kind, queue, "--wait=false", "--ignore-not-found",
                            check=False)
