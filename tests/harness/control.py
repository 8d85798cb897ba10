"""Client of the node harness's fault-injection API (HTTP JSON on 127.0.0.1)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


class NodeControlError(RuntimeError):
    """The node harness refused or failed a control request."""


class NodeControl:
    """Freeze/thaw/kill pods and flip node readiness on the process-backed nodes."""

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
        """NotReady: heartbeats stop and Ready=False is posted; pods keep running."""
        self._call("POST", f"/nodes/{node}/ready", {"ready": ready})

    def node_names(self) -> list[str]:
        return [node["name"] for node in self._call("GET", "/nodes")]

    def pods(self) -> list[dict[str, Any]]:
        """The pods the harness has started: namespace, name, uid, node, ip, phase, pgids."""
        result: list[dict[str, Any]] = self._call("GET", "/pods")
        return result
