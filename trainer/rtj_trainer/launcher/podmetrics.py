"""One endpoint per pod that reports every local rank: what the operator scrapes at scale.

Each rank serves its own Prometheus endpoint (`rtj_trainer.metrics`, port RTJ_METRICS_PORT +
local rank). Scraping 8,000 of those every few seconds from one operator does not scale (docs/
benchmarks.md, "Scale"), so the launcher shim (`rtj_trainer.launcher`), one per pod, also serves
`GET /ranks` on RTJ_METRICS_HOST:(RTJ_METRICS_PORT - 1) (`pod_port`): on each request it reads
its local ranks' endpoints over loopback (in parallel, a short timeout) and answers one small
JSON document (its format: rtj_wire.ranks).

A rank is listed once its page has answered at least once (or, for a rank that serves no page,
once its NVRx rank monitor saw it connect: its heartbeats are then the monitor's, `"source":
"nvrx"`); when it stops answering (its worker died
or is being restarted by ft_launcher) the last values it gave are kept with `"answered": false`,
so its heartbeat goes stale: the operator then has evidence (the pod answers, the rank's own
heartbeat is old) instead of silence. A rank that never answered is not listed.

Once every local worker exited 0 (the pod's training is done: its launcher then waits in
torchelastic's exit barrier for the other launchers, up to 5 s in a job with spares) the
launcher shim marks the pod finished (`PodRanks.mark_finished`) and the document carries
`"finished": true`: the ranks' heartbeats stop for a good reason, and the operator counts the pod
as done, not as a pod whose heartbeat went stale.

The same endpoint takes the operator's verdicts on lost peer pods, `POST /lost-pods`
(rtj_wire.lostpods, rtj_trainer.launcher.verdicts): the shim keeps them in the file its workers
poll, so the in-process wrapper learns of a lost pod at once instead of after its heartbeat
timeout. Who may reach the
port is the job's NetworkPolicy's business (the job's own pods and the operator's).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import threading
import urllib.request
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rtj_wire import env as wire_env
from rtj_wire import lostpods
from rtj_wire import ranks as wire_ranks
from rtj_wire.pod import pod_endpoint_port as pod_port
from rtj_wire.ranks import RankRecord

from ..nvrx.monitorstate import MonitorState, read_monitor_state
from .verdicts import VerdictBook

__all__ = ["PodRanks", "accept_verdict", "pod_port", "rank_record", "serve",
           "start_from_environment"]

LOCAL_TIMEOUT_SECONDS = 0.5
log = logging.getLogger("rtj_trainer.launcher")


def rank_record(text: str, local_rank: int) -> RankRecord:
    """One rank's /metrics page (Prometheus text) as the pod endpoint's record of it."""
    return RankRecord.from_samples(
        ((sample.name, sample.labels, sample.value)
         for family in text_string_to_metric_families(text) for sample in family.samples),
        local_rank=local_rank)


def _fetch(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=LOCAL_TIMEOUT_SECONDS) as response:
            text: str = response.read().decode()
            return text
    except (OSError, ValueError):
        return None


class PodRanks:
    """The pod's view of its local ranks: the last record of each rank whose metrics page ever
    answered, else what its NVRx rank monitor received (`monitor`, when given: a script that
    sends NVRx heartbeats and serves no page)."""

    def __init__(self, *, host: str, metrics_port: int, procs: int,
                 fetch: Callable[[str], str | None] = _fetch,
                 monitor: Callable[[int], MonitorState | None] | None = None) -> None:
        self.urls = [f"http://{host}:{metrics_port + r}/metrics" for r in range(procs)]
        self._fetch = fetch
        self._monitor = monitor
        self._last: dict[int, RankRecord] = {}
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=max(1, procs), thread_name_prefix="podranks")
        self._finished = False

    def mark_finished(self) -> None:
        """Every local worker exited 0: the pod's training is done (see the module's text)."""
        with self._lock:
            self._finished = True

    def read(self) -> dict[str, Any]:
        """Read every local rank now; the document `GET /ranks` answers."""
        texts = list(self._pool.map(self._fetch, self.urls))
        with self._lock:
            for local_rank, text in enumerate(texts):
                record = None
                if text is not None:
                    try:
                        record = rank_record(text, local_rank)
                    except ValueError:
                        record = None
                if record is not None:
                    self._last[local_rank] = record
                elif local_rank in self._last:
                    self._last[local_rank] = dataclasses.replace(self._last[local_rank],
                                                                 answered=False)
            records = dict(self._last)
            for local_rank in range(len(self.urls)):
                if local_rank not in records and self._monitor is not None:
                    state = self._monitor(local_rank)
                    if state is not None:
                        records[local_rank] = RankRecord(
                            local_rank=local_rank, rank=state.rank, heartbeat=state.heartbeat,
                            answered=state.connected, source=wire_ranks.NVRX_SOURCE,
                            connected_time=state.connected_at)
            return wire_ranks.document([records[r] for r in sorted(records)],
                                       finished=self._finished)


MAX_BODY_BYTES = 65536
"""Largest request body the endpoint reads (a verdict names at most 64 pods)."""


def accept_verdict(verdicts: VerdictBook, body: bytes) -> tuple[int, dict[str, Any]]:
    """Handle the body of `POST /lost-pods`: (HTTP status, JSON answer)."""
    try:
        pods = lostpods.parse_verdict(json.loads(body))
    except ValueError as error:  # VerdictError, or not JSON at all
        return 400, {"error": str(error)}
    new = verdicts.record(pods)
    for pod in new:
        log.warning("the operator reports pod %s (uid %s) lost (%s): telling the workers",
                    pod.name, pod.uid, pod.cause)
    return 200, {"accepted": len(new)}


def serve(ranks: PodRanks, host: str, port: int,
          verdicts: VerdictBook | None = None) -> ThreadingHTTPServer:
    """Serve `GET /ranks` (and, given `verdicts`, `POST /lost-pods`) on host:port in a daemon
    thread."""

    class Handler(BaseHTTPRequestHandler):
        def _answer(self, status: int, document: Any) -> None:
            body = json.dumps(document).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path.split("?")[0] != wire_ranks.PATH:
                self.send_error(404)
                return
            self._answer(200, ranks.read())

        def do_POST(self) -> None:
            if verdicts is None or self.path.split("?")[0] != lostpods.PATH:
                self.send_error(404)
                return
            try:
                length = int(self.headers.get("Content-Length") or "0")
            except ValueError:
                length = -1
            if not 0 < length <= MAX_BODY_BYTES:
                self._answer(400, {"error": f"Content-Length: expected 1 to {MAX_BODY_BYTES} "
                                            "bytes"})
                return
            self._answer(*accept_verdict(verdicts, self.rfile.read(length)))

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="podranks-http", daemon=True).start()
    return server


def procs_from_argv(argv: list[str]) -> int | None:
    """ft_launcher's `--nproc-per-node` (`=N` or `N` after it), if given."""
    for n, arg in enumerate(argv):
        for flag in ("--nproc-per-node", "--nproc_per_node"):
            if arg.startswith(flag + "="):
                value = arg.split("=", 1)[1]
            elif arg == flag and n + 1 < len(argv):
                value = argv[n + 1]
            else:
                continue
            try:
                return int(value)
            except ValueError:
                return None
    return None


def start_from_environment(env: Mapping[str, str], argv: list[str],
                           verdicts: VerdictBook | None = None,
                           monitor_dir: str | None = None) -> PodRanks | None:
    """Start the pod endpoint when the pod has RTJ_METRICS_HOST/RTJ_METRICS_PORT (the operator
    sets both) and the launcher's worker count is known, and return what it serves; None
    otherwise. Never fails the launcher: a port in use is logged."""
    host = env.get(wire_env.METRICS_HOST, "")
    try:
        base = int(env.get(wire_env.METRICS_PORT, "0"))
    except ValueError:
        return None
    procs = procs_from_argv(argv)
    port = pod_port(base)
    if not host or not port or not procs:
        return None
    monitor = (functools.partial(read_monitor_state, monitor_dir)
               if monitor_dir is not None else None)
    ranks = PodRanks(host=host, metrics_port=base, procs=procs, monitor=monitor)
    try:
        serve(ranks, host, port, verdicts)
        return ranks
    except OSError as error:
        log.error("cannot serve the pod endpoint on %s:%s: %s", host, port, error)
        return None
