"""What the process-backed nodes know and report: p5 Node objects, pod runtime records, statuses.

Pure builders (no API calls), kept apart from the reconcile loop in `nodes` so they are easy to
read and to unit-test.
"""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from harness.kubeapi import JsonObject

KUBELET_VERSION = "v1.34.4"

P5_RESOURCES = {
    "cpu": "192",
    "memory": "2048Gi",
    "nvidia.com/gpu": "8",
    "vpc.amazonaws.com/efa": "32",
    "hugepages-2Mi": "8Gi",
    "hugepages-1Gi": "0",
    "ephemeral-storage": "3500Gi",
    "pods": "110",
}


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def now_micro() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def node_manifest(name: str, index: int, zone: str = "us-east-2a") -> JsonObject:
    """The Node object (metadata + spec) of a p5.48xlarge-shaped harness node."""
    labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": "p5.48xlarge",
        "beta.kubernetes.io/instance-type": "p5.48xlarge",
        "topology.kubernetes.io/region": zone[:-1],
        "topology.kubernetes.io/zone": zone,
        "nvidia.com/gpu.present": "true",
        "vpc.amazonaws.com/efa.present": "true",
        "harness.local/node-index": str(index),
    }
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels}}


def node_conditions(ready: bool, heartbeat: str, transition: str) -> list[JsonObject]:
    def condition(kind: str, status: str, reason: str, message: str) -> JsonObject:
        return {
            "type": kind,
            "status": status,
            "reason": reason,
            "message": message,
            "lastHeartbeatTime": heartbeat,
            "lastTransitionTime": transition,
        }

    return [
        condition("MemoryPressure", "False", "KubeletHasSufficientMemory", "harness node"),
        condition("DiskPressure", "False", "KubeletHasNoDiskPressure", "harness node"),
        condition("PIDPressure", "False", "KubeletHasSufficientPID", "harness node"),
        condition("Ready", "True", "KubeletReady", "harness kubelet is posting ready status")
        if ready
        else condition("Ready", "False", "KubeletNotReady", "marked NotReady by the test harness"),
    ]


def node_status(name: str, ip: str, ready: bool, transition: str) -> JsonObject:
    """Full Node status: p5 capacity (= allocatable), conditions, addresses, node info."""
    return {
        "capacity": dict(P5_RESOURCES),
        "allocatable": dict(P5_RESOURCES),
        "conditions": node_conditions(ready, now_rfc3339(), transition),
        "addresses": [{"type": "InternalIP", "address": ip}, {"type": "Hostname", "address": name}],
        "daemonEndpoints": {"kubeletEndpoint": {"Port": 10250}},
        "nodeInfo": {
            "machineID": name,
            "systemUUID": name,
            "bootID": name,
            "kernelVersion": os.uname().release,
            "osImage": "harness process-backed node",
            "containerRuntimeVersion": "harness://1",
            "kubeletVersion": KUBELET_VERSION,
            "kubeProxyVersion": KUBELET_VERSION,
            "operatingSystem": "linux",
            "architecture": "amd64",
        },
    }


def exit_code_of(returncode: int) -> int:
    """Popen's -N (killed by signal N) becomes 128+N, as kubelet reports it."""
    return 128 - returncode if returncode < 0 else returncode


@dataclass
class ContainerRun:
    """One container: its current process, and its restart bookkeeping (Always/OnFailure)."""

    name: str
    image: str
    popen: subprocess.Popen[bytes]
    started_at: str
    cgroup: Path | None
    spec_file: Path
    log_file: Path
    exit_code: int | None = None
    finished_at: str | None = None
    restart_count: int = 0
    restart_at: float | None = None
    last_terminated: JsonObject | None = None
    termination_file: Path | None = None
    """Host file bind-mounted at the container's terminationMessagePath (one per container)."""
    termination_policy: str = "File"
    termination_message: str | None = None
    """What the last run of the container left there (read when it exited)."""

    @property
    def running(self) -> bool:
        return self.exit_code is None

    @property
    def active(self) -> bool:
        """Running, or waiting to be restarted (the pod is still Running then)."""
        return self.running or self.restart_at is not None

    def terminated_state(self) -> JsonObject:
        return {
            "terminated": {
                "exitCode": self.exit_code,
                "reason": "Completed" if self.exit_code == 0 else "Error",
                "startedAt": self.started_at,
                "finishedAt": self.finished_at,
                "containerID": f"harness://{self.popen.pid}",
                **({"message": self.termination_message} if self.termination_message else {}),
            }
        }

    def read_termination_message(self) -> None:
        """As the kubelet does when a container exits: the file's first 4096 bytes; with
        `FallbackToLogsOnError`, the log's tail (80 lines, 2048 bytes) when the file is empty and
        the container failed."""
        text = ""
        if self.termination_file is not None:
            try:
                with open(self.termination_file, "rb") as handle:
                    text = handle.read(TERMINATION_MESSAGE_BYTES).decode(errors="replace")
            except OSError:
                text = ""
        if not text and self.termination_policy == "FallbackToLogsOnError" and self.exit_code:
            try:
                lines = self.log_file.read_bytes().splitlines()[-LOG_TAIL_LINES:]
            except OSError:
                lines = []
            text = b"\n".join(lines)[-LOG_TAIL_BYTES:].decode(errors="replace")
        self.termination_message = text or None

    def status(self) -> JsonObject:
        if self.running:
            state: JsonObject = {"running": {"startedAt": self.started_at}}
        elif self.restart_at is not None:
            message = "back-off restarting failed container"
            state = {"waiting": {"reason": "CrashLoopBackOff", "message": message}}
        else:
            state = self.terminated_state()
        return {
            "name": self.name,
            "image": self.image,
            "imageID": "",
            "containerID": f"harness://{self.popen.pid}",
            "ready": self.running,
            "started": self.running,
            "restartCount": self.restart_count,
            "state": state,
            "lastState": self.last_terminated or {},
        }


TERMINATION_MESSAGE_BYTES = 4096
LOG_TAIL_LINES = 80
LOG_TAIL_BYTES = 2048


def restart_delay(restarts_so_far: int) -> float:
    """kubelet's back-off: the first restart at once, then 10 s doubling up to 5 minutes."""
    return 0.0 if restarts_so_far == 0 else min(10.0 * 2 ** (restarts_so_far - 1), 300.0)


@dataclass
class PodRun:
    """A pod whose containers this harness started."""

    uid: str
    namespace: str
    name: str
    node: str
    ip: str
    host_ip: str
    hostname: str
    hostname_is_explicit: bool
    subdomain: str | None
    restart_policy: str
    pod_dir: Path
    hosts_file: Path
    start_time: str
    cgroup: Path | None
    containers: dict[str, ContainerRun] = field(default_factory=dict)
    host_mountpoints: list[Path] = field(default_factory=list)
    hosts_text: str = ""
    kill_deadline: float | None = None
    vanished: bool = False
    cleaned: bool = False

    @property
    def alive(self) -> bool:
        return any(c.active for c in self.containers.values())

    @property
    def phase(self) -> str:
        if self.alive:
            return "Running"
        codes = [c.exit_code for c in self.containers.values()]
        return "Succeeded" if all(code == 0 for code in codes) else "Failed"

    def pgids(self) -> dict[str, int]:
        return {name: c.popen.pid for name, c in self.containers.items()}


class NotReadyToStart(Exception):
    """The pod cannot start yet (PVC not bound, ConfigMap missing...); retried every second."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


# Waiting reasons a test may make a node answer new pods with (`refuse_pods`), as kubelet writes
# them in containerStatuses[].state.waiting.reason.
REFUSAL_REASONS = frozenset(
    {
        "ErrImagePull",
        "ImagePullBackOff",
        "ErrImageNeverPull",
        "InvalidImageName",
        "CreateContainerConfigError",
        "CreateContainerError",
    }
)

ERR_IMAGE_PULL_SECONDS = 2.0


def refusal_waiting(
    reason: str, message: str, image: str, pulls: tuple[float, int] | None, now: float
) -> tuple[NotReadyToStart, tuple[float, int] | None]:
    """What a node that refuses pods reports for one pod now, and its image-pull record.

    `ErrImagePull` follows kubelet's image back-off: each pull attempt fails with ErrImagePull,
    and between attempts (10 s after the first failure, doubling up to 5 minutes) the container
    waits with ImagePullBackOff (after showing ErrImagePull for `ERR_IMAGE_PULL_SECONDS`, as the
    failed pull's status stays until kubelet's next pod sync). `pulls` is (time of the next
    attempt, failures so far). Any other reason is reported as it is.
    """
    if reason != "ErrImagePull":
        return NotReadyToStart(reason, message), pulls
    next_pull, failures = pulls if pulls is not None else (now, 0)
    if now >= next_pull:
        failures += 1
        return NotReadyToStart(reason, message), (now + restart_delay(failures), failures)
    if now < next_pull - restart_delay(failures) + ERR_IMAGE_PULL_SECONDS:
        return NotReadyToStart(reason, message), (next_pull, failures)
    backoff = f'Back-off pulling image "{image}": ErrImagePull: {message}'
    return NotReadyToStart("ImagePullBackOff", backoff), (next_pull, failures)


KUBELET_POD_CONDITIONS = ("PodReadyToStartContainers", "Initialized", "ContainersReady", "Ready")
"""The pod conditions a kubelet owns (kubelet's `PodConditionsByKubelet`, less the readiness gates
it does not support); every other condition on the pod is someone else's and is kept."""


def pod_conditions(pod: JsonObject, run: PodRun | None, ready: bool) -> list[JsonObject]:
    """Full condition list (merge patch replaces lists), keeping the scheduler's PodScheduled and
    every condition another component set (the eviction API's `DisruptionTarget`): like kubelet's
    status manager, which merges its own conditions over the others'."""
    now = now_rfc3339()
    old = {c["type"]: c for c in pod.get("status", {}).get("conditions", []) or []}

    def condition(kind: str, status: bool, reason: str | None = None) -> JsonObject:
        value = "True" if status else "False"
        previous = old.get(kind)
        since = now
        if previous is not None and previous.get("status") == value:
            since = previous.get("lastTransitionTime", now)
        result: JsonObject = {
            "type": kind,
            "status": value,
            "lastProbeTime": None,
            "lastTransitionTime": since,
        }
        if reason and not status:
            result["reason"] = reason
        return result

    scheduled = old.get("PodScheduled") or condition("PodScheduled", True)
    not_ready_reason = "PodCompleted" if run is not None and not run.alive else "ContainersNotReady"
    others = [c for kind, c in old.items() if kind not in (*KUBELET_POD_CONDITIONS, "PodScheduled")]
    return [
        condition("PodReadyToStartContainers", run is not None and run.alive),
        condition("Initialized", True),
        condition("ContainersReady", ready, not_ready_reason),
        condition("Ready", ready, not_ready_reason),
        scheduled,
        *others,
    ]
