"""Client of the node harness's fault-injection API (HTTP JSON on 127.0.0.1)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


class NodeControlError(RuntimeError):
    """The node harness refused or failed a control request."""


class NodeControl:
    """Freeze/thaw/kill pods; flip node readiness, partition nodes, make them refuse pods."""

    def __init__(self, url: str) -> None:
        self.url = url.rstrip("/")

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(
            self.url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=70) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as error:
            answer = json.loads(error.read() or b"{}")
        if not answer.get("ok"):
            raise NodeControlError(answer.get("error", "unknown error"))
        return answer["result"]

    def freeze_pod(self, namespace: str, name: str) -> None:
        """Stop every process of the pod (cgroup freezer; SIGSTOP without cgroups)."""
        self._call("POST", f"/pods/{namespace}/{name}/freeze", {})

    def thaw_pod(self, namespace: str, name: str) -> None:
        self._call("POST", f"/pods/{namespace}/{name}/thaw", {})

    def kill_pod(self, namespace: str, name: str, sig: int = 9) -> None:
        """Send `sig` to every process of the pod; it then reports Failed with 128+sig."""
        self._call("POST", f"/pods/{namespace}/{name}/kill", {"signal": sig})

    def set_node_ready(self, node: str, ready: bool) -> None:
        """NotReady: heartbeats stop and Ready=False is posted; pods keep running and the node
        still acts on the API for them (a sick kubelet, not a partition: see `partition_node`)."""
        self._call("POST", f"/nodes/{node}/ready", {"ready": ready})

    def partition_node(self, node: str) -> list[str]:
        """Cut the node off the API like a network partition; returns the pods it froze.

        No Lease renewal, no node or pod status, deletions not carried out (pods stay
        Terminating), no new pods started there, every process of its pods frozen. The real
        node-lifecycle controller then marks it Ready=Unknown and taints it unreachable.
        """
        result: dict[str, Any] = self._call("POST", f"/nodes/{node}/partition", {})
        return list(result["frozen"])

    def heal_node(self, node: str) -> list[str]:
        """Reconnect the node; returns the pods force-deleted meanwhile whose processes it killed.

        Those are SIGKILLed before anything thaws; the other pods thaw, the node posts Ready
        again, terminates pods deleted meanwhile and starts pods bound to it meanwhile.
        """
        result: dict[str, Any] = self._call("POST", f"/nodes/{node}/heal", {})
        return list(result["killed"])

    def refuse_pods(self, node: str, reason: str, message: str = "") -> None:
        """New pods bound to `node` stay Pending, each container waiting with `reason`.

        `reason` is a kubelet waiting reason: ErrImagePull (then ImagePullBackOff between
        attempts, as kubelet's image back-off does), ImagePullBackOff, ErrImageNeverPull,
        InvalidImageName, CreateContainerConfigError or CreateContainerError. Pods already
        running there are not affected.
        """
        self._call("POST", f"/nodes/{node}/refuse", {"reason": reason, "message": message})

    def accept_pods(self, node: str) -> None:
        """Undo `refuse_pods`: the pods waiting there start at their next retry (< 1 s)."""
        self._call("POST", f"/nodes/{node}/accept", {})

    def node_names(self) -> list[str]:
        return [node["name"] for node in self._call("GET", "/nodes")]

    def node_states(self) -> list[dict[str, Any]]:
        """The harness's nodes: name, ip, ready, partitioned, refusing (a reason or None)."""
        result: list[dict[str, Any]] = self._call("GET", "/nodes")
        return result

    def pods(self) -> list[dict[str, Any]]:
        """The pods the harness has started: namespace, name, uid, node, ip, phase, pgids, and
        whether their node is partitioned."""
        result: list[dict[str, Any]] = self._call("GET", "/pods")
        return result
