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
  (`GET /ranks` on RTJ_METRICS_PORT - 1, rtj_trainer.launcher.podmetrics's JSON), reporting its
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
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from .asyncapi import Api
from .common import StampedProcess, machine_description, write_json
from .kubejobs import GROUP_PATH, operator_ports, start_operator
from .scale_faults import Faults, wait_running
from .scale_measure import Sampler, StatusWatch, operator_metrics, percentile, request_total, spread
from .simnodes import Simulator, register_nodes

# The parts: simnodes (the simulated nodes and ranks, and why they are not the harness's
# kubelet), asyncapi (the simulator's API client), scale_faults (the faults and what came of
# them), scale_measure (the status watch, CPU and RSS, the operator's and apiserver's counters).
# This module: the command line, the jobs, and the run in its phases.

HEARTBEAT_TIMEOUT = 10
INITIAL_HEARTBEAT_TIMEOUT = 10
HANG_THRESHOLD = HEARTBEAT_TIMEOUT + INITIAL_HEARTBEAT_TIMEOUT
DETECTION_SLACK = 2.0
"""Issue 12: a hang detected within heartbeatTimeoutSeconds + 2 s (p99)."""
KILL_TARGET = 5.0
"""Issue 12: a pod loss acted on within 5 s."""


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


@dataclass
class Window:
    """The measured window: when it began, how long it was, and what it cost."""

    t0: float
    """Its start (time.monotonic())."""
    load_before: tuple[float, float, float]
    wall: float = 0.0
    stale_events: int = 0
    """HeartbeatStale Events in the namespace at the end."""
    internals: dict[str, Any] = field(default_factory=dict)
    """The operator's own counters at the end (scale_measure.operator_metrics)."""
    requests: float = 0.0
    """API requests in the window (apiserver_request_total), the simulator's included."""
    sim_requests: int = 0
    sim_cpu: float = 0.0
    """CPU seconds of this process (the simulator) in the window."""


class ScaleRun:
    """One run, phase by phase: the API server, the simulated cluster with the operator, the jobs,
    the measured window, the result."""

    def __init__(self, args: argparse.Namespace) -> None:
        from harness.cluster import Cluster
        from harness.controlplane import ControlPlane, ensure_binaries

        self.args = args
        self.work = (args.work_dir or Path(tempfile.mkdtemp(prefix="rtj-bench-scale."))).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        self.control_plane = ControlPlane(ensure_binaries(), self.work)
        self.cluster = Cluster(self.work, self.control_plane.bin_dir, self.control_plane)
        self.operator: StampedProcess | None = None
        self.api: Api | None = None
        self.tasks: list[asyncio.Task[Any]] = []
        self.ports = operator_ports()

    def background(self, coroutine: Any) -> None:
        self.tasks.append(asyncio.ensure_future(coroutine))

    async def start_cluster(self) -> None:
        """etcd and kube-apiserver only (tests/harness), the CRDs, the Nodes, the namespace."""
        from harness.cluster import CRD_DIR

        self.control_plane.start_storage_and_api()
        self.cluster.apply_crds(CRD_DIR)
        self.api = Api(self.control_plane.server, self.control_plane.pki)
        total_nodes = self.args.jobs * self.args.nodes + 2
        self.node_names = [f"sim-p5-{i:05d}" for i in range(total_nodes)]
        await asyncio.to_thread(register_nodes, self.cluster.api, self.node_names)
        self.namespace = await asyncio.to_thread(self.cluster.create_namespace, "scale")

    async def start_simulation(self) -> None:
        """The simulated kubelet, the real operator, the CPU samplers and the status watch."""
        assert self.api is not None
        self.sim = Simulator(self.api, self.node_names, self.args.procs_per_node)
        self.background(self.sim.kubelet())
        self.operator = await asyncio.to_thread(
            start_operator, self.cluster, self.work / "operator.log",
            self.args.reconcile_interval, self.ports)
        assert self.operator is not None
        self.sampler = Sampler(self.operator.process.pid)
        self.background(self.sampler.run())
        apiserver_pid = next(p.pid for p in self.control_plane.processes
                             if p.name == "kube-apiserver")
        self.api_sampler = Sampler(apiserver_pid)
        self.background(self.api_sampler.run())
        self.watch = StatusWatch(self.api, self.namespace)
        self.background(self.watch.run())

    async def create_jobs(self) -> float:
        """The jobs, `--stagger-seconds` apart: seconds until every one is Running."""
        assert self.api is not None
        args = self.args
        created = time.monotonic()
        for j in range(args.jobs):
            if j:
                await asyncio.sleep(args.stagger_seconds)
            await self.api.call(
                "POST", f"{GROUP_PATH}/namespaces/{self.namespace}/resilienttrainingjobs",
                job_manifest(f"job-{j:03d}", args.nodes, args.procs_per_node),
                ok=(409,))  # a retried create that had gone through
        created = time.monotonic() - created
        startup = await wait_running(self.api, self.namespace, args.jobs,
                                     args.start_timeout) + created
        print(f"[bench.scale] every job Running after {startup:.1f} s", flush=True)
        await asyncio.sleep(5)
        return startup

    async def measure(self) -> Window:
        """The measured window: `--minutes` of faults, and what the window cost besides them."""
        assert self.api is not None
        window = Window(t0=time.monotonic(), load_before=os.getloadavg())
        sim_cpu0 = time.process_time()
        requests0 = await request_total(self.api)
        sim_requests0 = self.api.requests
        self.faults = Faults(self.api, self.sim, self.watch, self.namespace, self.args.jobs,
                             random.Random(self.args.seed), HANG_THRESHOLD)
        await self.faults.run(window.t0 + self.args.minutes * 60)
        window.wall = time.monotonic() - window.t0
        stale = await self.api.call("GET", f"/api/v1/namespaces/{self.namespace}/events"
                                           "?fieldSelector=reason%3DHeartbeatStale")
        window.stale_events = len(stale.get("items") or [])
        try:
            window.internals = await operator_metrics(
                int(self.ports["RTJ_OPERATOR_METRICS_PORT"]))
        except (OSError, aiohttp.ClientError, TimeoutError) as error:
            window.internals = {"error": str(error)}
        window.requests = await request_total(self.api) - requests0
        window.sim_requests = self.api.requests - sim_requests0
        window.sim_cpu = time.process_time() - sim_cpu0
        return window

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        if self.operator is not None:
            self.operator.stop()
        if self.api is not None:
            await self.api.close()
        self.control_plane.stop()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    bench = ScaleRun(args)
    try:
        await bench.start_cluster()
        await bench.start_simulation()
        startup = await bench.create_jobs()
        window = await bench.measure()
        return result(args, startup, window, bench.faults, bench.sampler.summary(window.t0),
                      bench.api_sampler.summary(window.t0), bench.work)
    finally:
        await bench.stop()


def result(args: argparse.Namespace, startup: float, window: Window, faults: Faults,
           operator_usage: dict[str, Any], apiserver_usage: dict[str, Any],
           work: Path) -> dict[str, Any]:
    """The JSON result: the faults' latencies, false positives and misses against issue 12's
    targets, and what the operator, the apiserver and the simulator cost."""
    wall = window.wall
    hangs, kills, detections = faults.hangs, faults.kills, faults.hang_detections
    total_pods = args.jobs * args.nodes
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
        "hang_to_unresponsive_seconds": spread(detections),
        "hang_to_unresponsive_past_heartbeat_timeout_seconds": spread(
            [h - HEARTBEAT_TIMEOUT for h in detections]),
        "hang_to_pod_deleted_seconds": spread(hangs),
        "hang_to_pod_deleted_past_threshold_seconds": spread([h - HANG_THRESHOLD for h in hangs]),
        "kill_to_pod_deleted_seconds": spread(kills),
        "missed_detections": faults.misses,
        "false_positives": len(faults.false_positives) + len(faults.false_detections),
        "false_positive_deletions": faults.false_positives[:20],
        "false_positive_detections": faults.false_detections[:20],
        "heartbeat_stale_events": window.stale_events,
        "observation_degraded_jobs": sorted(faults.degraded_seen),
        "targets": targets(faults, operator_usage),
        "operator": operator_usage,
        "operator_internals": window.internals,
        "kube_apiserver": apiserver_usage,
        "api_requests_per_second": round(window.requests / wall, 1),
        "simulator_api_requests_per_second": round(window.sim_requests / wall, 1),
        "operator_api_requests_per_second_estimate": round(
            (window.requests - window.sim_requests) / wall, 1),
        "simulator_cores_average": round(window.sim_cpu / wall, 3),
        "load_average_before": [round(x, 2) for x in window.load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
        "machine": machine_description(),
        "work_dir": str(work),
    }


def targets(faults: Faults, operator_usage: dict[str, Any]) -> dict[str, Any]:
    """The result against issue 12's targets."""
    hangs, kills, detections = faults.hangs, faults.kills, faults.hang_detections
    hang_excess = [h - HANG_THRESHOLD for h in hangs]
    return {
        "hang_detected_p99_within_seconds": HEARTBEAT_TIMEOUT + DETECTION_SLACK,
        "hang_detected_met": bool(detections) and (
            percentile(detections, 99) or 0) <= HEARTBEAT_TIMEOUT + DETECTION_SLACK,
        "hang_acted_p99_within_seconds_of_threshold": DETECTION_SLACK,
        "hang_acted_met": bool(hangs) and (percentile(hang_excess, 99) or 0) <= DETECTION_SLACK,
        "kill_acted_p99_within_seconds": KILL_TARGET,
        "kill_acted_met": bool(kills) and (percentile(kills, 99) or 0) <= KILL_TARGET,
        "no_false_positives": not faults.false_positives and not faults.false_detections,
        "operator_cores_average_at_most": 1.0,
        "operator_rss_mib_at_most": 1024,
        "operator_met": (operator_usage.get("cores_average", 99) <= 1.0
                         and operator_usage.get("rss_mib_max", 1e9) <= 1024),
    }


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
