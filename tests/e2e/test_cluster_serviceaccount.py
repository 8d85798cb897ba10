"""A harness pod reaches the API server as a kubelet's pod does: as its own ServiceAccount.

The pod runs the kubernetes client's `load_incluster_config()` (the projected token, `ca.crt` and
`KUBERNETES_SERVICE_HOST/PORT`, nothing else: the node's admin kubeconfig is not in a pod's
environment) and asks the real API server who it is (SelfSubjectReview) and whether it may list
pods, before and after a RoleBinding grants it that.
"""

from __future__ import annotations

import json
import textwrap

import pytest
from harness.cluster import Cluster

pytestmark = pytest.mark.e2e

WHOAMI = textwrap.dedent("""
    import json, os, kubernetes
    from pathlib import Path
    directory = Path("/var/run/secrets/kubernetes.io/serviceaccount")
    out = {"files": sorted(p.name for p in directory.iterdir()) if directory.is_dir() else [],
           "kubeconfig": os.environ.get("KUBECONFIG")}
    if out["files"]:
        kubernetes.config.load_incluster_config()
        review = kubernetes.client.AuthenticationV1Api().create_self_subject_review(
            {"apiVersion": "authentication.k8s.io/v1", "kind": "SelfSubjectReview"})
        out["user"] = review.status.user_info.username
        out["namespace_file"] = (directory / "namespace").read_text()
        try:
            kubernetes.client.CoreV1Api().list_namespaced_pod(out["namespace_file"])
            out["list_pods"] = 200
        except kubernetes.client.ApiException as error:
            out["list_pods"] = error.status
    print("RESULT " + json.dumps(out), flush=True)
""")


def run_whoami(cluster: Cluster, namespace: str, name: str, **spec: object) -> dict[str, object]:
    pod = {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {
            "restartPolicy": "Never", **spec,
            "containers": [{"name": "c", "image": "python",
                            "command": ["python", "-c", WHOAMI]}],
        },
    }
    cluster.api.create(f"/api/v1/namespaces/{namespace}/pods", pod)
    done = cluster.wait_for_pod(namespace, name, phases=("Succeeded", "Failed"), timeout=60)
    log = cluster.pod_log(namespace, name)
    assert done["status"]["phase"] == "Succeeded", log
    (line,) = [line for line in log.splitlines() if line.startswith("RESULT ")]
    result: dict[str, object] = json.loads(line.removeprefix("RESULT "))
    return result


def test_a_pod_gets_its_service_account_token_and_the_api_address(
    cluster: Cluster, namespace: str,
) -> None:
    cluster.api.create(f"/api/v1/namespaces/{namespace}/serviceaccounts",
                       {"metadata": {"name": "reader"}})
    before = run_whoami(cluster, namespace, "before", serviceAccountName="reader")
    assert before["files"] == ["ca.crt", "namespace", "token"]
    assert before["kubeconfig"] is None
    assert before["user"] == f"system:serviceaccount:{namespace}:reader"
    assert before["namespace_file"] == namespace
    assert before["list_pods"] == 403  # RBAC applies to the token: no binding yet

    cluster.api.create(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/roles", {
        "metadata": {"name": "pod-reader"},
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]}],
    })
    cluster.api.create(
        f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings", {
            "metadata": {"name": "pod-reader"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                        "name": "pod-reader"},
            "subjects": [{"kind": "ServiceAccount", "name": "reader", "namespace": namespace}],
        })
    after = run_whoami(cluster, namespace, "after", serviceAccountName="reader")
    assert after["list_pods"] == 200

    # No serviceAccountName (the harness runs without the ServiceAccount admission plugin that
    # would set it): the namespace's `default` ServiceAccount, as on a real cluster.
    plain = run_whoami(cluster, namespace, "plain")
    assert plain["user"] == f"system:serviceaccount:{namespace}:default"

    opted_out = run_whoami(cluster, namespace, "opted-out", automountServiceAccountToken=False)
    assert opted_out["files"] == []
