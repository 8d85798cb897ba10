"""`python -m rtj_operator`: run the operator.

Settings come from the environment (`rtj_operator.config`, variables `RTJ_OPERATOR_*`). The
operator watches every namespace, or only `RTJ_OPERATOR_NAMESPACE`. kopf always runs standalone
(no kopf peering). With `RTJ_OPERATOR_LEADER_ELECTION=true` the process first waits to hold the
Lease (`rtj_operator.leader`), serving `/healthz` as a follower meanwhile, and starts kopf only
as the leader (docs/operator.md, "High availability").
"""

from __future__ import annotations

import http.server
import logging
import sys
import threading

import kopf

from rtj_operator.config import ConfigurationError, OperatorSettings, settings_from_environment


class _FollowerHealth(http.server.BaseHTTPRequestHandler):
    """`GET /healthz` of a follower: alive, waiting for the Lease (kopf serves it once leading)."""

    def do_GET(self) -> None:
        ok = self.path.split("?")[0] == "/healthz"
        body = b'{"leader": false}\n' if ok else b"not found\n"
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/json" if ok else "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        return


def _serve_follower_health(settings: OperatorSettings) -> http.server.ThreadingHTTPServer | None:
    if settings.liveness_port == 0:
        return None
    server = http.server.ThreadingHTTPServer(
        (settings.liveness_host, settings.liveness_port), _FollowerHealth)
    threading.Thread(target=server.serve_forever, name="follower-health", daemon=True).start()
    return server


def main() -> int:
    try:
        settings = settings_from_environment()
    except ConfigurationError as error:
        print(f"rtj-operator: configuration error: {error}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s [%(name)s] %(message)s"
    )
    # Importing the module registers the handlers with kopf's default registry.
    from rtj_operator import handlers, leader, metrics  # noqa: F401

    metrics.serve(settings.metrics_host, settings.metrics_port)
    memo = kopf.Memo()
    elector: leader.LeaseElector | None = None
    if settings.leader_election:
        leader.load_config()
        elector = leader.LeaseElector(leader.api_client(settings), settings)
        health = _serve_follower_health(settings)
        try:
            elector.acquire()
        finally:
            if health is not None:
                health.shutdown()
                health.server_close()
        elector.keep_renewing(on_lost=leader.exit_now)
        memo["elector"] = elector
    else:
        metrics.LEADER.set(1)
    try:
        kopf.run(
            standalone=True,
            clusterwide=not settings.namespace,
            namespaces=[settings.namespace] if settings.namespace else (),
            liveness_endpoint=settings.liveness_endpoint(),
            memo=memo,
        )
    finally:
        if elector is not None:
            elector.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
