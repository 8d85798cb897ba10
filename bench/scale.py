"""Scale: one real operator watching many simulated p5 nodes and trainer pods.

    python -m bench.scale --nodes 1000 --procs-per-node 8 --minutes 10 --jobs 1 --out F
    python -m bench.scale --nodes 8 --procs-per-node 8 --minutes 10 --jobs 100 --out F

`--nodes` is per job. Starts etcd and kube-apiserver only (tests/harness; no scheduler, no
controller-manager, no process-backed nodes), creates `jobs x nodes` simulated Nodes (Ready, the
p5.48xlarge label) and the jobs, and runs the REAL operator (`python -m rtj_operator`, as
bench/operator_recovery.py does). This process is the rest of the cluster, all in one asyncio
loop:

- a simulated kubelet: it watches the jobs' pods, binds each new pod to a free simulated Node,
  marks it Running with its own 127.x address, and finishes a deletion at once (grace 0);
- simulated ranks: every Running trainer pod serves the pod liveness endpoint the operator reads
  (`GET /ranks` on RTJ_METRICS_PORT - 1, rtj_trainer.podmetrics's JSON), reporting its
  `procs-per-node` ranks with a heartbeat every second and a step that advances.

Jobs are created `--stagger-seconds` apart (a hundred jobs at once time a loaded apiserver
out); the simulator retries API calls that time out or get 429/5xx.

Once every job is Running, faults are injected one at a time at random moments, alternating: a
rank hangs (its heartbeat freezes) or a pod is killed (its status turns Failed, exit 137). For a
hang two moments are measured: when the job's status first shows the pod `Unresponsive`
(detection: the operator publishes a heartbeat older than heartbeatTimeoutSeconds; the bench
watches the jobs) and when the operator deletes the pod (action: only after
heartbeatTimeoutSeconds + initialHeartbeatTimeoutSeconds, so that ft_launcher's in-pod restart
gets its chance first). For a kill: when the operator deletes the pod. A deletion of any other
pod, and an `Unresponsive` pod that was not hung, are false positives. Measured: those latencies
(p50, p99, max), false positives, missed faults, ObservationDegraded conditions seen, the
HeartbeatStale Events posted, the operator's CPU (cores, from /proc: average and peak over 5 s
windows) and RSS, its passes (count and mean duration by what woke them) and reads of every pod
(from its own metrics), API requests per second (kube-apiserver's `apiserver_request_total`,
minus the simulator's own requests), and the simulator's and apiserver's CPU. `targets` compares
the result with issue 12's targets. Prints one JSON object and writes it to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import ssl
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from .common import REPO_ROOT, machine_description, write_json

sys.path.insert(0, str(REPO_ROOT / "tests"))

GROUP_PATH = "/apis/training.resilient.dev/v1alpha1"
JOB_LABEL = "training.resilient.dev/job"
ROLE_LABEL = "training.resilient.dev/role"
INDEX_LABEL = "training.resilient.dev/node-index"
ATTEMPT_LABEL = "training.resilient.dev/attempt"
METRICS_PORT = 9400
HEARTBEAT_TIMEOUT = 10
INITIAL_HEARTBEAT_TIMEOUT = 10
HANG_THRESHOLD = HEARTBEAT_TIMEOUT + INITIAL_HEARTBEAT_TIMEOUT
DETECTION_SLACK = 2.0
"""Issue 12: a hang detected within heartbeatTimeoutSeconds + 2 s (p99)."""
KILL_TARGET = 5.0
"""Issue 12: a pod loss acted on within 5 s."""
CLK_TCK = os.sysconf("SC_CLK_TCK")
TRANSIENT = (429, 500, 502, 503, 504)
"""API answers the simulator retries (an overloaded apiserver)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.scale", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, required=True, help="trainer pods per job")
    parser.add_argument("--procs-per-node", type=int, default=8)
    parser.add_argument("--jobs", type=int, default=1)
    parser.add_argument("--minutes", type=float, default=10.0,
                        help="measured time once every job runs (default 10)")
    parser.add_argument("--out", type=Path, help="write the JSON result here too")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--start-timeout", type=float, default=600.0,
                        help="seconds for every job to reach Running (default 600)")
    parser.add_argument("--stagger-seconds", type=float, default=0.2,
                        help="seconds between two job creations (default 0.2)")
    parser.add_argument("--reconcile-interval", type=float, default=None,
                        help="RTJ_OPERATOR_RECONCILE_INTERVAL_SECONDS (default: the operator's)")
    return parser.parse_args(argv)


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return round(ordered[int(rank)], 2)


def spread(values: list[float]) -> dict[str, Any]:
    return {"n": len(values), "p50": percentile(values, 50), "p99": percentile(values, 99),
            "max": round(max(values), 2) if values else None}


def job_manifest(name: str, nodes: int, procs: int) -> dict[str, Any]:
    return {
        "apiVersion": "training.resilient.dev/v1alpha1",
        "kind": "ResilientTrainingJob",
        "metadata": {"name": name},
        "spec": {
            "nodes": nodes, "instanceType": "p5.48xlarge", "procsPerNode": procs,
            "image": "ghcr.io/resilient-training/rtj-trainer:dev",
            "args": ["--preset", "tiny"],
            "checkpoint": {"storageClassName": "local-shared", "size": "1Gi",
                           "intervalSteps": 100},
            "faultTolerance": {
                "heartbeatTimeoutSeconds": HEARTBEAT_TIMEOUT,
                "initialHeartbeatTimeoutSeconds": INITIAL_HEARTBEAT_TIMEOUT,
                "progressTimeoutSeconds": 3600,
                "podStartTimeoutSeconds": 600,
                "restartStrategy": "RankRestart",
                "rankRestartBudget": {"max": 100, "windowSeconds": 60},
                "fullRestartBudget": {"max": 1, "windowSeconds": 600},
            },
        },
    }


# --- the API client --------------------------------------------------------------------------


class Api:
    """A small asyncio client for the harness's kube-apiserver (admin client certificate)."""

    def __init__(self, server: str, pki: Path) -> None:
        self.server = server
        context = ssl.create_default_context(cafile=str(pki / "ca.crt"))
        context.load_cert_chain(str(pki / "admin.crt"), str(pki / "admin.key"))
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=context, limit=32),
            timeout=aiohttp.ClientTimeout(total=60))
        self.requests = 0

    async def call(self, method: str, path: str, body: Any = None, *,
                   content_type: str = "application/json", ok: tuple[int, ...] = (),
                   attempts: int = 6) -> Any:
        """One API call; a timeout, a dropped connection or a 429/5xx answer is retried
        (`attempts` in all, backing off from 0.5 s): an overloaded apiserver is slow, not
        wrong."""
        data = json.dumps(body) if body is not None else None
        for attempt in range(attempts):
            self.requests += 1
            last = attempt == attempts - 1
            try:
                async with self.session.request(
                        method, self.server + path, data=data,
                        headers={"Content-Type": content_type}) as response:
                    text = await response.text()
                    if response.status in TRANSIENT and not last:
                        await asyncio.sleep(0.5 * 2 ** attempt)
                        continue
                    if response.status >= 400 and response.status not in ok:
                        raise RuntimeError(f"{method} {path}: {response.status} {text[:300]}")
                    return json.loads(text) if text and text.startswith("{") else text
            except (TimeoutError, aiohttp.ClientError):
                if last:
                    raise
                await asyncio.sleep(0.5 * 2 ** attempt)
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self.session.close()


# --- the simulated cluster -------------------------------------------------------------------


@dataclass
class SimPod:
    namespace: str
    name: str
    uid: str
    job: str
    role: str
    index: int | None
    attempt: int | None
    node: str
    ip: str
    started: float = field(default_factory=time.time)
    server: asyncio.Server | None = None
    hung: dict[int, float] = field(default_factory=dict)
    """Local rank -> the heartbeat it froze at."""
    killed: bool = False


class Simulator:
    def __init__(self, api: Api, nodes: list[str], procs: int) -> None:
        self.api = api
        self.free_nodes = list(nodes)
        self.shared_node = nodes[0]
        """Where rendezvous pods are bound (they need no node of their own)."""
        self.procs = procs
        self.pods: dict[str, SimPod] = {}
        """By UID: every pod bound and not yet gone."""
        self.deleting_seen: dict[str, float] = {}
        """UID -> when its deletionTimestamp was first seen."""
        self.deletions: list[tuple[float, str, str]] = []
        self._next_ip = 0
        self.pending: set[str] = set()
        self._tasks: set[asyncio.Future[Any]] = set()

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _ip(self) -> str:
        n = self._next_ip
        self._next_ip += 1
        block, host = divmod(n, 254)
        return f"127.{64 + block // 256}.{block % 256}.{host + 1}"

    async def serve(self, pod: SimPod) -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    request = await reader.readuntil(b"\r\n\r\n")
                    if not request:
                        break
                    body = json.dumps(self.ranks_document(pod)).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n"
                                 + body)
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
                pass
            finally:
                writer.close()

        pod.server = await asyncio.start_server(handle, pod.ip, METRICS_PORT - 1)

    def ranks_document(self, pod: SimPod) -> dict[str, Any]:
        now = time.time()
        beat = float(int(now))
        step = int(now - pod.started)
        base = (pod.index or 0) * self.procs
        return {"ranks": [
            {"localRank": r, "rank": base + r, "heartbeat": pod.hung.get(r, beat),
             "step": step, "restarts": {"launcher": 0, "inprocess": 0, "pod": 0},
             "standby": False, "answered": True}
            for r in range(self.procs)]}

    async def start_pod(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        uid = meta["uid"]
        labels = meta.get("labels") or {}
        trainer = labels.get(ROLE_LABEL) == "trainer"
        if uid in self.pods or uid in self.pending or (trainer and not self.free_nodes):
            return
        self.pending.add(uid)
        try:
            # A trainer pod takes a whole p5 node (all its GPUs); a rendezvous pod (a small CPU
            # request) shares a node with whatever runs there, as on a real cluster.
            node = self.free_nodes.pop(0) if trainer else self.shared_node
            index = labels.get(INDEX_LABEL)
            attempt = labels.get(ATTEMPT_LABEL)
            pod = SimPod(namespace=meta["namespace"], name=meta["name"], uid=uid,
                         job=labels.get(JOB_LABEL, ""), role=labels.get(ROLE_LABEL, ""),
                         index=int(index) if index is not None else None,
                         attempt=int(attempt) if attempt is not None else None, node=node,
                         ip=self._ip())
            base = f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}"
            await self.api.call("POST", base + "/binding", {
                "apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod.name},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}},
                ok=(409,))  # a retried binding that had gone through
            if pod.role == "trainer":
                await self.serve(pod)
            self.pods[uid] = pod
            now = iso(time.time())
            container = obj["spec"]["containers"][0]
            await self.api.call("PATCH", base + "/status", {"status": {
                "phase": "Running", "podIP": pod.ip, "podIPs": [{"ip": pod.ip}],
                "hostIP": "127.0.0.1", "startTime": now,
                "conditions": [{"type": "PodScheduled", "status": "True"},
                               {"type": "Ready", "status": "True"}],
                "containerStatuses": [{
                    "name": container["name"], "image": container.get("image", ""),
                    "imageID": "", "ready": True, "restartCount": 0,
                    "state": {"running": {"startedAt": now}}}]}},
                content_type="application/merge-patch+json")
        finally:
            self.pending.discard(uid)

    async def finish_delete(self, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        pod = self.pods.get(meta["uid"])
        if pod is not None and pod.server is not None:
            pod.server.close()
        await self.api.call(
            "DELETE", f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}",
            {"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}}, ok=(404, 409))

    def gone(self, uid: str) -> None:
        pod = self.pods.pop(uid, None)
        if pod is not None:
            if pod.server is not None:
                pod.server.close()
            if pod.role == "trainer":
                self.free_nodes.append(pod.node)

    async def kubelet(self) -> None:
        """Watch the jobs' pods for ever (re-opening the watch when it ends)."""
        version = ""
        while True:
            path = f"/api/v1/pods?labelSelector={JOB_LABEL}"
            listing = await self.api.call("GET", path)
            version = listing["metadata"]["resourceVersion"]
            for item in listing["items"]:
                item.setdefault("metadata", {})
                await self.on_event("ADDED", item)
            url = (f"{self.api.server}/api/v1/pods?watch=1&labelSelector={JOB_LABEL}"
                   f"&resourceVersion={version}&allowWatchBookmarks=false")
            self.api.requests += 1
            try:
                async with self.api.session.get(
                        url, timeout=aiohttp.ClientTimeout(total=None, sock_read=None)) as stream:
                    async for line in stream.content:
                        if line.strip():
                            event = json.loads(line)
                            await self.on_event(event["type"], event["object"])
            except (TimeoutError, aiohttp.ClientError):
                await asyncio.sleep(0.5)

    async def on_event(self, kind: str, obj: dict[str, Any]) -> None:
        meta = obj.get("metadata") or {}
        uid = meta.get("uid", "")
        if kind == "DELETED":
            self.gone(uid)
            return
        if meta.get("deletionTimestamp"):
            if uid not in self.deleting_seen:
                self.deleting_seen[uid] = time.time()
                self.deletions.append((time.time(), meta.get("name", ""), uid))
            self._spawn(self.finish_delete(obj))
            return
        phase = (obj.get("status") or {}).get("phase")
        if not (obj.get("spec") or {}).get("nodeName") and phase in (None, "Pending"):
            self._spawn(self.start_pod(obj))

    async def kill(self, pod: SimPod) -> None:
        pod.killed = True
        if pod.server is not None:
            pod.server.close()
        now = iso(time.time())
        await self.api.call(
            "PATCH", f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status",
            {"status": {"phase": "Failed", "containerStatuses": [{
                "name": "trainer", "image": "", "imageID": "", "ready": False,
                "restartCount": 0, "state": {"terminated": {
                    "exitCode": 137, "reason": "Error", "startedAt": iso(pod.started),
                    "finishedAt": now}}}]}},
            content_type="application/merge-patch+json")


class StatusWatch:
    """Watches the jobs and notes when each pod (name, attempt) first shows `Unresponsive` in
    its job's `status.ranks` (an episode: noted again after it left the state)."""

    def __init__(self, api: Api, namespace: str) -> None:
        self.api = api
        self.namespace = namespace
        self.current: dict[str, set[tuple[str, int | None]]] = {}
        """Job -> the (pod, attempt) Unresponsive in its latest status."""
        self.episodes: list[tuple[float, str, int | None]] = []
        """(when first seen, pod, attempt), in order."""

    def on_job(self, obj: dict[str, Any]) -> None:
        now = time.time()
        name = (obj.get("metadata") or {}).get("name", "")
        ranks = (obj.get("status") or {}).get("ranks") or []
        seen = {(r.get("pod") or "", r.get("attempt")) for r in ranks
                if r.get("state") == "Unresponsive"}
        for pod, attempt in sorted(seen - self.current.get(name, set()), key=str):
            self.episodes.append((now, pod, attempt))
        self.current[name] = seen

    def first_seen(self, pod: str, attempt: int | None) -> float | None:
        return next((t for t, p, a in self.episodes if p == pod and a == attempt), None)

    async def run(self) -> None:
        path = f"{GROUP_PATH}/namespaces/{self.namespace}/resilienttrainingjobs"
        while True:
            try:
                listing = await self.api.call("GET", path)
                for item in listing["items"]:
                    self.on_job(item)
                url = (f"{self.api.server}{path}?watch=1"
                       f"&resourceVersion={listing['metadata']['resourceVersion']}")
                self.api.requests += 1
                async with self.api.session.get(
                        url, timeout=aiohttp.ClientTimeout(total=None, sock_read=None)) as stream:
                    async for line in stream.content:
                        if line.strip():
                            event = json.loads(line)
                            if event.get("type") in ("ADDED", "MODIFIED"):
                                self.on_job(event["object"])
            except (TimeoutError, aiohttp.ClientError, RuntimeError):
                await asyncio.sleep(0.5)


def iso(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


# --- measuring -------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Sampler:
    """CPU (cores, per 5 s window) and RSS of one process, sampled every second."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, float, int]] = []

    async def run(self) -> None:
        while True:
            try:
                self.samples.append((time.monotonic(), cpu_seconds(self.pid),
                                     rss_bytes(self.pid)))
            except (OSError, ValueError, IndexError):
                return
            await asyncio.sleep(1.0)

    def summary(self, since: float) -> dict[str, Any]:
        rows = [s for s in self.samples if s[0] >= since]
        if len(rows) < 2:
            return {}
        wall = rows[-1][0] - rows[0][0]
        windows = [(rows[i + 5][1] - rows[i][1]) / (rows[i + 5][0] - rows[i][0])
                   for i in range(0, len(rows) - 5)]
        return {"cores_average": round((rows[-1][1] - rows[0][1]) / wall, 3),
                "cores_peak_5s": round(max(windows), 3) if windows else None,
                "rss_mib_max": round(max(r[2] for r in rows) / 2**20, 1),
                "rss_mib_end": round(rows[-1][2] / 2**20, 1)}


async def operator_metrics(port: int) -> dict[str, Any]:
    """The operator's own counters: passes by outcome, pass count and mean duration by what
    woke them, reads of every pod of a job, stale-heartbeat detections and how late they
    were."""
    async with aiohttp.ClientSession() as session, session.get(
            f"http://127.0.0.1:{port}/metrics", timeout=aiohttp.ClientTimeout(total=10)) as r:
        text = await r.text()
    passes: dict[str, float] = {}
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    single: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "rtj_operator_reconcile_passes_total":
                passes[sample.labels["outcome"]] = sample.value
            elif sample.name == "rtj_operator_reconcile_seconds_sum":
                sums[sample.labels["trigger"]] = sample.value
            elif sample.name == "rtj_operator_reconcile_seconds_count":
                counts[sample.labels["trigger"]] = sample.value
            elif sample.name.endswith(("_sum", "_count")):
                single[sample.name] = sample.value

    def mean(name: str) -> float | None:
        n = single.get(f"{name}_count")
        return round(single[f"{name}_sum"] / n, 4) if n else None

    return {
        "passes_by_outcome": passes,
        "passes_by_trigger": {k: {"n": int(v), "mean_seconds": round(sums[k] / v, 4)}
                              for k, v in counts.items() if v},
        "every_pod_reads": int(single.get("rtj_operator_liveness_read_seconds_count", 0)),
        "every_pod_read_mean_seconds": mean("rtj_operator_liveness_read_seconds"),
        "heartbeat_stale_detections": int(single.get(
            "rtj_operator_heartbeat_stale_detection_seconds_count", 0)),
        "heartbeat_stale_detection_lag_mean_seconds": mean(
            "rtj_operator_heartbeat_stale_detection_seconds"),
    }


async def request_total(api: Api) -> float:
    text = await api.call("GET", "/metrics")
    total = 0.0
    for line in str(text).splitlines():
        if line.startswith("apiserver_request_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


# --- the run ---------------------------------------------------------------------------------


async def wait_running(api: Api, namespace: str, jobs: int, timeout: float) -> float:
    started = time.monotonic()
    while True:
        try:
            listing = await api.call("GET", f"{GROUP_PATH}/namespaces/{namespace}/"
                                            "resilienttrainingjobs")
        except (RuntimeError, aiohttp.ClientError, TimeoutError):
            listing = {"items": []}  # an overloaded apiserver: ask again
        states = [(i.get("status") or {}).get("state") for i in listing["items"]]
        if len(states) == jobs and all(s == "Running" for s in states):
            return time.monotonic() - started
        if time.monotonic() - started > timeout:
            raise RuntimeError(f"jobs not Running after {timeout:g} s: {states[:10]}")
        await asyncio.sleep(2)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from harness.cluster import CRD_DIR, Cluster
    from harness.controlplane import ControlPlane, ensure_binaries

    from .kubejobs import operator_ports, start_operator

    rng = random.Random(args.seed)
    work = (args.work_dir or Path(tempfile.mkdtemp(prefix="rtj-bench-scale."))).resolve()
    work.mkdir(parents=True, exist_ok=True)
    control_plane = ControlPlane(ensure_binaries(), work)
    cluster = Cluster(work, control_plane.bin_dir, control_plane)
    operator = None
    api: Api | None = None
    tasks: list[asyncio.Task[Any]] = []
    try:
        control_plane.start_storage_and_api()
        cluster.apply_crds(CRD_DIR)
        api = Api(control_plane.server, control_plane.pki)
        total_nodes = args.jobs * args.nodes + 2
        names = [f"sim-p5-{i:05d}" for i in range(total_nodes)]
        slots = asyncio.Semaphore(16)

        async def make_node(name: str) -> None:
            async with slots:
                assert api is not None
                await api.call("POST", "/api/v1/nodes", {
                    "apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
                        "node.kubernetes.io/instance-type": "p5.48xlarge"}}})
                await api.call("PATCH", f"/api/v1/nodes/{name}/status", {"status": {
                    "conditions": [{"type": "Ready", "status": "True", "reason": "Simulated",
                                    "lastHeartbeatTime": iso(time.time()),
                                    "lastTransitionTime": iso(time.time())}],
                    "capacity": {"cpu": "192", "memory": "2Ti", "nvidia.com/gpu": "8",
                                 "vpc.amazonaws.com/efa": "32", "pods": "110"},
                    "allocatable": {"cpu": "192", "memory": "2Ti", "nvidia.com/gpu": "8",
                                    "vpc.amazonaws.com/efa": "32", "pods": "110"}}},
                    content_type="application/merge-patch+json")

        await asyncio.gather(*(make_node(n) for n in names))
        namespace = "scale"
        await api.call("POST", "/api/v1/namespaces",
                       {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        sim = Simulator(api, names, args.procs_per_node)
        tasks.append(asyncio.ensure_future(sim.kubelet()))
        ports = operator_ports()
        operator = await asyncio.to_thread(start_operator, cluster, work / "operator.log",
                                           args.reconcile_interval, ports)
        operator_pid = operator.process.pid
        sampler = Sampler(operator_pid)
        tasks.append(asyncio.ensure_future(sampler.run()))
        apiserver_pid = next(p.pid for p in control_plane.processes
                             if p.name == "kube-apiserver")
        api_sampler = Sampler(apiserver_pid)
        tasks.append(asyncio.ensure_future(api_sampler.run()))
        watch = StatusWatch(api, namespace)
        tasks.append(asyncio.ensure_future(watch.run()))
        created = time.monotonic()
        for j in range(args.jobs):
            if j:
                await asyncio.sleep(args.stagger_seconds)
            await api.call("POST", f"{GROUP_PATH}/namespaces/{namespace}/resilienttrainingjobs",
                           job_manifest(f"job-{j:03d}", args.nodes, args.procs_per_node),
                           ok=(409,))  # a retried create that had gone through
        created = time.monotonic() - created
        startup = await wait_running(api, namespace, args.jobs, args.start_timeout) + created
        print(f"[bench.scale] every job Running after {startup:.1f} s", flush=True)
        await asyncio.sleep(5)

        # --- the measured window ---
        load_before = os.getloadavg()
        t0 = time.monotonic()
        sim_cpu0 = time.process_time()
        requests0 = await request_total(api)
        sim_requests0 = api.requests
        expected_deletions: set[str] = set()
        hung: set[tuple[str, int | None]] = set()
        known_deletions = len(sim.deletions)
        known_episodes = len(watch.episodes)
        hangs: list[float] = []
        hang_detections: list[float] = []
        kills: list[float] = []
        false_detections: list[str] = []
        misses: list[str] = []
        false_positives: list[str] = []
        degraded_seen: set[str] = set()
        deadline = t0 + args.minutes * 60
        kind_next = "hang"

        def new_false_positives() -> None:
            nonlocal known_deletions, known_episodes
            for _at, name, uid in sim.deletions[known_deletions:]:
                if uid not in expected_deletions:
                    false_positives.append(name)
            known_deletions = len(sim.deletions)
            for _at, pod, attempt in watch.episodes[known_episodes:]:
                if (pod, attempt) not in hung:
                    false_detections.append(f"{pod} (attempt {attempt})")
            known_episodes = len(watch.episodes)

        async def check_degraded() -> None:
            assert api is not None
            listing = await api.call("GET", f"{GROUP_PATH}/namespaces/{namespace}/"
                                            "resilienttrainingjobs")
            for item in listing["items"]:
                for c in (item.get("status") or {}).get("conditions") or []:
                    if c.get("type") == "ObservationDegraded" and c.get("status") == "True":
                        degraded_seen.add(item["metadata"]["name"])

        while time.monotonic() < deadline - HANG_THRESHOLD - 15:
            await asyncio.sleep(rng.uniform(3, 10))
            new_false_positives()
            await check_degraded()
            candidates = [p for p in sim.pods.values()
                          if p.role == "trainer" and not p.killed and not p.hung
                          and p.uid not in sim.deleting_seen]
            if not candidates:
                continue
            target = rng.choice(candidates)
            expected_deletions.add(target.uid)
            injected = time.time()
            if kind_next == "hang":
                hung.add((target.name, target.attempt))
                target.hung[rng.randrange(args.procs_per_node)] = float(int(injected))
            else:
                await sim.kill(target)
            limit = injected + (HANG_THRESHOLD + 60 if kind_next == "hang" else 60)
            while target.uid not in sim.deleting_seen and time.time() < limit:
                await asyncio.sleep(0.1)
            seen = sim.deleting_seen.get(target.uid)
            if seen is None:
                misses.append(f"{kind_next} {target.name}")
            else:
                (hangs if kind_next == "hang" else kills).append(seen - injected)
            if kind_next == "hang":
                await asyncio.sleep(1)  # the status watch may deliver a moment later
                detected = watch.first_seen(target.name, target.attempt)
                if detected is None:
                    misses.append(f"hang {target.name}: never Unresponsive in status")
                else:
                    hang_detections.append(detected - injected)
            kind_next = "kill" if kind_next == "hang" else "hang"
            # Wait for the job to be whole again before the next fault: the replacement runs
            # (its start restarts the others' heartbeat clocks) and the job says Running.
            replaced = time.time() + 120
            while time.time() < replaced and not any(
                    p.job == target.job and p.index == target.index and p.uid != target.uid
                    and p.uid not in sim.pending for p in sim.pods.values()):
                await asyncio.sleep(0.2)
            await asyncio.sleep(1)
            try:
                await wait_running(api, namespace, args.jobs, 120)
            except RuntimeError as error:
                misses.append(f"not whole again: {error}")
                break
        await asyncio.sleep(max(0.0, deadline - time.monotonic()))
        new_false_positives()
        await check_degraded()
        wall = time.monotonic() - t0
        stale_events = await api.call(
            "GET", f"/api/v1/namespaces/{namespace}/events?fieldSelector=reason%3DHeartbeatStale")
        try:
            internals = await operator_metrics(int(ports["RTJ_OPERATOR_METRICS_PORT"]))
        except (OSError, aiohttp.ClientError, TimeoutError) as error:
            internals = {"error": str(error)}
        requests = await request_total(api) - requests0
        sim_requests = api.requests - sim_requests0
        sim_cpu = time.process_time() - sim_cpu0
        hang_excess = [h - HANG_THRESHOLD for h in hangs]
        detection_excess = [h - HEARTBEAT_TIMEOUT for h in hang_detections]
        total_pods = args.jobs * args.nodes
        operator_usage = sampler.summary(t0)
        return {
            "benchmark": "scale",
            "command": "python -m bench.scale " + shlex.join(argv_of(args)),
            "jobs": args.jobs, "nodes_per_job": args.nodes,
            "procs_per_node": args.procs_per_node,
            "pods": total_pods, "ranks": total_pods * args.procs_per_node,
            "measured_minutes": round(wall / 60, 2),
            "startup_seconds_to_running": round(startup, 1),
            "heartbeat_timeout_seconds": HEARTBEAT_TIMEOUT,
            "initial_heartbeat_timeout_seconds": INITIAL_HEARTBEAT_TIMEOUT,
            "hang_threshold_seconds": HANG_THRESHOLD,
            "hang_to_unresponsive_seconds": spread(hang_detections),
            "hang_to_unresponsive_past_heartbeat_timeout_seconds": spread(detection_excess),
            "hang_to_pod_deleted_seconds": spread(hangs),
            "hang_to_pod_deleted_past_threshold_seconds": spread(hang_excess),
            "kill_to_pod_deleted_seconds": spread(kills),
            "missed_detections": misses,
            "false_positives": len(false_positives) + len(false_detections),
            "false_positive_deletions": false_positives[:20],
            "false_positive_detections": false_detections[:20],
            "heartbeat_stale_events": len(stale_events.get("items") or []),
            "observation_degraded_jobs": sorted(degraded_seen),
            "targets": {
                "hang_detected_p99_within_seconds": HEARTBEAT_TIMEOUT + DETECTION_SLACK,
                "hang_detected_met": bool(hang_detections) and (
                    percentile(hang_detections, 99) or 0) <= HEARTBEAT_TIMEOUT + DETECTION_SLACK,
                "hang_acted_p99_within_seconds_of_threshold": DETECTION_SLACK,
                "hang_acted_met": bool(hangs) and (
                    percentile(hang_excess, 99) or 0) <= DETECTION_SLACK,
                "kill_acted_p99_within_seconds": KILL_TARGET,
                "kill_acted_met": bool(kills) and (percentile(kills, 99) or 0) <= KILL_TARGET,
                "no_false_positives": not false_positives and not false_detections,
                "operator_cores_average_at_most": 1.0,
                "operator_rss_mib_at_most": 1024,
                "operator_met": (operator_usage.get("cores_average", 99) <= 1.0
                                 and operator_usage.get("rss_mib_max", 1e9) <= 1024),
            },
            "operator": operator_usage,
            "operator_internals": internals,
            "kube_apiserver": api_sampler.summary(t0),
            "api_requests_per_second": round(requests / wall, 1),
            "simulator_api_requests_per_second": round(sim_requests / wall, 1),
            "operator_api_requests_per_second_estimate": round(
                (requests - sim_requests) / wall, 1),
            "simulator_cores_average": round(sim_cpu / wall, 3),
            "load_average_before": [round(x, 2) for x in load_before],
            "load_average_after": [round(x, 2) for x in os.getloadavg()],
            "machine": machine_description(),
            "work_dir": str(work),
        }
    finally:
        for task in tasks:
            task.cancel()
        if operator is not None:
            operator.stop()
        if api is not None:
            await api.close()
        control_plane.stop()


def argv_of(args: argparse.Namespace) -> list[str]:
    out = ["--nodes", str(args.nodes), "--procs-per-node", str(args.procs_per_node),
           "--minutes", f"{args.minutes:g}", "--jobs", str(args.jobs)]
    if args.seed is not None:
        out += ["--seed", str(args.seed)]
    if args.jobs > 1:
        out += ["--stagger-seconds", f"{args.stagger_seconds:g}"]
    if args.reconcile_interval is not None:
        out += ["--reconcile-interval", f"{args.reconcile_interval:g}"]
    if args.out is not None:
        out += ["--out", str(args.out)]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import resource

    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text, flush=True)
    if args.out is not None:
        write_json(args.out, result)
    return 0 if not result["false_positives"] and not result["missed_detections"] else 1


if __name__ == "__main__":
    sys.exit(main())
