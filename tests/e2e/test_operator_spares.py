"""Warm spares end to end (issue 10): a job with `faultTolerance.spares: 1` on the local cluster
loses a trainer pod; the spare's ranks take over in place, the other pods' trainer processes keep
running (same PIDs), a replacement pod waits as the next spare, and training ends with the loss
of a fault-free run.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import pytest
from e2e.test_operator_jobs import (
    apply,
    cpu_tiny,
    describe,
    events,
    pods_by_role,
    status,
    summary,
    wait_for,
)
from harness.cluster import Cluster

if TYPE_CHECKING:
    from e2e.conftest import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STEPS = 120
STEP_SECONDS = 0.25
"""train.min_step_seconds of the spare jobs: 120 steps take at least 30 s, so that the kill falls
in the middle of training. A tiny CPU step takes a few milliseconds: in one CI run (2026-12-02)
the job finished, Succeeded, before the test saw it go 15 steps past the kill; most likely the
spare was reported ready, and the pod killed, too near the end."""


def trainer_pids(cluster: Cluster, ns: str, pod: str) -> set[int]:
    """PIDs of the pod's worker processes (children of its launcher running `rtj_trainer`)."""
    run = next(p for p in cluster.nodes.pods() if p["namespace"] == ns and p["name"] == pod)
    pids: set[int] = set()
    for procs in Path(run["cgroup"]).rglob("cgroup.procs"):
        for line in procs.read_text().split():
            try:
                process = psutil.Process(int(line))
                command = " ".join(process.cmdline())
                parent = " ".join(process.parent().cmdline()) if process.parent() else ""
            except (psutil.Error, ValueError):
                continue
            if "-m rtj_trainer " in f"{command} " and "rtj_trainer.launcher" in parent:
                pids.add(process.pid)
    return pids


def spare_job(name: str, *, spares: int, paced: bool = True) -> dict[str, Any]:
    manifest = cpu_tiny(name, steps=STEPS, faults=None)
    manifest["spec"]["faultTolerance"]["spares"] = spares
    if paced:  # a pause after each step (rtj_trainer.train.pace): the loss does not change
        manifest["spec"]["args"] += ["--set", f"train.min_step_seconds={STEP_SECONDS}"]
    # Six ranks' first step, while six checkpoint writers import torch, takes 10 s and more on a
    # 2-core host, beyond the in-process soft timeout (heartbeat timeout / 2 = 10 s): the product
    # defaults must not take it for a hang (the start-up allowance, rtj_trainer.resiliency).
    return manifest


def test_a_warm_spare_takes_over_a_lost_pod_and_the_others_keep_their_processes(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns, name = namespace, "spare"
    apply(cluster, ns, spare_job(name, spares=1))
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    ready = wait_for("a ready spare and a committed checkpoint", lambda: (
        s if (s := status(cluster, ns, name)).get("spares", {}).get("ready") == 1
        and (s.get("lastCheckpoint") or {}).get("step", 0) >= 20 else None),
        timeout=300, context=context)
    assert [r["state"] for r in ready["ranks"]] == ["Running", "Running", "Standby"]
    assert ready["nodes"] == "2/2"
    trainers = pods_by_role(cluster, ns, "trainer")
    assert sorted(trainers) == [f"{name}-0", f"{name}-1", f"{name}-2"]
    command = trainers[f"{name}-0"]["spec"]["containers"][0]["command"]
    assert command[:3] == ["python", "-m", "rtj_trainer.launcher"] and "--nnodes=3" in command
    before = {i: trainer_pids(cluster, ns, f"{name}-{i}") for i in (0, 2)}
    assert all(len(p) >= 2 for p in before.values()), before  # the workers (and their helpers)
    uid_1 = trainers[f"{name}-1"]["metadata"]["uid"]
    step_at_kill = ready.get("step") or 0
    assert step_at_kill <= STEPS - 30, f"the spare was ready only at step {step_at_kill}"

    cluster.nodes.kill_pod(ns, f"{name}-1")  # every process of pod 1, its launcher too

    taken = wait_for("the spare to take over", lambda: (
        s if (s := status(cluster, ns, name)).get("restarts", {}).get("spare") == 1 else None),
        timeout=120, context=context)
    # The survivors' in-process restart may be recorded (an incident of its own, with no node)
    # before this read: the takeover is found by its action, not by its place in the list.
    takeovers = [i for i in taken["incidents"] if i["action"] == "SpareTakeover"]
    assert [i.get("nodeIndex") for i in takeovers] == [1], taken["incidents"]
    assert taken["restarts"]["rank"] == 0 and taken["restarts"]["full"] == 0
    # Training goes on past the kill with the spare's ranks in pod 1's place ...
    wait_for("training to go on", lambda: (status(cluster, ns, name).get("step") or 0)
             >= step_at_kill + 15, timeout=180, context=context)
    # ... in the very same processes on pods 0 and 2,
    assert {i: trainer_pids(cluster, ns, f"{name}-{i}") for i in (0, 2)} == before
    # while a new pod 1 waits as the next spare.
    now = status(cluster, ns, name)
    assert now["spares"]["waiting"] == [1], now
    assert [r["state"] for r in now["ranks"]] == ["Running", "Standby", "Running"]
    replacement = pods_by_role(cluster, ns, "trainer")[f"{name}-1"]
    assert replacement["metadata"]["uid"] != uid_1
    assert replacement["metadata"]["labels"]["training.resilient.dev/attempt"] == "1"

    wait_for("the job to finish", lambda: status(cluster, ns, name).get("state")
             in ("Succeeded", "Failed"), timeout=400, interval=2, context=context)
    final = status(cluster, ns, name)
    assert final["state"] == "Succeeded", context()
    assert final["step"] == STEPS
    assert final["restarts"]["rank"] == 0 and final["restarts"]["full"] == 0
    takeover = next(i for i in final["incidents"] if i["action"] == "SpareTakeover")
    # Closed, and not before it was detected. Its seconds may round to 0: one clean-clone run
    # (2026-12-05, 8ab387d) recorded a takeover closed in the pass that made it, 0 s; why the
    # ranks counted Running at once there is not known yet.
    assert takeover["recoveredTime"] and takeover["seconds"] is not None
    assert takeover["recoveredTime"] >= takeover["detectedTime"] and takeover["seconds"] >= 0
    # After the takeover the survivors' launchers wait 5 s in the exit barrier at the end, their
    # workers gone: their pod endpoints say `finished`, which is no stale heartbeat (before
    # that mark, `make demo` showed HeartbeatStale and Pending there, 2026-12-03).
    recovered = datetime.fromisoformat(takeover["recoveredTime"])
    late_stale = [e["message"] for e in events(cluster, ns, "HeartbeatStale")
                  if datetime.fromisoformat(e.get("lastTimestamp") or e["eventTime"])
                  > recovered]
    assert late_stale == [], late_stale
    done = summary(cluster, ns, f"{name}-0")
    assert done["restarts"]["inprocess"] == 1 and done["restarts"]["launcher"] == 0

    # The same job without spares or faults ends with the same loss, bit for bit (unpaced: it
    # has no fault to place, and 30 s of pauses would only lengthen the test).
    apply(cluster, ns, spare_job("plain", spares=0, paced=False))
    wait_for("the fault-free job to finish", lambda: status(cluster, ns, "plain").get("state")
             in ("Succeeded", "Failed"), timeout=400, interval=2,
             context=lambda: describe(cluster, ns, "plain", operator))
    assert summary(cluster, ns, "plain-0")["final_loss"] == done["final_loss"]
