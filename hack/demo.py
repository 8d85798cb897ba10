#!/usr/bin/env python3
"""`make demo`: the main job end to end on an embedded default, with a readable summary.

It starts a throw-away local control plane (etcd, kube-apiserver, kube-controller-manager,
kube-scheduler) with three process-backed p5.48xlarge-like nodes, runs the operator, applies
examples/cpu-tiny-spares.yaml (2 nodes x 2 ranks of the tiny CPU trainer under ft_launcher plus
one warm spare pod, with the faults its TRAINER_FAULTS injects: the last one loses a whole pod,
which the spare takes over), prints `kubectl get rtj` whenever it changes, and at the end
prints what happened: state, steps, restarts by kind, incidents with their recovery seconds,
goodput, and the trainer's own summary line. Everything it started is stopped on the way out.

Options: --example FILE, --timeout SECONDS, --keep (leave the run directory for inspection).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from harness.cluster import Cluster  # noqa: E402


def say(msg: str) -> None:
    print(f"[demo {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def get_job(cluster: Cluster, ns: str, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "rtj", name, "-n", ns, "-o", "json", check=False)
    return json.loads(out.stdout) if out.returncode == 0 else {}


def trainer_summary(cluster: Cluster, ns: str, name: str) -> dict[str, Any] | None:
    """The trainer's summary JSON line (printed last by global rank 0), from any pod's log."""
    pods = cluster.kubectl("get", "pods", "-n", ns, "-l", f"training.resilient.dev/job={name}",
                           "-o", "jsonpath={.items[*].metadata.name}", check=False).stdout.split()
    for pod in sorted(pods):
        try:
            log = cluster.pod_log(ns, pod)
        except Exception:  # the log may be gone with a deleted pod
            continue
        for line in reversed(log.splitlines()):
            i = line.find('{"event": "summary"')
            if i >= 0:
                return json.loads(line[i:])  # type: ignore[no-any-return]
    return None


def print_summary(job: dict[str, Any], trainer: dict[str, Any] | None, wall: float) -> None:
    st = job.get("status", {})
    print("\n" + "=" * 78)
    print(f"Job {job['metadata']['name']}: {st.get('state', '?')}"
          f"  ({st.get('reason', '')}{': ' + st['message'] if st.get('message') else ''})")
    print(f"  steps completed      {st.get('step', '?')}")
    last = st.get("lastCheckpoint") or {}
    print(f"  last checkpoint      step {last.get('step', '-')} at {last.get('time', '-')}")
    r = st.get("restarts") or {}
    print(f"  restarts             total {r.get('total', 0)}: rank-pod {r.get('rank', 0)}, "
          f"full {r.get('full', 0)}, launcher {r.get('launcher', 0)}, "
          f"in-process {r.get('inProcess', 0)}, spare takeovers {r.get('spare') or 0}")
    spares = st.get("spares")
    if spares:
        print(f"  spares               {spares.get('ready', 0)}/{spares.get('desired', 0)} ready"
              + (f", pods {spares['waiting']} waiting for the next launcher round"
                 if spares.get("waiting") else ""))
    print(f"  goodput (operator)   {st.get('goodput', '-')}")
    print(f"  demo wall time       {wall:.0f} s")
    incidents = st.get("incidents") or []
    if incidents:
        print("  incidents:")
        print(f"    {'cause':<14}{'node':>5}{'rank':>6}  {'action':<18}{'detected':<22}"
              f"{'recovered s':>12}")
        for inc in incidents:
            secs = inc.get("seconds")
            print(f"    {inc.get('cause', ''):<14}{inc.get('nodeIndex', ''):>5}"
                  f"{inc.get('rank', '') if inc.get('rank') is not None else '':>6}  "
                  f"{inc.get('action', ''):<18}{inc.get('detectedTime', ''):<22}"
                  f"{'' if secs is None else f'{secs:.1f}':>12}")
    if trainer:
        print("  trainer summary (rank 0):")
        for k in ("steps", "final_loss", "wall_seconds", "productive_seconds", "goodput",
                  "restarts", "checkpoints_committed", "last_committed_step"):
            if k in trainer:
                print(f"    {k:<22}{trainer[k]}")
    print("=" * 78)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--example", default=str(ROOT / "examples" / "cpu-tiny-spares.yaml"))
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--keep", action="store_true")
    args = ap.parse_args()

    run_dir = Path(tempfile.mkdtemp(prefix="rtj-demo-"))
    say(f"run directory {run_dir} (logs of every component and pod)")
    t0 = time.monotonic()
    say("starting etcd, kube-apiserver, kube-controller-manager, kube-scheduler and 3 nodes")
    cluster = Cluster.start(run_dir, nodes=3)
    operator: subprocess.Popen[bytes] | None = None
    try:
        say(f"control plane ready in {time.monotonic() - t0:.0f} s")
        print(cluster.kubectl("get", "nodes", "-L", "node.kubernetes.io/instance-type").stdout)
        oplog = open(run_dir / "operator.log", "wb")  # noqa: SIM115 - closed by the process end
        operator = subprocess.Popen([sys.executable, "-m", "rtj_operator"], env=cluster.env(),
                                    stdout=oplog, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        say(f"operator started (log: {run_dir / 'operator.log'})")
        ns = "default"
        applied = cluster.kubectl("apply", "-n", ns, "-f", args.example)
        name = applied.stdout.split()[0].split("/")[-1]
        say(f"applied {args.example}: {applied.stdout.strip()}")
        start = time.monotonic()
        last_table = ""
        job: dict[str, Any] = {}
        while time.monotonic() - start < args.timeout:
            table = cluster.kubectl("get", "rtj", name, "-n", ns, check=False).stdout.strip()
            lines = table.splitlines()
            row = lines[-1].rsplit(None, 1)[0] if len(lines) > 1 else ""  # without AGE
            if row and row != last_table:
                if not last_table:
                    print("            " + lines[0])
                print(f"[{time.strftime('%H:%M:%S')}]  " + lines[-1], flush=True)
                last_table = row
            job = get_job(cluster, ns, name)
            if job.get("status", {}).get("state") in ("Succeeded", "Failed"):
                break
            if operator.poll() is not None:
                say(f"the operator exited with {operator.returncode}; see operator.log")
                break
            time.sleep(2)
        else:
            say(f"timed out after {args.timeout:.0f} s")
        print()
        events = cluster.kubectl("get", "events", "-n", ns, "--sort-by=.lastTimestamp",
                                 "--field-selector", f"involvedObject.name={name}",
                                 "-o", "custom-columns=TIME:.lastTimestamp,REASON:.reason,"
                                 "MESSAGE:.message", check=False).stdout
        print("Operator decisions (Events on the job):")
        print(events)
        print_summary(job, trainer_summary(cluster, ns, name), time.monotonic() - t0)
        ok = job.get("status", {}).get("state") == "Succeeded"
        return 0 if ok else 1
    finally:
        if operator and operator.poll() is None:
            os.killpg(operator.pid, signal.SIGTERM)
            try:
                operator.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(operator.pid, signal.SIGKILL)
        say("stopping the cluster")
        cluster.stop()
        if args.keep:
            say(f"kept {run_dir}")


if __name__ == "__main__":
    sys.exit(main())
