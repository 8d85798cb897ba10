"""The node harness's fault-injection API: HTTP JSON on 127.0.0.1 (client: `harness.control`).

Each request is handed to the reconcile thread as a ("call", function, reply) event, so faults
are applied in order with everything else the kubelet does.
"""

from __future__ import annotations

import http.server
import json
import queue
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harness.kubelet.loop import Kubelet


def start_control_server(kubelet: Kubelet) -> str:
    """HTTP JSON on 127.0.0.1:<free port>; requests run on the reconcile thread."""

    def call(function: Callable[[], Any]) -> tuple[bool, Any]:
        reply: queue.Queue[tuple[bool, Any]] = queue.Queue()
        kubelet.events.put(("call", function, reply))
        return reply.get(timeout=60)

    class Handler(http.server.BaseHTTPRequestHandler):
        def log_message(self, format: str, *args: Any) -> None:
            pass

        def answer(self, ok: bool, result: Any) -> None:
            body = json.dumps({"ok": ok, "result": result} if ok else {"ok": ok, "error": result})
            self.send_response(200 if ok else 400)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body.encode())

        def do_GET(self) -> None:
            if self.path == "/healthz":
                self.answer(True, "ok")
            elif self.path == "/nodes":
                self.answer(*call(kubelet.describe_nodes))
            elif self.path == "/pods":
                self.answer(*call(kubelet.describe_pods))
            else:
                self.answer(False, f"unknown path {self.path}")

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length) or b"{}")
            parts = self.path.strip("/").split("/")
            if len(parts) == 4 and parts[0] == "pods":
                _, namespace, name, action = parts
                actions: dict[str, Callable[[], Any]] = {
                    "freeze": lambda: kubelet.freeze_pod(namespace, name, True),
                    "thaw": lambda: kubelet.freeze_pod(namespace, name, False),
                    "kill": lambda: kubelet.kill_pod(namespace, name, int(body.get("signal", 9))),
                }
                if action in actions:
                    self.answer(*call(actions[action]))
                    return
            if len(parts) == 3 and parts[0] == "nodes":
                node = parts[1]
                node_actions: dict[str, Callable[[], Any]] = {
                    "ready": lambda: kubelet.set_node_ready(node, bool(body["ready"])),
                    "partition": lambda: kubelet.partition_node(node),
                    "heal": lambda: kubelet.heal_node(node),
                    "refuse": lambda: kubelet.refuse_pods(
                        node, str(body.get("reason", "")), str(body.get("message", ""))
                    ),
                    "accept": lambda: kubelet.accept_pods(node),
                }
                if parts[2] in node_actions:
                    self.answer(*call(node_actions[parts[2]]))
                    return
            self.answer(False, f"unknown path {self.path}")

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"
