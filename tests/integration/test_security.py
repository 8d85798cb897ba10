"""The hardening of docs/security.md against the real API server of the harness.

- Pod Security admission (the kube-apiserver's PodSecurity plugin, on by default in 1.34; the
  harness disables only the ServiceAccount plugin): the trainer and rendezvous pods the builders
  make are applied (server-side dry run, so nothing runs) into namespaces labelled
  `pod-security.kubernetes.io/enforce: restricted` and `baseline`; which pass and which are
  refused, with the server's message.
- A refused create becomes the `AdmissionRefused` condition through one real reconcile pass.
- The job's NetworkPolicy is accepted by the API server as built (the harness runs no CNI: it is
  not enforced there; see docs/security.md).
- The ValidatingAdmissionPolicy example (docs/examples/rtj-admission-policy.yaml) refuses a job
  that names a forbidden ServiceAccount or PriorityClass with the policy's message, and accepts
  an allowed one.

Pods in the harness run as the harness's own user whatever their runAsUser says: these tests
check what admission decides, not what the kernel enforces.
"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.cluster import Cluster
from rtj_operator import builders, reconcile, scraping
from rtj_operator.api.models import parse_job
from rtj_operator.config import OperatorSettings
from rtj_operator.podplan import plan_for

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
POLICY = REPO / "docs" / "examples" / "rtj-admission-policy.yaml"
SETTINGS = OperatorSettings()
ENFORCE = "pod-security.kubernetes.io/enforce"


def labelled_namespace(cluster: Cluster, level: str) -> str:
    name = cluster.create_namespace(f"psa-{level}")
    cluster.kubectl("label", "namespace", name, f"{ENFORCE}={level}")
    return name


@pytest.fixture(scope="module")
def levels(cluster: Cluster) -> Iterator[dict[str, str]]:
    namespaces = {level: labelled_namespace(cluster, level) for level in ("restricted",
                                                                          "baseline")}
    try:
        yield namespaces
    finally:
        for name in namespaces.values():
            cluster.delete_namespace(name)


def example_job(name: str, namespace: str, **template: Any) -> Any:
    document = yaml.safe_load((REPO / "examples" / name).read_text())
    document["metadata"].update(namespace=namespace, uid="0a1b2c3d-uid")
    # The harness has no PriorityClass `training-high` (Priority admission would refuse first).
    document["spec"].get("podTemplate", {}).pop("priorityClassName", None)
    if template:
        document["spec"]["podTemplate"] = {**document["spec"].get("podTemplate", {}),
                                           **template}
    return parse_job(document)


def pods_of(job: Any) -> list[dict[str, Any]]:
    plan = plan_for(job, SETTINGS)
    return [builders.trainer_pod(job, plan=plan, node_index=0, attempt=0, settings=SETTINGS),
            builders.rendezvous_pod(job, plan=plan, settings=SETTINGS)]


def admit(cluster: Cluster, manifest: dict[str, Any]) -> str:
    """Create `manifest` as a server-side dry run; '' when admitted, else the server's error."""
    body = copy.deepcopy(manifest)
    body["metadata"].pop("ownerReferences", None)  # the job is not in the cluster
    out = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(body),
                          check=False)
    return "" if out.returncode == 0 else out.stderr.strip()


CASES = [
    # (example, podTemplate additions, {level: expected refusal substring or "" for admitted})
    ("cpu-tiny.yaml", {}, {"restricted": "", "baseline": ""}),
    ("p5-static-fsx.yaml", {}, {"restricted": "", "baseline": ""}),
    ("p5-static-fsx.yaml", {"memoryLock": True},
     {"restricted": 'unrestricted capabilities (container "trainer" must not include "IPC_LOCK"',
      "baseline": 'non-default capabilities (container "trainer" must not include "IPC_LOCK"'}),
    ("cpu-tiny.yaml", {"securityContext": {"runAsNonRoot": False}},
     {"restricted": "runAsNonRoot != true", "baseline": ""}),
    ("cpu-tiny.yaml", {"containerSecurityContext": {"allowPrivilegeEscalation": True}},
     {"restricted": "allowPrivilegeEscalation != false", "baseline": ""}),
]


@pytest.mark.parametrize(("example", "template", "expected"), CASES,
                         ids=["cpu-tiny", "p5", "p5-memoryLock", "runAsNonRoot-false",
                              "privilege-escalation"])
def test_pod_security_admission_of_the_built_pods(
    cluster: Cluster, levels: dict[str, str], example: str, template: dict[str, Any],
    expected: dict[str, str],
) -> None:
    for level, refusal in expected.items():
        job = example_job(example, levels[level], **template)
        for pod in pods_of(job):
            error = admit(cluster, pod)
            role = pod["metadata"]["labels"]["training.resilient.dev/role"]
            if not refusal or (role != "trainer" and "IPC_LOCK" in refusal):
                assert error == "", f"{example} {role} refused under {level}: {error}"
            else:
                assert f'violates PodSecurity "{level}:latest"' in error, error
                assert refusal in error, error


def test_the_old_pod_shape_is_refused_by_baseline(
    cluster: Cluster, levels: dict[str, str]
) -> None:
    """What the pods looked like before (review S2): IPC_LOCK, no security context."""
    pod = pods_of(example_job("p5-static-fsx.yaml", levels["baseline"]))[0]
    del pod["spec"]["securityContext"]
    pod["spec"]["containers"][0]["securityContext"] = {"capabilities": {"add": ["IPC_LOCK"]}}
    assert "non-default capabilities" in admit(cluster, pod)


def test_a_refused_create_becomes_the_admission_refused_condition(
    cluster: Cluster, levels: dict[str, str]
) -> None:
    """One real reconcile pass (observe, decide, act) for a job whose pods restricted refuses:
    the pass returns its status with the condition and a Warning Event instead of raising
    kopf.TemporaryError; the Services and the NetworkPolicy are created."""
    namespace = levels["restricted"]
    document = yaml.safe_load((REPO / "examples" / "cpu-tiny.yaml").read_text())
    document["metadata"] = {"name": "refused", "namespace": namespace}
    document["spec"]["podTemplate"] = {"containerSecurityContext":
                                       {"allowPrivilegeEscalation": True}}
    document["spec"]["checkpoint"] = {"claimName": "none"}
    cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(document))
    body = json.loads(cluster.kubectl("get", "rtj", "refused", "-n", namespace, "-o",
                                      "json").stdout)
    scraper = scraping.Scraper(concurrency=SETTINGS.scrape_concurrency,
                               timeout_seconds=SETTINGS.scrape_timeout_seconds)
    result = asyncio.run(reconcile.run_pass(
        body=body, memo=reconcile.JobMemo(), api=cluster.api_client(), settings=SETTINGS,
        scraper=scraper))
    refused = next(c for c in result.status_patch["conditions"]
                   if c["type"] == "AdmissionRefused")
    assert refused["status"] == "True" and refused["reason"] == "PodSecurity"
    assert 'Pod refused-rdzv: pods "refused-rdzv" is forbidden: violates PodSecurity ' \
        '"restricted:latest": allowPrivilegeEscalation != false' in refused["message"]
    assert "Pod refused-0:" in refused["message"] and "Pod refused-1:" in refused["message"]
    assert [e.type for e in result.events if e.reason == "AdmissionRefused"] == ["Warning"]
    assert result.status_patch["state"] == "Pending"
    names = cluster.kubectl("get", "pods,services,networkpolicies", "-n", namespace, "-o",
                            "name").stdout.split()
    assert not [n for n in names if n.startswith("pod/")]
    assert {"service/refused", "service/refused-rdzv",
            "networkpolicy.networking.k8s.io/refused"} <= set(names)


def test_the_api_server_accepts_the_network_policy_as_built(
    cluster: Cluster, namespace: str
) -> None:
    settings = replace(SETTINGS, network_policy_operator_namespace="rtj-system",
                       network_policy_operator_labels="app.kubernetes.io/name=rtj-operator")
    job = example_job("cpu-tiny.yaml", namespace)
    policy = builders.network_policy(job, plan=plan_for(job, settings), settings=settings)
    policy["metadata"].pop("ownerReferences")
    cluster.kubectl("create", "-f", "-", input=json.dumps(policy))
    stored = json.loads(cluster.kubectl("get", "networkpolicy", "cpu-tiny", "-n", namespace,
                                        "-o", "json").stdout)
    assert stored["spec"] == policy["spec"]  # nothing dropped or defaulted away (endPort kept)


def test_a_jobs_network_policy_follows_the_operator_when_its_settings_change(
    cluster: Cluster, namespace: str
) -> None:
    """review-2 F7: the policy was created once and never compared, so an operator moved to
    another namespace (or a Prometheus named later) stayed locked out of running jobs. Real
    passes against the API server: the first makes the policy and records its digest on the
    headless Service; a pass with the operator's namespace set replaces the policy in place
    (same object, new rules) and records the new digest; a further pass changes nothing."""
    document = yaml.safe_load((REPO / "examples" / "cpu-tiny.yaml").read_text())
    document["metadata"] = {"name": "moved", "namespace": namespace}
    document["spec"]["suspend"] = True  # the children, no pods
    cluster.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(document))
    scraper = scraping.Scraper(concurrency=SETTINGS.scrape_concurrency,
                               timeout_seconds=SETTINGS.scrape_timeout_seconds)
    memo = reconcile.JobMemo()

    def one_pass(settings: OperatorSettings) -> reconcile.PassResult:
        body = json.loads(cluster.kubectl("get", "rtj", "moved", "-n", namespace, "-o",
                                          "json").stdout)
        return asyncio.run(reconcile.run_pass(body=body, memo=memo, api=cluster.api_client(),
                                              settings=settings, scraper=scraper))

    def stored() -> tuple[dict[str, Any], str]:
        policy = json.loads(cluster.kubectl("get", "networkpolicy", "moved", "-n", namespace,
                                            "-o", "json").stdout)
        service = json.loads(cluster.kubectl("get", "service", "moved", "-n", namespace, "-o",
                                             "json").stdout)
        return policy, service["metadata"]["annotations"]["training.resilient.dev/network-policy"]

    one_pass(SETTINGS)
    before, digest = stored()
    assert len(before["spec"]["ingress"]) == 1  # no operator rule: no operator namespace
    moved = replace(SETTINGS, network_policy_operator_namespace="rtj-system",
                    network_policy_operator_labels="app.kubernetes.io/name=rtj-operator")
    result = one_pass(moved)
    after, new_digest = stored()
    assert after["metadata"]["uid"] == before["metadata"]["uid"]  # replaced in place
    assert new_digest != digest
    assert after["spec"]["ingress"][1]["from"][0] == {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "rtj-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "rtj-operator"}}}
    assert [e.reason for e in result.events].count("NetworkPolicyUpdated") == 1
    deadline = time.monotonic() + 10
    while True:  # the next pass lists the Service with the new digest: nothing more to do
        again = one_pass(moved)
        if "NetworkPolicyUpdated" not in [e.reason for e in again.events]:
            break
        assert time.monotonic() < deadline, "the policy was rendered again and again"
    assert stored()[0]["metadata"]["resourceVersion"] == after["metadata"]["resourceVersion"]


# --- the ValidatingAdmissionPolicy example ------------------------------------------------------


def job_document(name: str, **template: Any) -> str:
    return yaml.safe_dump({
        "apiVersion": "training.resilient.dev/v1alpha1",
        "kind": "ResilientTrainingJob",
        "metadata": {"name": name},
        "spec": {"nodes": 1, "image": "rtj-trainer:dev", "suspend": True,
                 "checkpoint": {"claimName": "fsx"}, "podTemplate": template},
    })


@pytest.fixture
def restricted_rtj_namespace(cluster: Cluster) -> Iterator[str]:
    cluster.kubectl("apply", "-f", str(POLICY))
    name = cluster.create_namespace("vap")
    cluster.kubectl("label", "namespace", name, "training.resilient.dev/restricted=true")
    try:
        yield name
    finally:
        cluster.delete_namespace(name)
        cluster.kubectl("delete", "-f", str(POLICY), "--ignore-not-found")


def refusal(cluster: Cluster, namespace: str, document: str, timeout: float = 30) -> str:
    """Apply `document` until the policy is in force (the API server loads a new policy within
    a few seconds); '' when accepted, else the error."""
    deadline = time.monotonic() + timeout
    while True:
        out = cluster.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                              input=document, check=False)
        if out.returncode != 0 or time.monotonic() > deadline:
            return out.stderr.strip() if out.returncode else ""
        time.sleep(0.5)


def test_the_admission_policy_example_refuses_forbidden_service_accounts_and_priorities(
    cluster: Cluster, restricted_rtj_namespace: str
) -> None:
    namespace = restricted_rtj_namespace
    error = refusal(cluster, namespace, job_document("sa", serviceAccountName="admin"))
    assert ('resilienttrainingjobs.training.resilient.dev "sa" is forbidden: '
            "ValidatingAdmissionPolicy 'rtj-restrict-pods' with binding 'rtj-restrict-pods' "
            "denied request: spec.podTemplate.serviceAccountName must be one of "
            "[default, trainer]") in error, error
    error = refusal(cluster, namespace,
                    job_document("prio", priorityClassName="system-cluster-critical"))
    assert "spec.podTemplate.priorityClassName must be one of [training-low, training-high]" \
        in error, error
    error = refusal(cluster, namespace, job_document("tol", tolerations=[{"operator": "Exists"}]))
    assert "a toleration must name a taint key" in error, error
    error = refusal(cluster, namespace, job_document("ipc", memoryLock=True))
    assert "memoryLock" in error, error
    # Allowed values are accepted, for real this time.
    allowed = job_document("ok", serviceAccountName="trainer", priorityClassName="training-high",
                           tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}])
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=allowed)
    # The binding selects labelled namespaces only: elsewhere the same job is not checked.
    other = cluster.create_namespace("vap-other")
    try:
        cluster.kubectl("apply", "-n", other, "-f", "-",
                        input=job_document("sa", serviceAccountName="admin"))
    finally:
        cluster.delete_namespace(other)
