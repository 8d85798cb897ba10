"""Pod status: phase, conditions and containerStatuses (exit codes, 128+N for signal N) written
back to the API, and the Waiting reason of a pod that cannot start.
"""

from __future__ import annotations

import http.client

from harness.kubeapi import ApiError, JsonObject
from harness.kubelet.dns import DnsMixin
from harness.kubelet.state import log, pod_path
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
                self.status_unwritten(run, error)
                return
        except (OSError, http.client.HTTPException) as error:  # the API server did not answer
            self.status_unwritten(run, error)
            return
        self.unreported.discard(run.uid)

    def status_unwritten(self, run: PodRun, error: Exception) -> None:
        """Keep the pod for `report_unwritten` (every tick) until its status is written: a pod
        that ended while kube-apiserver was down must not stay Running in the API for ever."""
        if run.uid not in self.unreported:
            log(f"{run.namespace}/{run.name}: status not written ({type(error).__name__}: "
                f"{error}); trying again every tick")
        self.unreported.add(run.uid)

    def report_unwritten(self) -> None:
        for uid in list(self.unreported):
            run = self.runs.get(uid)
            if run is None:
                self.unreported.discard(uid)
            elif not self.cut_off(run.node):
                self.report_status(run)

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
