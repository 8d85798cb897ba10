"""The operator over a long run with many jobs and recurring faults (issue 31's soak): `--jobs`
jobs of a team's own script (examples/byo/train_fsdp2.py: NVRx heartbeats, one step every
`--step-seconds`; light on this 2-core machine, while the operator does for each job what it does
for any: scrapes, passes, status writes) run on the local cluster for `--minutes` once all of them
are Running. Every `--fault-every` seconds one job's pod 1 is SIGKILLed (the jobs in turn), which
the operator answers with a RankRestart. Every `--sample-seconds` the benchmark records:

- the operator's RSS and CPU (its process, psutil);
- its Kubernetes API requests (`rtj_operator_api_requests_total`, its own client: passes, node
  list; not kopf's watches and Events), as requests per job per minute over the interval;
- how many jobs are Running.

The result: RSS growth (mean of the last fifth of the samples against the first fifth), API
requests per job per minute (first third against last third), CPU, every fault recovered (each
job's `restarts.rank` and `PodFailed` incidents equal its faults, the job Running at the end) and
anything else the jobs recorded (other incidents, `HeartbeatStale` Events: false alarms). With
`--png`, two stacked panels over time (x: seconds since the first sample): operator RSS in MiB
(blue), API requests per job per minute (orange); red lines mark the faults.

    python -m bench.soak --jobs 10 --minutes 30 --fault-every 120 \\
        --out bench/results/soak.json --png docs/soak.png
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from . import pngplot
from .byo_soak import job as byo_job
from .common import write_json
from .kubejobs import operator_ports, result_header, start_operator


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=10)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--fault-every", type=float, default=120.0,
                        help="seconds between two pod kills (0: no faults)")
    parser.add_argument("--sample-seconds", type=float, default=30.0)
    parser.add_argument("--step-seconds", type=float, default=1.0)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.minutes <= 0 or args.sample_seconds <= 0 or args.fault_every < 0:
        parser.error("--jobs >= 1, --minutes > 0, --sample-seconds > 0, --fault-every >= 0")
    return args


def soak_job(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """The BYO soak's job (2 pods x 1 worker), named, with a rank budget its faults fit in."""
    settings = argparse.Namespace(minutes=args.minutes + 30, procs=1,
                                  step_seconds=args.step_seconds, heartbeat_timeout=30,
                                  initial_timeout=180)
    body = byo_job(settings)
    faults = (int(args.minutes * 60 / args.fault_every / args.jobs) + 1
              if args.fault_every else 0)
    body["spec"]["faultTolerance"]["rankRestartBudget"] = {"max": faults + 2,
                                                         "windowSeconds": 3600}
    body["metadata"] = {"name": name}
    return body


def jobs_now(cluster: Any, namespace: str) -> dict[str, dict[str, Any]]:
    items = json.loads(cluster.kubectl("get", "rtj", "-n", namespace, "-o", "json").stdout)
    return {item["metadata"]["name"]: item.get("status") or {} for item in items["items"]}


def api_requests(metrics_port: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.decode().splitlines()
               if line.startswith("rtj_operator_api_requests_total{"))


def summarize(samples: list[dict[str, Any]], jobs: int) -> dict[str, Any]:
    """RSS growth, API requests per job per minute, CPU, from the samples (pure)."""
    if len(samples) < 5:
        return {"error": f"only {len(samples)} samples"}
    fifth = max(1, len(samples) // 5)
    rss_first = sum(s["rss_mib"] for s in samples[:fifth]) / fifth
    rss_last = sum(s["rss_mib"] for s in samples[-fifth:]) / fifth
    rates = [(b["api_requests"] - a["api_requests"]) / ((b["t"] - a["t"]) / 60) / jobs
             for a, b in itertools.pairwise(samples)]
    third = max(1, len(rates) // 3)
    cores = (samples[-1]["cpu_seconds"] - samples[0]["cpu_seconds"]) / (
        samples[-1]["t"] - samples[0]["t"])
    return {
        "samples": len(samples),
        "rss_mib_first_fifth": round(rss_first, 1),
        "rss_mib_last_fifth": round(rss_last, 1),
        "rss_growth_percent": round(100 * (rss_last - rss_first) / rss_first, 1),
        "rss_mib_max": round(max(s["rss_mib"] for s in samples), 1),
        "api_requests_per_job_minute_first_third": round(sum(rates[:third]) / third, 2),
        "api_requests_per_job_minute_last_third": round(sum(rates[-third:]) / third, 2),
        "api_requests_per_job_minute": [round(r, 2) for r in rates],
        "operator_cores_average": round(cores, 3),
    }


def recovered(statuses: dict[str, dict[str, Any]], faults: list[dict[str, Any]],
              stale_events: dict[str, int]) -> dict[str, Any]:
    """Each job: its faults, its RankRestarts and PodFailed incidents, its state, and what else
    it recorded (pure)."""
    per_job: dict[str, Any] = {}
    for name, status in sorted(statuses.items()):
        injected = sum(f["job"] == name for f in faults)
        incidents = status.get("incidents") or []
        pod_failed = sum(i.get("cause") == "PodFailed" for i in incidents)
        per_job[name] = {
            "faults": injected, "state": status.get("state"),
            "rank_restarts": (status.get("restarts") or {}).get("rank", 0),
            "pod_failed_incidents": pod_failed,
            "other_incidents": [i.get("cause") for i in incidents if i.get("cause") != "PodFailed"],
            "heartbeat_stale_events": stale_events.get(name, 0),
        }
    every = all(j["state"] == "Running" and j["rank_restarts"] == j["faults"] ==
                j["pod_failed_incidents"] for j in per_job.values())
    false_alarms = sum(len(j["other_incidents"]) + j["heartbeat_stale_events"]
                       for j in per_job.values())
    return {"jobs": per_job, "faults_injected": len(faults), "every_fault_recovered": every,
            "false_alarms": false_alarms}


def create_jobs(args: argparse.Namespace, cluster: Any, namespace: str, work_dir: Path,
                names: list[str]) -> tuple[Any, dict[str, str]]:
    """Create the jobs, each under an operator started with a rendezvous port of its own, and
    return the operator that then watches them all (with its ports). The harness's pods share
    this machine's network namespace and nvrx-control listens on every address, so two jobs'
    rendezvous pods on one port would clash here (not in a cluster, where each pod has its own
    network); a job keeps the port of its rendezvous Service whatever the operator says later
    (docs/operator.md), so each job is created under an operator with another port."""
    for number, name in enumerate(names):
        ports = operator_ports()
        operator = start_operator(cluster, work_dir / f"operator-setup-{number}.log", None, ports)
        try:
            cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", "-",
                            input=json.dumps(soak_job(args, name)))
            deadline = time.monotonic() + 120
            while cluster.kubectl("get", "service", f"{name}-rdzv", "-n", namespace,
                                  check=False).returncode != 0:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the operator did not create {name}-rdzv in 120 s")
                time.sleep(1)
        finally:
            operator.stop()
    ports = operator_ports()
    return start_operator(cluster, work_dir / "operator.log", None, ports), ports


def run(args: argparse.Namespace, cluster: Any, namespace: str,
        operator: Any, ports: dict[str, str]) -> dict[str, Any]:
    names = [f"soak-{i}" for i in range(args.jobs)]
    deadline = time.monotonic() + 600
    while sum(s.get("state") == "Running" for s in jobs_now(cluster, namespace).values()) \
            < args.jobs:
        if time.monotonic() > deadline:
            states = {n: s.get("state") for n, s in jobs_now(cluster, namespace).items()}
            raise RuntimeError(f"not every job reached Running in 600 s: {states}")
        time.sleep(2)
    process = psutil.Process(operator.process.pid)
    start = time.monotonic()
    samples: list[dict[str, Any]] = []
    faults: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    next_sample = next_fault = start
    if args.fault_every:
        next_fault = start + args.fault_every
    while time.monotonic() - start < args.minutes * 60:
        now = time.monotonic()
        if now >= next_sample:
            cpu = process.cpu_times()
            states = jobs_now(cluster, namespace)
            samples.append({
                "t": round(now - start, 1), "rss_mib": round(process.memory_info().rss / 2**20, 1),
                "cpu_seconds": round(cpu.user + cpu.system, 2),
                "api_requests": api_requests(ports["RTJ_OPERATOR_METRICS_PORT"]),
                "running": sum(s.get("state") == "Running" for s in states.values())})
            next_sample += args.sample_seconds
        if args.fault_every and now >= next_fault:
            name = names[len(faults) % len(names)]
            try:  # only a pod whose processes run (not one still being replaced)
                cluster.nodes.kill_pod(namespace, f"{name}-1", 9)
            except Exception as error:  # the harness's "no harness pod": try again shortly
                skipped.append({"t": round(now - start, 1), "job": name, "why": str(error)})
                next_fault = now + 5
            else:
                faults.append({"t": round(now - start, 1), "job": name})
                next_fault += args.fault_every
        time.sleep(max(0.2, min(next_sample, next_fault if args.fault_every else next_sample)
                       - time.monotonic()))
    time.sleep(60)  # the last fault's recovery
    events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)
    stale: dict[str, int] = {}
    for event in events["items"]:
        if event.get("reason") == "HeartbeatStale":
            job = event.get("involvedObject", {}).get("name", "")
            stale[job] = stale.get(job, 0) + 1
    return {"samples": samples, "faults": faults, "faults_postponed": skipped,
            "summary": summarize(samples, args.jobs),
            "recovery": recovered(jobs_now(cluster, namespace), faults, stale)}


def plot(result: dict[str, Any], path: Path) -> dict[str, Any]:
    samples = result["samples"]
    rss = [(s["t"], s["rss_mib"]) for s in samples]
    rates = [(b["t"], r) for b, r in zip(samples[1:], result["summary"].get(
        "api_requests_per_job_minute", []), strict=False)]
    marks = [f["t"] for f in result["faults"]]
    panels = [pngplot.Panel([(rss, pngplot.BLUE)], marks),
              pngplot.Panel([(rates, pngplot.ORANGE)], marks)]
    x_range = (0.0, samples[-1]["t"] if samples else 1.0)
    pngplot.draw(panels, x_range, path)
    return {"png": str(path), "x_seconds": list(x_range),
            "rss_mib_axis": [0, panels[0].y_max()],
            "api_requests_per_job_minute_axis": [0, panels[1].y_max()]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from harness.cluster import Cluster

    work_dir = (args.work_dir or Path(tempfile.mkdtemp(prefix="rtj-bench-soak."))).resolve()
    results: dict[str, Any] = result_header("soak", argv, args)
    cluster = Cluster.start(work_dir / "cluster", nodes=2 * args.jobs + 1)
    operator = None
    try:
        namespace = cluster.create_namespace("soak")
        operator, ports = create_jobs(args, cluster, namespace, work_dir,
                                      [f"soak-{i}" for i in range(args.jobs)])
        results |= run(args, cluster, namespace, operator, ports)
        if args.png is not None and results["samples"]:
            results["plot"] = plot(results, args.png)
    finally:
        if operator is not None:
            operator.stop()
        cluster.stop()
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_json(args.out, results)
    print(json.dumps({"summary": results["summary"], "recovery": {
        k: v for k, v in results["recovery"].items() if k != "jobs"}}, indent=1))
    return 0 if results["recovery"]["every_fault_recovered"] else 1


if __name__ == "__main__":
    sys.exit(main())
