"""The fault kinds of the campaign (`bench.chaos`), on the cluster: how each is injected into a
running job (or, for the trainer's own kinds, how the campaign sees it fire), when its job counts
as recovered, and what is undone after it (a partitioned node healed, a killed operator started).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from rtj_trainer.checkpoint.format import step_of

from .chaos_cluster import ChaosCluster
from .chaos_plan import CHECKPOINT_KINDS, CONTROL_PLANE_KINDS, TRAINER_KINDS, JobPlan, PlannedFault
from .chaos_results import FaultResult, newest_checkpoint_dir
from .localrun import read_fault_times

CATCH_UP_TIMEOUT = 120.0
"""How long after a control-plane fault the campaign waits for the job's status to catch up."""


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
        elif fault.kind == "checkpoint-dir-removed":
            result.injected_at = self.remove_checkpoint_dir(plan, fault, result, commits,
                                                            deadline)
        elif fault.kind in CONTROL_PLANE_KINDS:
            self.control_plane_fault(plan, fault, result, commits, deadline)
        else:
            raise ValueError(f"no way to inject {fault.kind}")

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

    def remove_checkpoint_dir(self, plan: JobPlan, fault: PlannedFault, result: FaultResult,
                              commits: dict[int, float], deadline: float) -> float:
        """Remove the job's newest checkpoint directory of step `fault.step` or later, whether
        it is still being written or committed already (`rm -rf` under the running job), and
        forget its commit: what was lost beyond the last commit counts from the one before."""
        name = plan.name

        def newest() -> Path | None:
            directory = self.job_dir(name)
            return newest_checkpoint_dir(directory, fault.step) if directory else None

        victim: Path = self.wait_until(f"a checkpoint directory of step {fault.step} or later",
                                       deadline, newest, commits, name)
        committed = (victim / "manifest.json").exists()
        at = time.time()
        remove_tree(victim)
        step = step_of(victim.name)
        assert step is not None
        commits.pop(step, None)
        result.detail.update(removed=victim.name, removed_step=step, removed_committed=committed)
        return at

    def control_plane_fault(self, plan: JobPlan, fault: PlannedFault, result: FaultResult,
                            commits: dict[int, float], deadline: float) -> None:
        """Stop kube-apiserver for `--apiserver-down-seconds`, restart etcd, or reset the
        operator's connections to kube-apiserver; then wait until the job's status has caught
        up with the training done meanwhile (status.step at least rank 0's step when the server
        came back)."""
        control = self.cluster.control_plane
        before = self.status(plan.name)
        result.detail["restarts_before"] = restarts_total(before)
        result.detail["status_step_before"] = before.get("step")
        result.injected_at = time.time()
        if fault.kind == "apiserver-stop":
            control.stop_server("kube-apiserver")
            back_at = result.injected_at + self.args.apiserver_down_seconds
            while time.time() < back_at:
                self.note_commits(plan.name, commits)
                time.sleep(0.2)
            control.start_server("kube-apiserver")
        elif fault.kind == "etcd-restart":
            control.stop_server("etcd")
            control.start_server("etcd")
            wait_for_ready(control, "kube-apiserver", 90.0)
        else:
            result.detail["connections_reset"] = self.reset_operator_connections()
        back = time.time()
        result.detail["outage_seconds"] = round(back - result.injected_at, 2)
        steps = [r.step for r in self.records(plan.name)]
        target = max(steps, default=0)
        result.detail["trainer_step_at_return"] = target
        until = min(deadline, time.monotonic() + CATCH_UP_TIMEOUT)
        while time.monotonic() < until:
            self.note_commits(plan.name, commits)
            try:
                status = self.status(plan.name)
            except Exception:  # the API server still warming up
                status = None
            if status is not None and (int(status.get("step") or 0) >= target or status.get(
                    "state") in ("Succeeded", "Failed")):
                result.detail["status_step_at_catch_up"] = status.get("step")
                result.detail["status_caught_up_seconds"] = round(time.time() - back, 3)
                return
            time.sleep(0.2)

    def reset_operator_connections(self) -> int:
        """Reset (`ss -K`: the kernel aborts them, both ends see a reset) every TCP connection
        of the operator's process to kube-apiserver; how many there were. Needs root (or
        CAP_NET_ADMIN) and a kernel with CONFIG_INET_DIAG_DESTROY."""
        assert self.operator is not None
        port = self.cluster.control_plane.api_port
        connections = [c for c in process_tcp_connections(self.operator.process.pid)
                       if c[3] == port]
        if not connections:
            raise RuntimeError("the operator has no connection to kube-apiserver")
        for local_ip, local_port, remote_ip, remote_port in connections:
            subprocess.run(["ss", "-K", "-tn", "src", f"{local_ip}:{local_port}", "dst",
                            f"{remote_ip}:{remote_port}"], capture_output=True, check=True)
        return len(connections)

    def wait_for_recovery(self, plan: JobPlan, result: FaultResult, commits: dict[int, float],
                          deadline: float) -> None:
        """Until a new attempt completed a step after the fault, or the job ended (a fault that
        needed no restart: `analyse_fault` calls it absorbed). A storage fault: until the job
        committed a checkpoint of a later step; a control-plane fault: not at all (its status
        caught up in `control_plane_fault`; `Campaign.run_job` adds the job's end through
        `control_plane_outcome`)."""
        assert result.injected_at is not None
        injected = result.injected_at
        if result.kind in CHECKPOINT_KINDS:
            self.wait_for_later_commit(plan, result, commits, deadline)
            return
        if result.kind in CONTROL_PLANE_KINDS:
            return
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

    def wait_for_later_commit(self, plan: JobPlan, result: FaultResult,
                              commits: dict[int, float], deadline: float) -> None:
        assert result.injected_at is not None
        injected = result.injected_at
        hit = int(result.detail.get("removed_step", result.step))

        def later() -> bool:
            return any(step > hit and at > injected for step, at in commits.items())

        try:
            self.wait_until(f"a commit after step {hit}", deadline, later, commits, plan.name)
        except TimeoutError:
            self.note_commits(plan.name, commits)
            if not later():
                raise

    def after(self, fault: PlannedFault, result: FaultResult) -> None:
        if fault.kind == "node-partition" and "node" in result.detail:
            self.cluster.nodes.heal_node(result.detail["node"])
        if fault.kind in CONTROL_PLANE_KINDS:
            # A fault cut short, or a server that did not outlive the outage: every server back
            # (in start order: etcd first), and said.
            control = self.cluster.control_plane
            for process in list(control.processes):
                if not process.alive():
                    result.detail.setdefault("servers_started_after", []).append(process.name)
                    control.start_server(process.name)
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


def control_plane_outcome(result: FaultResult, final: dict[str, Any]) -> None:
    """What a control-plane fault's recovery reads of the job's end (`final`: its status once
    it Succeeded or Failed): the final state and status.restarts.total then."""
    result.detail["final_state"] = final.get("state")
    result.detail["restarts_after"] = restarts_total(final)


def restarts_total(status: dict[str, Any]) -> int | None:
    total = (status.get("restarts") or {}).get("total")
    return int(total) if total is not None else None


def wait_for_ready(control: Any, server: str, timeout: float) -> None:
    """Until a control-plane server answers its readiness check again (the harness's)."""
    limit = time.monotonic() + timeout
    while not control.is_ready(server):
        if time.monotonic() > limit:
            raise TimeoutError(f"{server} not ready {timeout:g} s after the fault")
        time.sleep(0.2)


def remove_tree(path: Path) -> None:
    """`rm -rf` of a directory that writers may still be adding files to."""
    for _ in range(10):
        try:
            shutil.rmtree(path)
            return
        except FileNotFoundError:
            return
        except OSError:  # a file appeared while it was being emptied: again
            time.sleep(0.05)
    shutil.rmtree(path, ignore_errors=True)


def parse_proc_net_tcp(text: str) -> dict[int, tuple[str, int, str, int]]:
    """`/proc/<pid>/net/tcp` (IPv4): socket inode -> (local ip, local port, remote ip, remote
    port) of every established connection (state 01)."""
    found: dict[int, tuple[str, int, str, int]] = {}
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10 or fields[3] != "01":
            continue
        local, remote = (_address(field) for field in fields[1:3])
        found[int(fields[9])] = (*local, *remote)
    return found


def _address(field: str) -> tuple[str, int]:
    """`0100007F:1F90` -> ("127.0.0.1", 8080): the address's bytes are in host (little-endian)
    order."""
    ip, port = field.split(":")
    octets = bytes.fromhex(ip)[::-1]
    return ".".join(str(o) for o in octets), int(port, 16)


def process_tcp_connections(pid: int) -> list[tuple[str, int, str, int]]:
    """The established IPv4 TCP connections of a process: its socket inodes
    (`/proc/<pid>/fd`), looked up in `/proc/<pid>/net/tcp`."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:["):-1]))
    table = parse_proc_net_tcp(Path(f"/proc/{pid}/net/tcp").read_text())
    return [table[inode] for inode in sorted(inodes) if inode in table]
