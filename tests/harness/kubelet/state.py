"""The state of the harness kubelet, in one owner, and the helpers every part of it uses.

`KubeletState` holds every node and pod record. The behaviour is layered on it as a chain of
classes, one module each (nodes -> provisioner -> controls -> dns -> podstatus -> runtime ->
loop), so that `harness.kubelet.loop.Kubelet` is one object owning all of it: only its reconcile
thread touches this state (see the package docstring), except the heartbeat thread (`nodes`), which
reads `node_ready`, `partitioned` and `node_transition` under `heartbeat_lock`; the reconcile
thread changes those only while holding that lock. The chain, rather than independent mixins,
lets each layer call the layers below it with full type checking.
"""

from __future__ import annotations

import os
import queue
import threading
from collections import Counter
from datetime import datetime
from pathlib import Path
from typing import Any

from harness import cgroups
from harness.ipam import LoopbackIpAllocator
from harness.kubeapi import JsonObject, KubeApi
from harness.nodestate import (
    PodRun,
    now_rfc3339,
)


def log(message: str) -> None:
    print(f"[nodes {datetime.now().strftime('%H:%M:%S.%f')[:-3]}] {message}", flush=True)


def pod_path(pod: JsonObject) -> str:
    meta = pod["metadata"]
    return f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"


def os_kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def os_killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class KubeletState:
    """Owns all node/pod state; only the reconcile thread touches it."""

    def __init__(
        self, api: KubeApi, run_dir: Path, shared_dir: Path, node_count: int, prefix: str
    ) -> None:
        self.api = api
        self.run_dir = run_dir
        self.shared_dir = shared_dir
        self.logs_dir = run_dir / "pods"
        self.data_dir = run_dir / "pod-data"
        self.ips = LoopbackIpAllocator()
        self.nodes = [f"{prefix}-{i}" for i in range(node_count)]
        self.node_ips = {name: self.ips.node_ip(i) for i, name in enumerate(self.nodes)}
        self.node_ready = {name: True for name in self.nodes}
        self.node_transition = {name: now_rfc3339() for name in self.nodes}
        self.events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.pods: dict[tuple[str, str], JsonObject] = {}
        self.services: dict[tuple[str, str], JsonObject] = {}
        self.runs: dict[str, PodRun] = {}
        self.waiting: dict[str, str] = {}
        self.done: set[str] = set()
        self.unreported: set[str] = set()
        """Pods whose last status write failed (the API server did not answer): written again
        every tick, as kubelet's status manager syncs until the API has what it knows."""
        self.delete_requested: set[str] = set()
        self.partitioned: set[str] = set()
        self.refusals: dict[str, tuple[str, str]] = {}
        self.image_pulls: dict[str, tuple[float, int]] = {}
        self.heartbeat_lock = threading.Lock()
        self.provisioned: dict[str, tuple[str, Path]] = {}
        self.mountpoint_refs: Counter[Path] = Counter()
        self.cgroups = cgroups.CgroupTree.create(f"rtj-harness-{os.getpid()}")
        self.stopping = threading.Event()
        self.control_url = ""

    def cut_off(self, node: str | None) -> bool:
        """Whether `node` is partitioned: its kubelet must not act on the API for its pods."""
        return node in self.partitioned

    def require_node(self, name: str) -> None:
        if name not in self.node_ready:
            raise KeyError(f"no harness node {name!r}")

    def pod_by_uid(self, uid: str) -> JsonObject | None:
        return next((p for p in self.pods.values() if p["metadata"]["uid"] == uid), None)
