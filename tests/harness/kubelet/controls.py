"""The backend of the fault-injection control API (`harness.controlapi`, client `harness.control`).

Signals, freezes and kills act on every process group of a pod; they run on the reconcile thread
like everything else.
"""

from __future__ import annotations

import signal
import time

from harness import cgroups
from harness.kubeapi import JsonObject
from harness.kubelet.provisioner import ProvisionerMixin
from harness.kubelet.state import os_killpg
from harness.nodestate import (
    PodRun,
)


class ControlsMixin(ProvisionerMixin):
    """Fault controls: signal, freeze, kill and list pods."""

    def find_run(self, namespace: str, name: str) -> PodRun:
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
        run = self.find_run(namespace, name)
        if run.cgroup is not None:
            cgroups.freeze(run.cgroup, frozen)
            deadline = time.monotonic() + 5
            while cgroups.is_frozen(run.cgroup) != frozen and time.monotonic() < deadline:
                time.sleep(0.02)
        else:
            self.signal_pod(run, signal.SIGSTOP if frozen else signal.SIGCONT)
        return {"pod": f"{namespace}/{name}", "frozen": frozen}

    def kill_pod(self, namespace: str, name: str, sig: int) -> JsonObject:
        run = self.find_run(namespace, name)
        self.signal_pod(run, sig)
        return {"pod": f"{namespace}/{name}", "signal": sig}

    def describe_pods(self) -> list[JsonObject]:
        return [
            {
                "namespace": run.namespace,
                "name": run.name,
                "uid": run.uid,
                "node": run.node,
                "ip": run.ip,
                "phase": run.phase,
                "pgids": run.pgids(),
                "cgroup": str(run.cgroup) if run.cgroup else None,
            }
            for run in self.runs.values()
        ]
