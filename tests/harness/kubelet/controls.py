"""The backend of the fault-injection control API (`harness.controlapi`, client `harness.control`).

Signals, freezes and kills act on every process group of a pod; they run on the reconcile thread
like everything else. A node can also be made to refuse new pods with a kubelet waiting reason.
"""

from __future__ import annotations

import signal
import time

from harness import cgroups
from harness.kubeapi import JsonObject
from harness.kubelet.provisioner import ProvisionerMixin
from harness.kubelet.state import os_killpg
from harness.nodestate import (
    REFUSAL_REASONS,
    NotReadyToStart,
    PodRun,
    refusal_waiting,
)


class ControlsMixin(ProvisionerMixin):
    """Fault controls: signal, freeze, kill and list pods; make a node refuse new pods."""

    def find_run(self, namespace: str, name: str) -> PodRun:
        """The run of the pod named so; the one of the pod object now in the API first (a
        force-deleted pod on a partitioned node may still have processes under the same name)."""
        current = self.pods.get((namespace, name), {}).get("metadata", {}).get("uid")
        if current in self.runs and not self.runs[current].vanished:
            return self.runs[current]
        for run in self.runs.values():
            if run.namespace == namespace and run.name == name and not run.vanished:
                return run
        raise KeyError(f"no harness pod {namespace}/{name}")

    def signal_pod(self, run: PodRun, sig: int) -> None:
        """Every process of the pod (cgroup), or each container's process group as fallback."""
        if run.cgroup is not None:
            cgroups.signal_all(run.cgroup, sig)
        for container in run.containers.values():
            if container.running:
                os_killpg(container.popen.pid, sig)

    def freeze_pod(self, namespace: str, name: str, frozen: bool) -> JsonObject:
        self.freeze_run(self.find_run(namespace, name), frozen)
        return {"pod": f"{namespace}/{name}", "frozen": frozen}

    def freeze_run(self, run: PodRun, frozen: bool) -> None:
        if run.cgroup is not None:
            cgroups.freeze(run.cgroup, frozen)
            deadline = time.monotonic() + 5
            while cgroups.is_frozen(run.cgroup) != frozen and time.monotonic() < deadline:
                time.sleep(0.02)
        else:
            self.signal_pod(run, signal.SIGSTOP if frozen else signal.SIGCONT)

    def kill_pod(self, namespace: str, name: str, sig: int) -> JsonObject:
        run = self.find_run(namespace, name)
        self.signal_pod(run, sig)
        return {"pod": f"{namespace}/{name}", "signal": sig}

    def refuse_pods(self, node: str, reason: str, message: str) -> JsonObject:
        """New pods bound to `node` stay Pending, their containers waiting with `reason`."""
        self.require_node(node)
        if reason not in REFUSAL_REASONS:
            raise ValueError(f"reason must be one of {sorted(REFUSAL_REASONS)}, not {reason!r}")
        self.refusals[node] = (reason, message or f"{reason} (refused by the test harness)")
        return {"node": node, "refusing": reason}

    def accept_pods(self, node: str) -> JsonObject:
        """Pods waiting on `node` start at the next retry (within a second)."""
        self.require_node(node)
        self.refusals.pop(node, None)
        return {"node": node, "refusing": None}

    def refusal_of(self, pod: JsonObject) -> NotReadyToStart | None:
        """What the pod's node answers it while refusing pods; None when the node accepts."""
        refusal = self.refusals.get(pod["spec"]["nodeName"])
        if refusal is None:
            return None
        uid = pod["metadata"]["uid"]
        image = pod["spec"]["containers"][0].get("image", "")
        pulls = self.image_pulls.get(uid)
        waiting, pulls = refusal_waiting(*refusal, image, pulls, time.monotonic())
        if pulls is not None:
            self.image_pulls[uid] = pulls
        return waiting

    def describe_nodes(self) -> list[JsonObject]:
        return [
            {
                "name": name,
                "ready": self.node_ready[name],
                "ip": self.node_ips[name],
                "partitioned": self.cut_off(name),
                "refusing": self.refusals.get(name, (None,))[0],
            }
            for name in self.nodes
        ]

    def describe_pods(self) -> list[JsonObject]:
        return [
            {
                "namespace": run.namespace,
                "name": run.name,
                "uid": run.uid,
                "node": run.node,
                "ip": run.ip,
                "phase": run.phase,
                "partitioned": self.cut_off(run.node),
                "pgids": run.pgids(),
                "cgroup": str(run.cgroup) if run.cgroup else None,
            }
            for run in self.runs.values()
        ]
