"""Nodes: register the p5.48xlarge-shaped Node objects, post their status, renew their Leases.

Heartbeats (Lease renewals every `LEASE_RENEW_SECONDS`, a full status every `NODE_STATUS_SECONDS`)
run on their own thread, as a real kubelet's do, so that a slow pod sync on the reconcile thread
never makes a node look dead to the node-lifecycle controller (whose grace period is short here,
see `harness.controlplane.NODE_MONITOR_GRACE_SECONDS`).

A test can mark a node NotReady (heartbeats stop, Ready=False) and Ready again, or partition it
(heartbeats stop and nothing is posted; see `loop.Kubelet.partition_node`).
"""

from __future__ import annotations

import threading
import time

from harness.kubeapi import ApiError, JsonObject
from harness.kubelet.state import KubeletState, log
from harness.nodestate import (
    node_manifest,
    node_status,
    now_micro,
    now_rfc3339,
)

# A real kubelet holds a 40 s Lease and renews it every 10 s (a quarter), against the
# controller's 50 s grace period. Here everything is shorter so that partitions show quickly:
# renewals every 2 s against a 15 s grace period (7 renewals may be missed before Unknown).
LEASE_SECONDS = 8
LEASE_RENEW_SECONDS = 2.0
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

    def start_heartbeats(self) -> None:
        threading.Thread(target=self.heartbeat_loop, name="heartbeats", daemon=True).start()

    def heartbeating(self, name: str) -> bool:
        return self.node_ready[name] and name not in self.partitioned

    def heartbeat_loop(self) -> None:
        """Renew the Lease of every heartbeating node; post its full status now and then."""
        last_status = time.monotonic()
        while not self.stopping.wait(LEASE_RENEW_SECONDS):
            post_status = time.monotonic() - last_status >= NODE_STATUS_SECONDS
            if post_status:
                last_status = time.monotonic()
            for name in self.nodes:
                with self.heartbeat_lock:  # a partition never sees a renewal after it returned
                    if not self.heartbeating(name):
                        continue
                    try:
                        self.renew_lease(name)
                        if post_status:
                            self.post_node_status(name)
                    except Exception as error:
                        log(f"heartbeat of {name} failed: {error}")

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
        """Ready=False: heartbeats stop and Ready=False is posted (not while partitioned)."""
        self.require_node(name)
        with self.heartbeat_lock:
            if self.node_ready[name] != ready:
                self.node_transition[name] = now_rfc3339()
            self.node_ready[name] = ready
            if name not in self.partitioned:
                self.post_node_status(name)
                if ready:
                    self.renew_lease(name)
        return {"node": name, "ready": ready}
