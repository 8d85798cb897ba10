"""Recovery time on Kubernetes: kill one trainer pod of a running job and time the way back.

Starts the local cluster (real etcd, kube-apiserver, controller-manager, scheduler, three
process-backed nodes; tests/harness), runs the operator (`python -m rtj_operator`) as a
subprocess, and for each restart strategy applies a job shaped like examples/cpu-tiny.yaml
(2 nodes x 2 ranks of the tiny CPU trainer under ft_launcher, no injected faults). Once the job
has trained `--kill-step` steps, every process of pod `<job>-1` gets SIGKILL (the harness's
`kill_pod`, like a node losing the pod). Measured from the kill:

- the first completed step of the next training attempt (rank 0's `losses.jsonl` on the shared
  checkpoint volume: exact), and when the step the job was at when killed is completed again;
- `status.step` first exceeding the step at the kill (polled every 0.5 s through the API);
- the incident the operator records (`status.incidents[]`: detected / acted / recovered,
  whole-second timestamps) and the pods it replaced.

`RankRestart+spare` runs the job with `faultTolerance.spares: 1` (and in-process restart on, which
spares need) and kills pod 1 once the spare is ready: the spare's ranks take over pod 1's in the
running processes (NVRx in-process restart), no pod is waited for. `RankRestart` replaces only
the killed pod; the surviving pod's ft_launcher restarts its workers and waits in the rendezvous
for the replacement. `FullRestart` deletes and recreates every pod: what plain Kubernetes gives a
job (the seed's baseline, minus its CrashLoopBackOff delays).

    python -m bench.operator_recovery --out results/operator-recovery.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from .common import (
    OPERATOR_SOURCES,
    TRAINER_SOURCES,
    StampedLine,
    add_output_arguments,
    describe_spread,
    format_spread,
    format_table,
    source_fingerprint,
    write_json,
)
from .kubejobs import (
    example_job,
    job_dir,
    job_status,
    result_header,
    start_operator,
)
from .localrun import (
    Resume,
    StepRecord,
    analyse_recovery,
    group_attempts,
    parse_launcher_events,
    parse_timelines,
    parse_wrapper_events,
    read_losses,
)

SPARE = "RankRestart+spare"
STRATEGIES = (SPARE, "RankRestart", "FullRestart")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.operator_recovery", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategies", default=",".join(STRATEGIES),
                        help=f"comma-separated restart strategies (default {','.join(STRATEGIES)})")
    parser.add_argument("--repeats", type=int, default=1, help="jobs per strategy (default 1)")
    parser.add_argument("--steps", type=int, default=200, help="job length in steps (default 200)")
    parser.add_argument("--kill-step", type=int, default=35,
                        help="kill pod 1 once rank 0 completed this step (default 35)")
    parser.add_argument("--checkpoint-interval", type=int, default=10,
                        help="checkpoint.intervalSteps (default 10)")
    parser.add_argument("--inprocess-restart", choices=("Enabled", "Disabled"),
                        default="Disabled",
                        help="faultTolerance.inProcessRestart of the RankRestart and FullRestart "
                             "jobs (default Disabled: without a spare a lost pod cannot be "
                             "recovered in-process); the RankRestart+spare job always enables it")
    parser.add_argument("--reconcile-interval", type=float, default=None,
                        help="RTJ_OPERATOR_RECONCILE_INTERVAL_SECONDS (default: the operator's)")
    parser.add_argument("--job-timeout", type=float, default=600.0,
                        help="give up on one job after this many seconds (default 600)")
    add_output_arguments(parser, work_dir_help="cluster run directory (default: a new temp dir)")
    args = parser.parse_args(argv)
    unknown = [s for s in args.strategies.split(",") if s and s not in STRATEGIES]
    if unknown:
        parser.error(f"unknown strategy: {', '.join(unknown)}")
    return args


def job_manifest(
    name: str, strategy: str, steps: int, interval: int, inprocess: str = "Disabled"
) -> dict[str, Any]:
    """examples/cpu-tiny.yaml without faults, with the step count and strategy given."""
    manifest = example_job(name, steps, interval)
    spec = manifest["spec"]
    spec["faultTolerance"]["restartStrategy"] = "RankRestart" if strategy == SPARE else strategy
    spec["faultTolerance"]["inProcessRestart"] = "Enabled" if strategy == SPARE else inprocess
    if strategy == SPARE:
        spec["faultTolerance"]["spares"] = 1
    spec["faultTolerance"]["fullRestartBudget"] = {"max": 3, "windowSeconds": 3600}
    spec["faultTolerance"]["rankRestartBudget"] = {"max": 3, "windowSeconds": 3600}
    return manifest


def parse_time(text: str | None) -> float | None:
    if not text:
        return None
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class JobRun:
    """One job on the cluster: apply, kill pod 1 at the kill step, watch the recovery."""

    def __init__(self, cluster: Any, namespace: str, name: str, strategy: str,
                 args: argparse.Namespace, operator_log: Path | None = None) -> None:
        self.cluster = cluster
        self.operator_log = operator_log
        self.namespace = namespace
        self.name = name
        self.strategy = strategy
        self.args = args

    def status(self) -> dict[str, Any]:
        return job_status(self.cluster, self.namespace, self.name)

    def trainer_pods(self) -> dict[str, dict[str, Any]]:
        listed = self.cluster.api.get(
            f"/api/v1/namespaces/{self.namespace}/pods",
            labelSelector=f"training.resilient.dev/job={self.name},"
                          "training.resilient.dev/role=trainer")
        return {p["metadata"]["name"]: p for p in listed["items"]}

    def records(self) -> list[StepRecord]:
        """Rank 0's completed steps so far (`losses.jsonl` on the shared volume)."""
        directory = job_dir(self.cluster, self.namespace, self.name)
        return read_losses(directory / "losses.jsonl") if directory else []

    def pod_log_lines(self) -> list[StampedLine]:
        lines = []
        for path in sorted((Path(self.cluster.run_dir) / "pods").glob(
                f"{self.namespace}_{self.name}-*.log")):
            lines += [StampedLine(0.0, text)
                      for text in path.read_text(errors="replace").splitlines()]
        return lines

    def operator_told_at(self, after: float) -> float | None:
        """When the operator told the job's other pods that a pod failed (its log line, stamped
        on arrival), the first time after `after`."""
        log = self.operator_log
        if log is None or not log.exists():
            return None
        marker = f"/{self.name}: pod {self.name}-"
        for text in log.read_text(errors="replace").splitlines():
            stamp, _, rest = text.partition(" ")
            if marker in rest and " told " in rest:
                try:
                    at = float(stamp)
                except ValueError:
                    continue
                if at > after:
                    return at
        return None

    def run(self) -> dict[str, Any]:
        args = self.args
        manifest = job_manifest(self.name, self.strategy, args.steps, args.checkpoint_interval,
                                args.inprocess_restart)
        self.cluster.kubectl("apply", "--server-side", "-n", self.namespace, "-f", "-",
                             input=json.dumps(manifest))
        applied_at = time.time()
        deadline = time.monotonic() + args.job_timeout
        result: dict[str, Any] = {"job": self.name, "strategy": self.strategy,
                                  "applied_at": applied_at}
        records = self.train_to_kill_step(result, deadline)
        if not records:
            return result
        result["first_step_after_apply_seconds"] = round(
            min(r.at for r in records) - applied_at, 3)
        before = {n: p["metadata"]["uid"] for n, p in self.trainer_pods().items()}
        step_at_kill = max(r.step for r in records)
        kill_at = self.kill_pod_1(result, step_at_kill)
        final, step_advanced_at = self.watch_to_end(step_at_kill, deadline)
        self.analyse(result, final, step_at_kill, kill_at, step_advanced_at)
        after = {n: p["metadata"]["uid"] for n, p in self.trainer_pods().items()}
        result["pods_replaced"] = sorted(n for n, uid in before.items() if after.get(n) != uid)
        return result

    def train_to_kill_step(self, result: dict[str, Any], deadline: float) -> list[StepRecord]:
        """1. Train until the kill step (and, with a spare, until the spare is ready): rank 0's
        records so far, or none (with `error` in `result`) when the job never got there."""
        kill_step = self.args.kill_step
        records: list[StepRecord] = []
        while time.monotonic() < deadline:
            records = self.records()
            spare_ready = self.strategy != SPARE or (
                (self.status().get("spares") or {}).get("ready", 0) >= 1)
            if records and max(r.step for r in records) >= kill_step and spare_ready:
                break
            if self.status().get("state") in ("Failed", "Succeeded"):
                break
            time.sleep(0.2)
        else:
            result["error"] = f"the job never reached step {kill_step}"
            return []
        if not records or max(r.step for r in records) < kill_step:
            result["error"] = f"job ended before step {kill_step}: {self.status()}"
            return []
        return records

    def kill_pod_1(self, result: dict[str, Any], step_at_kill: int) -> float:
        """2. Kill every process of pod 1; returns when."""
        kill_at = time.time()
        self.cluster.nodes.kill_pod(self.namespace, f"{self.name}-1", 9)
        result.update(kill_at=kill_at, kill_call_seconds=round(time.time() - kill_at, 3),
                      step_at_kill=step_at_kill)
        return kill_at

    def watch_to_end(self, step_at_kill: int,
                     deadline: float) -> tuple[dict[str, Any], float | None]:
        """3. Watch status.step until the job finishes: its last status, and when status.step
        first passed the step at the kill."""
        status_step_advanced_at = None
        final: dict[str, Any] = {}
        while time.monotonic() < deadline:
            final = self.status()
            step = final.get("step")
            if status_step_advanced_at is None and isinstance(step, int) and step > step_at_kill:
                status_step_advanced_at = time.time()
            if final.get("state") in ("Succeeded", "Failed"):
                break
            time.sleep(0.5)
        return final, status_step_advanced_at

    def analyse(self, result: dict[str, Any], final: dict[str, Any], step_at_kill: int,
                kill_at: float, status_step_advanced_at: float | None) -> None:
        """4. The recovery from the losses and the pods' logs, and the operator's incident."""
        result["final_state"] = final.get("state")
        result["final_step"] = final.get("step")
        result["restarts"] = final.get("restarts")
        result["goodput"] = final.get("goodput")
        records = self.records()
        lines = self.pod_log_lines()
        timelines = parse_timelines(lines)
        wrapper = parse_wrapper_events(lines)
        recovery = analyse_recovery(
            f"step{step_at_kill + 1}-pod1-kill", kill_at,
            events=parse_launcher_events(lines),
            inprocess_detections=wrapper["detected"],
            resumes=resumes_from_timelines(timelines, kill_at), records=records,
            timelines=timelines, inprocess_restarts=wrapper["reassigned"])
        result["recovery"] = recovery.as_dict()
        told = self.operator_told_at(kill_at)
        result["peers_told_after_kill_seconds"] = (
            round(told - kill_at, 3) if told is not None else None)
        result["attempts"] = [a.identity for a in group_attempts(records)]
        result["status_step_advanced_seconds"] = (
            round(status_step_advanced_at - kill_at, 3) if status_step_advanced_at else None)
        incidents = [i for i in final.get("incidents") or []
                     if (parse_time(i.get("detectedTime")) or 0) >= kill_at - 2]
        result["incidents"] = incidents
        incident = operator_incident(incidents, kill_at)
        if incident:
            result["incident"] = incident


def operator_incident(incidents: list[dict[str, Any]], kill_at: float) -> dict[str, Any] | None:
    """The operator's own incident for the kill (its action, and its moments after the kill)."""
    found = next((i for i in incidents
                  if i.get("action") in ("SpareTakeover", "RankRestart", "FullRestart")), None)
    if not found:
        return None
    return {
        "cause": found.get("cause"),
        "action": found.get("action"),
        **{f"{key}_after_kill_seconds": (round(t - kill_at, 1) if t else None)
           for key, t in (("detected", parse_time(found.get("detectedTime"))),
                          ("acted", parse_time(found.get("actedTime"))),
                          ("recovered", parse_time(found.get("recoveredTime"))))},
        "seconds": found.get("seconds"),
    }


def resumes_from_timelines(timelines: list[tuple[int, dict[str, float]]],
                           after: float) -> list[Resume]:
    """The moment the first attempt after `after` had its checkpoint loaded on every rank (the
    latest `state_loaded` of the ranks' timelines): the pods' logs carry no arrival times."""
    loaded = [marks["state_loaded"] for _, marks in timelines
              if marks.get("attempt", 0.0) > after and "state_loaded" in marks]
    return [Resume(max(loaded), "", -1)] if loaded else []


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def pick(*keys: str) -> list[float | None]:
        values = []
        for run in runs:
            value: Any = run
            for key in keys:
                value = value.get(key) if isinstance(value, dict) else None
            values.append(value if isinstance(value, (int, float)) else None)
        return values

    return {
        "kill_to_next_step": describe_spread(pick("recovery", "total_seconds")),
        "kill_to_killed_step_again": describe_spread(
            pick("recovery", "back_to_fault_step_seconds")),
        "kill_to_status_step": describe_spread(pick("status_step_advanced_seconds")),
        "peers_told": describe_spread(pick("peers_told_after_kill_seconds")),
        **{f"phase_{name}": describe_spread(pick("recovery", "phases", name))
           for name in ("detect", "restart", "init", "load", "first_step")},
        "incident_detected": describe_spread(pick("incident", "detected_after_kill_seconds")),
        "incident_acted": describe_spread(pick("incident", "acted_after_kill_seconds")),
        "incident_recovered": describe_spread(pick("incident", "recovered_after_kill_seconds")),
        "incident_seconds": describe_spread(pick("incident", "seconds")),
        "succeeded": sum(1 for r in runs if r.get("final_state") == "Succeeded"),
        "runs": len(runs),
        "pods_replaced": sorted({", ".join(r.get("pods_replaced", [])) for r in runs}),
    }


def render(results: dict[str, Any]) -> str:
    header = ["strategy", "pods replaced", "kill → next step", "kill → killed step again",
              "kill → status.step", "peers told", "incident detected", "acted", "recovered",
              "incident seconds", "succeeded"]
    phases = ("detect", "restart", "init", "load", "first_step")
    rows, phase_rows = [], []
    for strategy, data in results["strategies"].items():
        agg = data["aggregate"]
        rows.append([
            strategy, " / ".join(agg["pods_replaced"]) or "-",
            format_spread(agg["kill_to_next_step"]),
            format_spread(agg["kill_to_killed_step_again"]),
            format_spread(agg["kill_to_status_step"]), format_spread(agg.get("peers_told", {})),
            format_spread(agg["incident_detected"]), format_spread(agg["incident_acted"]),
            format_spread(agg["incident_recovered"]), format_spread(agg["incident_seconds"]),
            f"{agg['succeeded']}/{agg['runs']}",
        ])
        phase_rows.append([strategy, *(format_spread(agg.get(f"phase_{name}", {}))
                                       for name in phases),
                           format_spread(agg["kill_to_next_step"])])
    return "\n".join([
        "Kubernetes: SIGKILL of every process of trainer pod 1 (seconds after the kill; "
        "incident times have 1 s resolution):",
        "",
        format_table(header, rows),
        "",
        "Phases (seconds; see bench/localrun.py PHASES):",
        "",
        format_table(["strategy", *phases, "total"], phase_rows),
    ])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from harness.cluster import Cluster

    work_dir = (args.work_dir or Path(tempfile.mkdtemp(prefix="rtj-bench-operator."))).resolve()
    work_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {**result_header("operator_recovery", argv, args), "strategies": {}}
    sources = source_fingerprint(*OPERATOR_SOURCES, *TRAINER_SOURCES)
    results["operator_and_trainer_source"] = sources
    began = time.monotonic()
    cluster = Cluster.start(work_dir / "cluster", nodes=3)
    results["cluster_start_seconds"] = round(time.monotonic() - began, 1)
    operator = None
    try:
        operator_log = work_dir / "operator.log"
        operator = start_operator(cluster, operator_log, args.reconcile_interval)
        namespace = cluster.create_namespace("bench")
        for strategy in [s for s in args.strategies.split(",") if s]:
            runs = []
            for repeat in range(args.repeats):
                name = f"bench-{strategy.lower().replace('+', '-')}-{repeat}"
                result = JobRun(cluster, namespace, name, strategy, args, operator_log).run()
                print(f"[bench.operator_recovery] {name}: state={result.get('final_state')} "
                      f"kill→next step={result.get('recovery', {}).get('total_seconds')} s "
                      f"incident={result.get('incident')} error={result.get('error')}",
                      flush=True)
                runs.append(result)
                cluster.kubectl("delete", "rtj", name, "-n", namespace, "--wait=false",
                                check=False)
            results["strategies"][strategy] = {"aggregate": aggregate(runs), "runs": runs}
    finally:
        if operator is not None:
            operator.stop()
        cluster.stop()
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    results["sources_changed_during_run"] = (
        source_fingerprint(*OPERATOR_SOURCES, *TRAINER_SOURCES) != sources)
    if results["sources_changed_during_run"]:
        print("WARNING: operator/trainer sources changed during the run", flush=True)
    results["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    write_json(args.out, results)
    print(render(results))
    if args.out:
        print(f"\nJSON: {args.out}")
    return 0 if all(s["aggregate"]["succeeded"] == s["aggregate"]["runs"]
                    for s in results["strategies"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
