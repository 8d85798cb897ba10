"""The fault kinds of the campaign (`bench.chaos`), on the cluster: how each is injected into a
running job (or, for the trainer's own kinds, how the campaign sees it fire), when its job counts
as recovered, and what is undone after it (a partitioned node healed, a killed operator started).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from .chaos_cluster import ChaosCluster
from .chaos_plan import TRAINER_KINDS, JobPlan, PlannedFault
from .chaos_results import FaultResult
from .localrun import read_fault_times


class FaultKinds(ChaosCluster):
    """Injects each kind of fault into a running job and waits for the job's way back."""

    def inject(self, plan: JobPlan, fault: PlannedFault, result: FaultResult,
               commits: dict[int, float], deadline: float) -> None:
        name = plan.name
        if fault.kind in TRAINER_KINDS:
            marker = f"step{fault.step}-rank{fault.rank}-{fault.kind}"

            def fired() -> float | None:
                directory = self.job_dir(name)
                return read_fault_times(directory).get(marker) if directory else None

            result.injected_at = self.wait_until(f"fault {marker} to fire", deadline, fired,
                                                 commits, name)
            return
        self.wait_until(f"step {fault.step - 1}", deadline,
                        lambda: any(r.step >= fault.step - 1 for r in self.records(name)),
                        commits, name)
        victim = f"{name}-1"
        if fault.kind == "pod-kill":
            result.injected_at = time.time()
            self.cluster.nodes.kill_pod(self.namespace, victim, 9)
        elif fault.kind == "rendezvous-kill":
            result.injected_at = time.time()
            self.cluster.nodes.kill_pod(self.namespace, f"{name}-rdzv", 9)
        elif fault.kind == "node-partition":
            pod = self.pod(victim) or {}
            node = pod.get("spec", {}).get("nodeName")
            if not node:
                raise TimeoutError(f"pod {victim} has no node")
            result.detail["node"] = node
            rendezvous = self.pod(f"{name}-rdzv") or {}
            shared = rendezvous.get("spec", {}).get("nodeName") == node
            result.injected_at = time.time()
            self.cluster.nodes.partition_node(node)
            if shared:
                self.heal_once_rendezvous_replaced(plan, rendezvous, result, commits, deadline)
        elif fault.kind == "operator-kill":
            uid = (self.pod(victim) or {}).get("metadata", {}).get("uid")
            result.injected_at = time.time()
            self.cluster.nodes.kill_pod(self.namespace, victim, 9)

            def acted() -> bool:
                pod = self.pod(victim)
                return pod is None or pod["metadata"]["uid"] != uid or bool(
                    pod["metadata"].get("deletionTimestamp"))

            self.wait_until("the operator to act", deadline, acted, commits, name)
            self.kill_operator()
            result.detail["operator_killed_after_seconds"] = round(
                time.time() - result.injected_at, 2)
            time.sleep(1)
            self.start_operator()
        elif fault.kind == "writer-kill":
            result.injected_at = self.kill_writer(plan, fault, commits, deadline)

    def heal_once_rendezvous_replaced(self, plan: JobPlan, rendezvous: dict[str, Any],
                                      result: FaultResult, commits: dict[int, float],
                                      deadline: float) -> None:
        """The partitioned node also runs the job's rendezvous pod. The harness's pods share one
        network namespace, and nvrx-control's TCPStore listens on the port on every address, so
        the frozen process of the force-deleted rendezvous pod keeps the port and no replacement
        can listen on it (EADDRINUSE; on a cluster each pod has its own network namespace).
        Once the operator has force-deleted that pod (its part: NodeLost, a full restart), the
        node is healed, which kills the processes of the pods force-deleted there, as a kubelet
        does when it reconnects."""
        uid = rendezvous.get("metadata", {}).get("uid")

        def replaced() -> bool:
            now = self.pod(f"{plan.name}-rdzv")
            return now is None or now["metadata"]["uid"] != uid

        self.wait_until("the operator to force-delete the rendezvous pod", deadline, replaced,
                        commits, plan.name)
        assert result.injected_at is not None
        result.detail["rendezvous_on_node"] = True
        result.detail["healed_after_seconds"] = round(time.time() - result.injected_at, 2)
        self.cluster.nodes.heal_node(result.detail["node"])

    def kill_writer(self, plan: JobPlan, fault: PlannedFault, commits: dict[int, float],
                    deadline: float) -> float:
        """SIGKILL the asynchronous checkpoint writer of the pod that runs `fault.rank`."""
        pod = f"{plan.name}-{fault.rank // 2}"

        def writer() -> int | None:
            return find_writer(self.pod_pids(pod))

        pid = self.wait_until(f"a checkpoint writer in pod {pod}", deadline, writer, commits,
                              plan.name)
        at = time.time()
        os.kill(pid, signal.SIGKILL)
        return at

    def wait_for_recovery(self, plan: JobPlan, result: FaultResult, commits: dict[int, float],
                          deadline: float) -> None:
        """Until a new attempt completed a step after the fault, or the job ended (a fault that
        needed no restart: `analyse_fault` calls it absorbed)."""
        assert result.injected_at is not None
        injected = result.injected_at
        records = self.records(plan.name)
        before = [r for r in records if r.at <= injected]
        running = max(before, key=lambda r: r.at).attempt if before else None

        def new_attempt() -> bool:
            return any(r.at > injected and r.attempt != running
                       for r in self.records(plan.name))

        try:
            self.wait_until("a new attempt's first step after the fault", deadline, new_attempt,
                            commits, plan.name)
        except TimeoutError:
            if self.status(plan.name).get("state") != "Succeeded":
                raise
            result.detail["job_ended"] = True

    def after(self, fault: PlannedFault, result: FaultResult) -> None:
        if fault.kind == "node-partition" and "node" in result.detail:
            self.cluster.nodes.heal_node(result.detail["node"])
        if self.operator is not None and self.operator.process.poll() is not None:
            self.start_operator()


def find_writer(pids: set[int]) -> int | None:
    """The pid of a checkpoint writer process (named `rtj-ckpt-writer` by the trainer) among
    these processes."""
    for pid in sorted(pids):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:
            continue
        if name == "rtj-ckpt-writer":
            return pid
    return None
