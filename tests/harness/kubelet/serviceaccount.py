"""What a kubelet gives every pod to reach the API server: a projected ServiceAccount token and
the in-cluster API address.

As kubelet does for a pod whose `automountServiceAccountToken` (the pod's, else its
ServiceAccount's) is not false, the harness asks the TokenRequest API for a token of the pod's
ServiceAccount, bound to the pod (it stops working once the pod is gone) with the API server's
default audience, and writes `token`, `ca.crt` and `namespace` into a per-pod directory mounted
read-only at /var/run/secrets/kubernetes.io/serviceaccount (the pod's private mount namespace,
podinit.py). Every container also gets `KUBERNETES_SERVICE_HOST`/`KUBERNETES_SERVICE_PORT` (and
the `KUBERNETES_PORT*` forms) pointing at the real API server, 127.0.0.1:<port>: there is no
kube-proxy for the `kubernetes` Service's ClusterIP. So `load_incluster_config()` (kubernetes
client, kopf) works in a pod with the pod's own identity, under the RBAC of its ServiceAccount.

Not done: the token is not refreshed at 80 % of its lifetime as kubelet does; it is requested
for an hour (the API server's default extension makes it last longer), far beyond a test.
"""

from __future__ import annotations

import urllib.parse
from pathlib import Path

from harness.kubeapi import JsonObject, KubeApi
from harness.nodestate import NotReadyToStart

MOUNT_PATH = "/var/run/secrets/kubernetes.io/serviceaccount"
TOKEN_EXPIRATION_SECONDS = 3607  # kubelet's own request (an hour, plus 7 s to tell it apart)


def mount_target() -> str:
    """MOUNT_PATH with its symlinks resolved (/var/run -> /run on most hosts).

    Host mount points are created and removed by path, and `mounted_in_any_namespace` compares
    paths against /proc/*/mountinfo, which shows resolved paths; the unresolved one would let a
    cluster remove a mount point another cluster's pod still uses."""
    path = Path(MOUNT_PATH)
    for parent in reversed(path.parents):
        if parent.is_symlink():
            return str(parent.resolve() / path.relative_to(parent))
    return MOUNT_PATH


def automounts_token(pod: JsonObject, service_account: JsonObject | None) -> bool:
    """kubelet's rule: the pod's `automountServiceAccountToken` wins, then the ServiceAccount's;
    unset in both means true."""
    spec = pod.get("spec", {})
    if spec.get("automountServiceAccountToken") is not None:
        return bool(spec["automountServiceAccountToken"])
    if service_account is not None and service_account.get("automountServiceAccountToken") \
            is not None:
        return bool(service_account["automountServiceAccountToken"])
    return True


def service_account_name(pod: JsonObject) -> str:
    spec = pod.get("spec", {})
    return str(spec.get("serviceAccountName") or spec.get("serviceAccount") or "default")


def api_service_env(server: str) -> dict[str, str]:
    """The `kubernetes` Service's environment variables, pointing at the real API server."""
    url = urllib.parse.urlsplit(server)
    host, port = url.hostname or "127.0.0.1", str(url.port or 443)
    return {
        "KUBERNETES_SERVICE_HOST": host,
        "KUBERNETES_SERVICE_PORT": port,
        "KUBERNETES_SERVICE_PORT_HTTPS": port,
        "KUBERNETES_PORT": f"tcp://{host}:{port}",
        "KUBERNETES_PORT_443_TCP": f"tcp://{host}:{port}",
        "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
        "KUBERNETES_PORT_443_TCP_ADDR": host,
        "KUBERNETES_PORT_443_TCP_PORT": port,
    }


def token_request(pod: JsonObject) -> JsonObject:
    """The TokenRequest kubelet posts: default audience, bound to this pod.

    A pod without `serviceAccountName` (the ServiceAccount admission plugin, which would set it
    to `default`, is off in the harness) gets an unbound token of `default`: the API server
    refuses to bind a token to a pod whose spec names another (here: no) ServiceAccount."""
    meta, spec = pod["metadata"], pod.get("spec", {})
    request: JsonObject = {"audiences": [], "expirationSeconds": TOKEN_EXPIRATION_SECONDS}
    if spec.get("serviceAccountName") or spec.get("serviceAccount"):
        request["boundObjectRef"] = {
            "apiVersion": "v1", "kind": "Pod", "name": meta["name"], "uid": meta["uid"],
        }
    return {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": request}


def project_token(api: KubeApi, pod: JsonObject, target: Path) -> bool:
    """Write token, ca.crt and namespace for `pod` into `target`; False when the pod opts out.

    A missing ServiceAccount keeps the pod waiting (ContainerCreating), as on a real node where
    the token cannot be had yet."""
    namespace = pod["metadata"]["namespace"]
    name = service_account_name(pod)
    path = f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}"
    account = api.get_or_none(path)
    if not automounts_token(pod, account):
        return False
    if account is None:
        raise NotReadyToStart("ContainerCreating", f"serviceaccount {namespace}/{name} not found")
    answer = api.create(f"{path}/token", token_request(pod))
    target.mkdir(parents=True, exist_ok=True)
    (target / "token").write_text(answer["status"]["token"])
    (target / "ca.crt").write_bytes(api.credentials.ca_file.read_bytes())
    (target / "namespace").write_text(namespace)
    for file in target.iterdir():
        file.chmod(0o644)
    return True
