"""The fault campaign's cluster (`bench.chaos`): the local cluster of tests/harness (real control
plane, three process-backed p5-like nodes), the operator (which a fault may kill and the campaign
starts again on the same ports), and reading a job: its status, its rank 0's steps, its
checkpoint commits, its pods and their processes.
"""

from __future__ import annotations

import argparse
import signal
import time
from pathlib import Path
from typing import Any

from .chaos_results import read_commits
from .common import StampedProcess
from .kubejobs import job_dir, job_status, operator_ports, start_operator
from .localrun import StepRecord, read_losses


class ChaosCluster:
    """The cluster and the operator (restartable), and what a job looks like on them now."""

    def __init__(self, args: argparse.Namespace, work_dir: Path) -> None:
        from harness.cluster import Cluster

        self.args = args
        self.work_dir = work_dir
        self.cluster = Cluster.start(work_dir / "cluster", nodes=3)
        self.namespace = self.cluster.create_namespace("chaos")
        self.operator: StampedProcess | None = None
        self.operator_starts = 0
        self.operator_ports = operator_ports()
        """Kept across operator restarts: the running jobs' pods use its rendezvous port."""
        self.start_operator()

    def start_operator(self) -> None:
        self.operator_starts += 1
        self.operator = start_operator(
            self.cluster, self.work_dir / f"operator-{self.operator_starts}.log", None,
            self.operator_ports)

    def kill_operator(self) -> None:
        assert self.operator is not None
        self.operator.process.send_signal(signal.SIGKILL)
        self.operator.process.wait(timeout=30)

    def stop(self) -> None:
        if self.operator is not None:
            self.operator.stop()
        self.cluster.stop()

    # -- reading a job ---------------------------------------------------------------------------

    def status(self, name: str) -> dict[str, Any]:
        return job_status(self.cluster, self.namespace, name)

    def job_dir(self, name: str) -> Path | None:
        return job_dir(self.cluster, self.namespace, name)

    def records(self, name: str) -> list[StepRecord]:
        directory = self.job_dir(name)
        return read_losses(directory / "losses.jsonl") if directory else []

    def pod(self, name: str) -> dict[str, Any] | None:
        return self.cluster.api.get_or_none(f"/api/v1/namespaces/{self.namespace}/pods/{name}")

    def pod_pids(self, pod: str) -> set[int]:
        """Every process of the pod: its cgroup (torchelastic starts workers in sessions of
        their own, so process groups miss them)."""
        for described in self.cluster.nodes.pods():
            if described["namespace"] == self.namespace and described["name"] == pod:
                cgroup = described.get("cgroup")
                if not cgroup:
                    return set()
                pids: set[int] = set()
                for procs in Path(cgroup).rglob("cgroup.procs"):
                    try:
                        pids.update(int(x) for x in procs.read_text().split())
                    except (OSError, ValueError):
                        continue
                return pids
        return set()

    def note_commits(self, name: str, commits: dict[int, float]) -> None:
        """Remember when each checkpoint step was committed (its manifest's `committed_at`)."""
        directory = self.job_dir(name)
        if directory is not None:
            read_commits(directory, commits)

    def wait_until(self, what: str, deadline: float, predicate: Any, commits: dict[int, float],
                   name: str) -> Any:
        while time.monotonic() < deadline:
            self.note_commits(name, commits)
            value = predicate()
            if value:
                return value
            state = self.status(name).get("state")
            if state in ("Succeeded", "Failed"):
                raise TimeoutError(f"the job ended ({state}) while waiting for {what}")
            time.sleep(0.2)
        raise TimeoutError(f"timed out waiting for {what}")
