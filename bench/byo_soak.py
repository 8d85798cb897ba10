"""False hangs of a team's own script over a long run: the script sends NVRx heartbeats and
nothing else of ours (examples/byo/train_fsdp2.py, docs/byo.md path 1), under the operator on the
local cluster, for `--minutes`, with no fault injected. Every false alarm is counted:

- `HeartbeatStale` Warning Events and `status.incidents` (a healthy job has none);
- ranks ever `Unresponsive` in `status.ranks`, nodes in `status.excludedNodes`, restarts;
- the `HangDetection` condition (True: its heartbeats are watched) at every poll.

The job trains `--step-seconds` a step across 2 pods x `--procs` workers, the heartbeat timeouts
of the job set low (`--heartbeat-timeout`, `--initial-timeout`) so that a false alarm has every
chance to happen.

    python -m bench.byo_soak --minutes 30 --out bench/results/byo-soak.json
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

from .common import REPO_ROOT, write_json
from .kubejobs import job_status, result_header, start_operator

SCRIPT = REPO_ROOT / "examples" / "byo" / "train_fsdp2.py"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.byo_soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--procs", type=int, default=1, help="workers per pod")
    parser.add_argument("--step-seconds", type=float, default=0.5)
    parser.add_argument("--heartbeat-timeout", type=int, default=15)
    parser.add_argument("--initial-timeout", type=int, default=60)
    parser.add_argument("--poll-seconds", type=float, default=5.0)
    parser.add_argument("--work-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    return parser.parse_args(argv)


def job(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = copy.deepcopy(yaml.safe_load(
        (REPO_ROOT / "examples" / "byo-script.yaml").read_text()))
    steps = int(args.minutes * 60 / args.step_seconds) + 10_000  # never ends in the window
    body["spec"].update(
        nodes=2, procsPerNode=args.procs, command=[sys.executable, str(SCRIPT)],
        args=["--steps", str(steps), "--step-seconds", str(args.step_seconds)],
        checkpoint={"storageClassName": "local-shared", "size": "1Gi"})
    body["spec"]["faultTolerance"].update(
        heartbeatTimeoutSeconds=args.heartbeat_timeout,
        initialHeartbeatTimeoutSeconds=args.initial_timeout)
    return body


def watch(cluster: Any, namespace: str, args: argparse.Namespace) -> dict[str, Any]:
    """Poll the job for `--minutes` after it first runs; what every poll saw, summed up."""
    seen: dict[str, Any] = {"polls": 0, "hang_detection_true": 0, "hang_detection_other": [],
                            "states": {},
                            "unresponsive_ranks": 0, "incidents": [], "excluded_nodes": [],
                            "restarts_total": 0}
    deadline = time.monotonic() + 300
    while job_status(cluster, namespace, "byo-soak").get("state") != "Running":
        if time.monotonic() > deadline:
            raise RuntimeError("the job did not reach Running in 300 s")
        time.sleep(1)
    started = time.monotonic()
    while time.monotonic() - started < args.minutes * 60:
        status = job_status(cluster, namespace, "byo-soak")
        seen["polls"] += 1
        state = str(status.get("state"))
        seen["states"][state] = seen["states"].get(state, 0) + 1
        hang = next((c for c in status.get("conditions", [])
                     if c["type"] == "HangDetection"), {})
        seen["hang_detection_true"] += hang.get("status") == "True"
        if hang.get("status") != "True":  # which polls, and what the condition said then
            seen["hang_detection_other"].append({
                "poll": seen["polls"], "seconds": round(time.monotonic() - started, 1),
                "status": hang.get("status"), "reason": hang.get("reason")})
        seen["unresponsive_ranks"] += sum(r.get("state") == "Unresponsive"
                                          for r in status.get("ranks", []))
        seen["incidents"] = status.get("incidents") or []
        seen["excluded_nodes"] = status.get("excludedNodes") or []
        seen["restarts_total"] = (status.get("restarts") or {}).get("total", 0)
        time.sleep(args.poll_seconds)
    seen["watched_seconds"] = round(time.monotonic() - started, 1)
    events = json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)
    seen["heartbeat_stale_events"] = sum(e.get("reason") == "HeartbeatStale"
                                         for e in events["items"])
    seen["false_hangs"] = (seen["heartbeat_stale_events"] + len(seen["incidents"])
                           + len(seen["excluded_nodes"]) + seen["restarts_total"])
    return seen


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from harness.cluster import Cluster

    work_dir = (args.work_dir or Path(tempfile.mkdtemp(prefix="rtj-bench-byo."))).resolve()
    results: dict[str, Any] = result_header("byo_soak", argv, args)
    cluster = Cluster.start(work_dir / "cluster", nodes=2)
    operator = None
    try:
        operator = start_operator(cluster, work_dir / "operator.log", None)
        namespace = cluster.create_namespace("bench")
        cluster.kubectl("apply", "--server-side", "-n", namespace, "-f", "-",
                        input=json.dumps(job(args) | {"metadata": {"name": "byo-soak"}}))
        results["watch"] = watch(cluster, namespace, args)
    finally:
        if operator is not None:
            operator.stop()
        cluster.stop()
    results["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write_json(args.out, results)
    print(json.dumps(results["watch"], indent=1))
    return 0 if results["watch"]["false_hangs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
