"""`faultTolerance.rendezvousDisruptionBudget: Enabled` against the real API server: one real
reconcile pass creates the PodDisruptionBudget `<job>-rdzv` with the rendezvous Service, the
API server accepts it as built, and its eviction API (what `kubectl drain` calls) refuses to evict
a Ready pod it selects while it lets a pod that is not Ready go (`unhealthyPodEvictionPolicy:
AlwaysAllow`). The job is suspended: the pass makes its Services and budget, no pods; the two
pods below carry the rendezvous pod's labels and are not scheduled (the eviction API reads only
the pod's labels and Ready condition, set here through the status subresource).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import kubernetes
import pytest
import yaml
from harness.cluster import Cluster
from kubernetes.client.exceptions import ApiException
from rtj_operator import reconcile, scraping
from rtj_operator.config import OperatorSettings

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SETTINGS = OperatorSettings()


def one_pass(cluster: Cluster, namespace: str, name: str) -> None:
    body = json.loads(cluster.kubectl("get", "rtj", name, "-n", namespace, "-o", "json").stdout)
    scraper = scraping.Scraper(concurrency=SETTINGS.scrape_concurrency,
                               timeout_seconds=SETTINGS.scrape_timeout_seconds)
    asyncio.run(reconcile.run_pass(body=body, memo=reconcile.JobMemo(),
                                   api=cluster.api_client(), settings=SETTINGS, scraper=scraper))


def rendezvous_like_pod(cluster: Cluster, namespace: str, job: str, name: str,
                        ready: bool) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": name, "labels": {"training.resilient.dev/job": job,
                                                  "training.resilient.dev/role": "rendezvous"}},
           "spec": {"containers": [{"name": "c", "image": "rtj-trainer:dev"}]}}
    cluster.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(pod))
    status = {"status": {"phase": "Running", "conditions": [
        {"type": "Ready", "status": "True" if ready else "False"}]}}
    cluster.kubectl("patch", "pod", name, "-n", namespace, "--subresource=status",
                    "--type=merge", "-p", json.dumps(status))


def evict(cluster: Cluster, namespace: str, name: str) -> ApiException | None:
    core = kubernetes.client.CoreV1Api(cluster.api_client())
    body = kubernetes.client.V1Eviction(
        metadata=kubernetes.client.V1ObjectMeta(name=name, namespace=namespace))
    try:
        core.create_namespaced_pod_eviction(name, namespace, body)
    except ApiException as error:
        return error
    return None


def test_the_rendezvous_budget_refuses_to_evict_a_ready_rendezvous_pod(
    cluster: Cluster, namespace: str
) -> None:
    document: dict[str, Any] = yaml.safe_load((REPO / "examples" / "cpu-tiny.yaml").read_text())
    document["metadata"] = {"name": "kept", "namespace": namespace}
    document["spec"]["suspend"] = True
    document["spec"].setdefault("faultTolerance", {})["rendezvousDisruptionBudget"] = "Enabled"
    cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(document))
    one_pass(cluster, namespace, "kept")
    budget = json.loads(cluster.kubectl("get", "pdb", "kept-rdzv", "-n", namespace, "-o",
                                        "json").stdout)
    job_uid = json.loads(cluster.kubectl("get", "rtj", "kept", "-n", namespace, "-o",
                                         "json").stdout)["metadata"]["uid"]
    assert budget["spec"]["maxUnavailable"] == 0
    assert budget["metadata"]["ownerReferences"][0]["uid"] == job_uid
    cluster.kubectl("get", "service", "kept-rdzv", "-n", namespace)  # made in the same pass

    rendezvous_like_pod(cluster, namespace, "kept", "kept-rdzv", ready=True)
    refused = evict(cluster, namespace, "kept-rdzv")
    assert refused is not None and refused.status == 429, refused
    assert "disruption budget" in str(refused.body)
    cluster.kubectl("get", "pod", "kept-rdzv", "-n", namespace)  # still there

    rendezvous_like_pod(cluster, namespace, "kept", "kept-rdzv-stuck", ready=False)
    assert evict(cluster, namespace, "kept-rdzv-stuck") is None  # not Ready: it may go


def test_no_budget_unless_enabled(cluster: Cluster, namespace: str) -> None:
    document: dict[str, Any] = yaml.safe_load((REPO / "examples" / "cpu-tiny.yaml").read_text())
    document["metadata"] = {"name": "plain", "namespace": namespace}
    document["spec"]["suspend"] = True
    cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(document))
    one_pass(cluster, namespace, "plain")
    cluster.kubectl("get", "service", "plain-rdzv", "-n", namespace)
    missing = cluster.kubectl("get", "pdb", "plain-rdzv", "-n", namespace, check=False)
    assert missing.returncode != 0 and "NotFound" in missing.stderr
