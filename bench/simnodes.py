"""`bench.scale`'s simulated nodes: a light kubelet and simulated ranks for thousands of pods that
run no process.

Why not the harness's kubelet (`tests/harness/kubelet`): it runs every container as a real host
process tree in its own cgroup and namespaces, renews every node's Lease every 2 s (500 requests a
second for a thousand nodes, counted in the apiserver's load this benchmark measures), and runs
only the pods the real kube-scheduler has bound; a thousand p5 nodes of eight ranks would be a
thousand trainer processes on a 2-core machine. The scale benchmark measures the operator, not the
pods, so here a pod is a record and an HTTP endpoint in one asyncio loop:

- the kubelet (`Simulator.kubelet`) watches the jobs' pods, binds each new trainer pod to a free
  simulated Node (a rendezvous pod to a shared one), marks it Running with its own loopback
  address, and finishes a deletion at once (grace 0); `kill` turns a pod Failed (exit 137);
- the ranks: every Running trainer pod serves the pod liveness endpoint the operator reads
  (`GET /ranks` on RTJ_METRICS_PORT - 1, the document of rtj_wire.ranks, made by
  `ranks_document`), its ranks beating every second and stepping on, except a hung rank.

From the harness it takes what fits: the Node objects (`harness.nodestate.node_manifest` and
`node_status`, as its kubelet registers them, without Leases: no controller watches them here),
the loopback pod addresses (`harness.ipam.LoopbackIpAllocator`) and its timestamps.
"""

from __future__ import annotations

import asyncio
import json
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from harness.ipam import LoopbackIpAllocator
from harness.kubeapi import KubeApi
from harness.nodestate import node_manifest, node_status, now_rfc3339
from rtj_wire import ranks

from .asyncapi import Api

JOB_LABEL = "training.resilient.dev/job"
ROLE_LABEL = "training.resilient.dev/role"
INDEX_LABEL = "training.resilient.dev/node-index"
ATTEMPT_LABEL = "training.resilient.dev/attempt"
METRICS_PORT = 9400
NODE_IP = "127.0.0.1"
"""Every simulated node's address (and every pod's hostIP): nothing connects to a node."""


def register_nodes(api: KubeApi, names: list[str], parallel: int = 16) -> None:
    """Create the Nodes, Ready, as the harness's kubelet registers its own (p5.48xlarge labels and
    capacity), `parallel` at a time."""

    def register(index: int, name: str) -> None:
        api.create("/api/v1/nodes", node_manifest(name, index))
        api.patch(f"/api/v1/nodes/{name}/status",
                  {"status": node_status(name, NODE_IP, True, now_rfc3339())})

    with ThreadPoolExecutor(parallel) as pool:
        list(pool.map(register, range(len(names)), names))


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
    started_at: str = field(default_factory=now_rfc3339)
    server: asyncio.Server | None = None
    hung: dict[int, float] = field(default_factory=dict)
    """Local rank -> the heartbeat it froze at."""
    killed: bool = False


def ranks_document(pod: SimPod, procs: int, now: float) -> dict[str, Any]:
    """The pod's `GET /ranks` answer at `now` (rtj_wire.ranks): `procs` ranks, a heartbeat every
    whole second (a hung rank's frozen), one step a second since the pod started."""
    beat = float(int(now))
    step = int(now - pod.started)
    base = (pod.index or 0) * procs
    return ranks.document(
        ranks.RankRecord(local_rank=r, rank=base + r, heartbeat=pod.hung.get(r, beat), step=step,
                         restarts={"launcher": 0, "inprocess": 0, "pod": 0})
        for r in range(procs))


async def serve_ranks(pod: SimPod, procs: int) -> None:
    """Serve the pod's liveness endpoint on its own address (keep-alive, any path)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                if not request:
                    break
                body = json.dumps(ranks_document(pod, procs, time.time())).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    pod.server = await asyncio.start_server(handle, pod.ip, METRICS_PORT - 1)


class Simulator:
    """The kubelet of every simulated node, and the ranks of every trainer pod."""

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
        self.ips = LoopbackIpAllocator()
        self.pending: set[str] = set()
        self._tasks: set[asyncio.Future[Any]] = set()

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.ensure_future(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def kubelet(self) -> None:
        """Watch the jobs' pods for ever (re-opening the watch when it ends)."""
        await self.api.list_and_watch("/api/v1/pods", self.on_event, selector=JOB_LABEL)

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
            pod = self.pod_of(meta, node)
            base = f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}"
            await self.api.call("POST", base + "/binding", {
                "apiVersion": "v1", "kind": "Binding", "metadata": {"name": pod.name},
                "target": {"apiVersion": "v1", "kind": "Node", "name": node}},
                ok=(409,))  # a retried binding that had gone through
            if pod.role == "trainer":
                await serve_ranks(pod, self.procs)
            self.pods[uid] = pod
            await self.api.call("PATCH", base + "/status", running_status(obj, pod),
                                content_type="application/merge-patch+json")
        finally:
            self.pending.discard(uid)

    def pod_of(self, meta: dict[str, Any], node: str) -> SimPod:
        labels = meta.get("labels") or {}
        index = labels.get(INDEX_LABEL)
        attempt = labels.get(ATTEMPT_LABEL)
        return SimPod(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"],
                      job=labels.get(JOB_LABEL, ""), role=labels.get(ROLE_LABEL, ""),
                      index=int(index) if index is not None else None,
                      attempt=int(attempt) if attempt is not None else None, node=node,
                      ip=self.ips.allocate())

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
            self.ips.release(pod.ip)
            if pod.role == "trainer":
                self.free_nodes.append(pod.node)

    async def kill(self, pod: SimPod) -> None:
        """The pod's processes are gone: its endpoint closes and its status turns Failed (137)."""
        pod.killed = True
        if pod.server is not None:
            pod.server.close()
        await self.api.call(
            "PATCH", f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status",
            {"status": {"phase": "Failed", "containerStatuses": [{
                "name": "trainer", "image": "", "imageID": "", "ready": False,
                "restartCount": 0, "state": {"terminated": {
                    "exitCode": 137, "reason": "Error", "startedAt": pod.started_at,
                    "finishedAt": now_rfc3339()}}}]}},
            content_type="application/merge-patch+json")


def running_status(obj: dict[str, Any], pod: SimPod) -> dict[str, Any]:
    """The status patch of a pod that runs and is ready (its first container, started now)."""
    now = now_rfc3339()
    container = obj["spec"]["containers"][0]
    return {"status": {
        "phase": "Running", "podIP": pod.ip, "podIPs": [{"ip": pod.ip}],
        "hostIP": NODE_IP, "startTime": now,
        "conditions": [{"type": "PodScheduled", "status": "True"},
                       {"type": "Ready", "status": "True"}],
        "containerStatuses": [{
            "name": container["name"], "image": container.get("image", ""),
            "imageID": "", "ready": True, "restartCount": 0,
            "state": {"running": {"startedAt": now}}}]}}
