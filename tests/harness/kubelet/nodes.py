"""Nodes: register the p5.48xlarge-shaped Node objects, post their status, renew their Leases.

A test can mark a node NotReady (heartbeats stop, Ready=False) and Ready again.
"""

from __future__ import annotations

from harness.kubeapi import ApiError, JsonObject
from harness.kubelet.state import KubeletState
from harness.nodestate import (
    node_manifest,
    node_status,
    now_micro,
    now_rfc3339,
)

LEASE_SECONDS = 40
LEASE_RENEW_SECONDS = 10.0
NODE_STATUS_SECONDS = 30.0


class NodesMixin(KubeletState):
    """Registers the nodes, posts their status and renews their Leases."""

    def register_nodes(self) -> None:
        for index, name in enumerate(self.nodes):
            manifest = node_manifest(name, index)
            try:
                self.api.create("/api/v1/nodes", manifest)
            except ApiError as error:
                if error.status != 409:
                    raise
                self.api.patch(f"/api/v1/nodes/{name}", {"metadata": manifest["metadata"]})
            self.post_node_status(name)
            self.renew_lease(name)

    def post_node_status(self, name: str) -> None:
        status = node_status(
            name, self.node_ips[name], self.node_ready[name], self.node_transition[name]
        )
        self.api.patch(f"/api/v1/nodes/{name}/status", {"status": status})

    def renew_lease(self, name: str) -> None:
        path = f"/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases/{name}"
        spec = {
            "holderIdentity": name,
            "leaseDurationSeconds": LEASE_SECONDS,
            "renewTime": now_micro(),
        }
        try:
            self.api.patch(path, {"spec": spec})
        except ApiError as error:
            if error.status != 404:
                raise
            lease = {"metadata": {"name": name, "namespace": "kube-node-lease"}, "spec": spec}
            self.api.create("/apis/coordination.k8s.io/v1/namespaces/kube-node-lease/leases", lease)

    def set_node_ready(self, name: str, ready: bool) -> JsonObject:
        if name not in self.node_ready:
            raise KeyError(f"no harness node {name!r}")
        if self.node_ready[name] != ready:
            self.node_transition[name] = now_rfc3339()
        self.node_ready[name] = ready
        self.post_node_status(name)
        if ready:
            self.renew_lease(name)
        return {"node": name, "ready": ready}
