"""Pod status: phase, conditions and containerStatuses (exit codes, 128+N for signal N) written
back to the API, and the Waiting reason of a pod that cannot start.
"""

from __future__ import annotations

from harness.kubeapi import ApiError, JsonObject
from harness.kubelet.dns import DnsMixin
from harness.kubelet.state import pod_path
from harness.nodestate import (
    NotReadyToStart,
    PodRun,
    pod_conditions,
)


class PodStatusMixin(DnsMixin):
    """Writes pod status back to the API."""

    def report_status(self, run: PodRun) -> None:
        pod = self.pod_by_uid(run.uid)
        if pod is None or self.cut_off(run.node):  # a partitioned node posts nothing
            return
        containers = [run.containers[c["name"]].status() for c in pod["spec"]["containers"]]
        ready = run.alive and all(c["ready"] for c in containers)
        status = {
            "phase": run.phase,
            "hostIP": run.host_ip,
            "hostIPs": [{"ip": run.host_ip}],
            "podIP": run.ip,
            "podIPs": [{"ip": run.ip}],
            "startTime": run.start_time,
            "conditions": pod_conditions(pod, run, ready),
            "containerStatuses": containers,
        }
        try:
            updated = self.api.patch(f"{pod_path(pod)}/status", {"status": status})
            self.pods[(run.namespace, run.name)] = updated
        except ApiError as error:
            if error.status not in (404, 409):
                raise

    def report_waiting(self, pod: JsonObject, waiting: NotReadyToStart) -> None:
        statuses = [
            {
                "name": c["name"],
                "image": c.get("image", ""),
                "imageID": "",
                "ready": False,
                "started": False,
                "restartCount": 0,
                "state": {"waiting": {"reason": waiting.reason, "message": waiting.message}},
                "lastState": {},
            }
            for c in pod["spec"]["containers"]
        ]
        status = {
            "phase": "Pending",
            "hostIP": self.node_ips[pod["spec"]["nodeName"]],
            "conditions": pod_conditions(pod, None, False),
            "containerStatuses": statuses,
        }
        try:
            self.api.patch(f"{pod_path(pod)}/status", {"status": status})
        except ApiError as error:
            if error.status not in (404, 409):
                raise
