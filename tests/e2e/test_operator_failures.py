"""Failures the operator handles, proven end to end on the local cluster (issue 11, "Prove it"):
each test injects one kind of failure into a variant of examples/cpu-tiny.yaml (2 nodes x 2 CPU
workers) and checks what a user sees: the job's status, the trainers' own summary, and a final
loss equal, bit for bit, to a fault-free run's (one reference run per step count, shared by the
tests of a session).

- four worker deaths in a row, more than `launcherMaxRestarts`, stay inside the pods (review C4);
- the operator SIGKILLed in the middle of a recovery: the recovery completes, counted once;
- a pod lost after training finished on every rank: the job Succeeded, nothing replaced;
- the rendezvous pod lost: a full restart from the last commit;
- a stalled step is flagged although the operator restarts more often than the progress timeout
  (review C8);
- full restarts in a row back off (a rendezvous store that cannot start), and the job starts once
  the cause has passed.
"""

from __future__ import annotations

import itertools
import re
import socket
import time
from datetime import datetime
from typing import TYPE_CHECKING, Any

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

STEPS = 60
OPERATOR_ACTIONS = ("RankRestart", "FullRestart", "Fail")
_REFERENCE_LOSS: dict[int, float] = {}


def fault_free_loss(cluster: Cluster, ns: str, operator: OperatorProcess,
                    steps: int = STEPS) -> float:
    """The final loss of the same job without faults (run once per step count and session)."""
    if steps not in _REFERENCE_LOSS:
        name = "plain"
        # One job at a time: every job's rendezvous store listens on the same port.
        wait_for("the previous job's rendezvous pod to be gone",
                 lambda: not pods_by_role(cluster, ns, "rendezvous"), timeout=60)
        apply(cluster, ns, cpu_tiny(name, steps=steps, faults=None))
        finish(cluster, ns, name, operator)
        assert status(cluster, ns, name)["state"] == "Succeeded", describe(
            cluster, ns, name, operator)
        _REFERENCE_LOSS[steps] = summary(cluster, ns, f"{name}-0")["final_loss"]
    return _REFERENCE_LOSS[steps]


def paced(manifest: dict[str, Any]) -> dict[str, Any]:
    """At least 0.5 s a step (rtj_trainer's `train.min_step_seconds`; the losses do not change):
    a fault injected after the commit of step 20 hits training, not its end, on a fast host too
    (2026-12-04: unpaced, 60 steps took 11 s and a kill at "step 20" came after the last step)."""
    manifest["spec"]["args"] += ["--set", "train.min_step_seconds=0.5"]
    return manifest


def finish(cluster: Cluster, ns: str, name: str, operator: OperatorProcess,
           timeout: float = 300) -> dict[str, Any]:
    wait_for(f"job {name} to finish", lambda: status(cluster, ns, name).get("state")
             in ("Succeeded", "Failed"), timeout=timeout, interval=1,
             context=lambda: describe(cluster, ns, name, operator))
    return status(cluster, ns, name)


def committed(cluster: Cluster, ns: str, name: str, operator: OperatorProcess,
              step: int) -> dict[str, Any]:
    return wait_for(f"a committed checkpoint at step {step} or later", lambda: (
        s if ((s := status(cluster, ns, name)).get("lastCheckpoint") or {}).get("step", 0)
        >= step else None), timeout=240, interval=0.5,
        context=lambda: describe(cluster, ns, name, operator))


def operator_incidents(final: dict[str, Any]) -> list[dict[str, Any]]:
    return [i for i in final.get("incidents", []) if i.get("action") in OPERATOR_ACTIONS]


def resumed_steps(cluster: Cluster, ns: str, pod: str) -> list[int]:
    return [int(s) for s in re.findall(r"resumed from \S+ \(step (\d+)\)",
                                       cluster.pod_log(ns, pod))]


@pytest.mark.long
def test_four_worker_deaths_beyond_launcher_max_restarts_stay_inside_the_pods(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """Review C4: each worker death makes every launcher restart its workers; four of them, one
    more than `launcherMaxRestarts: 3`, must not exhaust the launchers and escalate to the
    operator (old code: the fourth makes every launcher exit, a mass PodFailed)."""
    ns, name = namespace, "ladder"
    manifest = cpu_tiny(name, steps=STEPS,
                        faults="12:1:sigkill,22:2:sigkill,32:3:sigkill,42:0:sigkill")
    ft = manifest["spec"]["faultTolerance"]
    assert ft["launcherMaxRestarts"] == 3
    apply(cluster, ns, manifest)
    before = wait_for("both trainer pods", lambda: (
        p if len(p := pods_by_role(cluster, ns, "trainer")) == 2 else None),
        timeout=120, context=lambda: describe(cluster, ns, name, operator))
    uids = {n: p["metadata"]["uid"] for n, p in before.items()}

    final = finish(cluster, ns, name, operator)
    context = describe(cluster, ns, name, operator)
    assert final["state"] == "Succeeded", context
    assert final["step"] == STEPS
    done = summary(cluster, ns, f"{name}-0")
    # The trainers' own count: four launcher restarts, no pod ever replaced.
    assert done["restarts"]["launcher"] == 4 and not done["restarts"].get("pod"), done
    assert final["restarts"]["rank"] == 0 and final["restarts"]["full"] == 0, context
    assert operator_incidents(final) == [], context
    after = {n: p["metadata"]["uid"] for n, p in pods_by_role(cluster, ns, "trainer").items()}
    assert after == uids
    assert done["final_loss"] == fault_free_loss(cluster, ns, operator)


@pytest.mark.long
def test_an_operator_killed_mid_recovery_completes_it_once(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns, name = namespace, "orphan"
    apply(cluster, ns, paced(cpu_tiny(name, steps=STEPS, faults=None)))
    committed(cluster, ns, name, operator, 20)
    victim = f"/api/v1/namespaces/{ns}/pods/{name}-1"
    uid = cluster.api.get(victim)["metadata"]["uid"]

    cluster.nodes.kill_pod(ns, f"{name}-1")  # SIGKILL every process of pod 1

    def acted() -> str | None:
        pod = cluster.api.get_or_none(victim)
        if pod is None:
            return "deleted"
        if pod["metadata"]["uid"] != uid:
            return "replaced"
        return "deleting" if pod["metadata"].get("deletionTimestamp") else None

    seen = wait_for("the operator to act on the failed pod", acted, timeout=60, interval=0.05,
                    context=lambda: describe(cluster, ns, name, operator))
    operator.kill()  # no shutdown, no last status patch
    mid = status(cluster, ns, name)
    operator.start()

    final = finish(cluster, ns, name, operator)
    context = f"acted: {seen}; status when killed: {mid}\n" + describe(cluster, ns, name, operator)
    assert final["state"] == "Succeeded", context
    assert final["step"] == STEPS
    # One fault, one recovery, counted once: incident, budget record and counter.
    incidents = operator_incidents(final)
    assert [(i["action"], i["nodeIndex"]) for i in incidents] == [("RankRestart", 1)], context
    assert incidents[0]["recoveredTime"], context
    assert final["restarts"]["rank"] == 1 and final["restarts"]["full"] == 0, context
    assert len(final["restartRecords"]["rank"]) == 1, context
    assert not final["restartRecords"].get("full"), context
    rank1 = next(r for r in final["ranks"] if r["nodeIndex"] == 1)
    assert rank1["attempt"] == 1, context
    assert summary(cluster, ns, f"{name}-0")["final_loss"] == fault_free_loss(
        cluster, ns, operator)


@pytest.mark.long
def test_a_pod_lost_after_training_finished_ends_the_job_succeeded_without_a_replacement(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """Found by the operator-kill drill on a fast host (2026-12-04): pod 1 was killed while pod
    0 waited in torchelastic's exit barrier, training done on every rank and the final
    checkpoint committed. The operator replaced pod 1; the replacement waited for a launcher
    round nobody else would join, missed its heartbeats, and was replaced again and again: the
    job never ended. Here rank 2 (pod 1) stalls 60 s on its way out, after the final commit, so
    pod 0 reports `finished` while pod 1 still runs; then pod 1 is killed. (In-process restart
    off: its completion barrier would hold pod 0's workers until rank 2 is out.)"""
    ns, name = namespace, "lastpod"
    manifest = cpu_tiny(name, steps=STEPS, faults=f"{STEPS + 1}:2:stall=60")
    manifest["spec"]["faultTolerance"]["inProcessRestart"] = "Disabled"
    apply(cluster, ns, manifest)
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731

    def pod0_finished() -> bool:
        ranks = status(cluster, ns, name).get("ranks", [])
        return any(r["nodeIndex"] == 0 and r["state"] == "Succeeded" for r in ranks)

    wait_for("pod 0 to report that its training finished", pod0_finished, timeout=240,
             interval=0.5, context=context)
    victim = cluster.api.get(f"/api/v1/namespaces/{ns}/pods/{name}-1")
    assert victim["status"]["phase"] == "Running", context()
    cluster.nodes.kill_pod(ns, f"{name}-1")  # SIGKILL every process of pod 1

    final = finish(cluster, ns, name, operator, timeout=60)
    text = context()
    assert final["state"] == "Succeeded", text
    assert f"pod {name}-1 failed (exit code 137)" in final["message"], text
    assert final["step"] == STEPS and final["lastCheckpoint"]["step"] == STEPS, text
    assert operator_incidents(final) == [], text
    assert final["restarts"]["rank"] == 0 and final["restarts"]["full"] == 0, text
    after = cluster.api.get_or_none(f"/api/v1/namespaces/{ns}/pods/{name}-1")
    assert after is None or after["metadata"]["uid"] == victim["metadata"]["uid"], text
    assert summary(cluster, ns, f"{name}-0")["final_loss"] == fault_free_loss(
        cluster, ns, operator)


@pytest.mark.long
def test_a_lost_rendezvous_pod_restarts_the_job_from_its_last_commit(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns, name = namespace, "rdzv"
    apply(cluster, ns, paced(cpu_tiny(name, steps=STEPS, faults=None)))
    at_kill = committed(cluster, ns, name, operator, 20)["lastCheckpoint"]["step"]
    trainers = {n: p["metadata"]["uid"] for n, p in pods_by_role(cluster, ns, "trainer").items()}

    cluster.nodes.kill_pod(ns, f"{name}-rdzv")  # SIGKILL the rendezvous store

    final = finish(cluster, ns, name, operator)
    context = describe(cluster, ns, name, operator)
    assert final["state"] == "Succeeded", context
    assert final["step"] == STEPS
    incidents = operator_incidents(final)
    assert [(i["cause"], i["action"]) for i in incidents] == [
        ("RendezvousLost", "FullRestart")], context
    assert final["restarts"]["full"] == 1 and final["restarts"]["rank"] == 0, context
    # Every trainer pod was recreated, and the new attempt resumed from the last commit.
    end = pods_by_role(cluster, ns, "trainer")
    assert all(end[n]["metadata"]["uid"] != trainers[n] for n in trainers)
    resumed = resumed_steps(cluster, ns, f"{name}-0")
    assert resumed and resumed[0] >= at_kill, cluster.pod_log(ns, f"{name}-0")[-3000:]
    assert summary(cluster, ns, f"{name}-0")["final_loss"] == fault_free_loss(
        cluster, ns, operator)


@pytest.mark.long
def test_a_stalled_step_is_flagged_although_the_operator_restarts_faster_than_the_timeout(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """Review C8. Heartbeats flow but the step stands still: every checkpoint write hangs
    (the trainer's `checkpoint.test_write_delay_seconds`, a storage stall), so at the second
    save each rank waits for its first write and sends keepalive heartbeats meanwhile. The
    operator is SIGKILLed and started again more often than `progressTimeoutSeconds`; the
    stall is flagged all the same (old code: the clock lived in memory and restarted with it)."""
    ns, name = namespace, "stall"
    timeout = 20
    manifest = cpu_tiny(name, steps=10_000, faults=None)
    manifest["spec"]["args"] += ["--set", "checkpoint.test_write_delay_seconds=100000"]
    manifest["spec"]["faultTolerance"]["progressTimeoutSeconds"] = timeout
    apply(cluster, ns, manifest)

    def context() -> str:
        return describe(cluster, ns, name, operator)

    stalled = wait_for("the job to stall at step 20 with a progress clock", lambda: (
        s if (s := status(cluster, ns, name)).get("step") == 20
        and (s.get("progressClock") or {}).get("step") == 20 else None),
        timeout=240, interval=0.5, context=context)
    assert all(r["state"] == "Running" for r in stalled["ranks"]), stalled

    def flagged() -> dict[str, Any] | None:
        return next((i for i in status(cluster, ns, name).get("incidents", [])
                     if i["cause"] == "ProgressTimeout"), None)

    starts = [time.monotonic()]
    deadline = starts[0] + 4 * timeout + 30
    incident = None
    while incident is None and time.monotonic() < deadline:
        time.sleep(timeout / 3)
        incident = flagged()
        operator.kill()
        operator.start()
        starts.append(time.monotonic())
    incident = incident or flagged()
    assert incident is not None, (
        f"no ProgressTimeout in {time.monotonic() - starts[0]:.0f} s "
        f"({operator.starts} operator starts)\n{context()}")
    lifetimes = [b - a for a, b in itertools.pairwise(starts)]
    assert len(lifetimes) >= 2 and max(lifetimes) < timeout, lifetimes
    assert "step 20 has not advanced" in incident["message"], incident
    assert incident["action"] == "FullRestart", incident
    # The stalled pods would take their whole grace period to go: end the job at once.
    cluster.kubectl("delete", "rtj", name, "-n", ns, "--wait=false")
    cluster.kubectl("delete", "pods", "-n", ns, "-l", f"training.resilient.dev/job={name}",
                    "--grace-period=0", "--force", "--wait=false", check=False)


@pytest.mark.long
def test_full_restarts_in_a_row_back_off_and_the_job_starts_once_the_cause_passes(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """A rendezvous store that dies at every start (here its port is held, as the frozen
    process of a force-deleted rendezvous pod held it in the fault campaign) is a FullRestart
    each time. From the second in a row on, the pods start again only after a back-off: 10 s,
    then 20 s (recovery.full_restart_backoff); before it, the job spent its whole full-restart
    budget within a couple of minutes. Once the port is free the job starts, recovers and
    finishes with the fault-free loss."""
    ns, name = namespace, "backoff"
    steps = 20
    manifest = cpu_tiny(name, steps=steps, faults=None)
    manifest["spec"]["faultTolerance"]["fullRestartBudget"] = {"max": 6, "windowSeconds": 3600}
    reference = fault_free_loss(cluster, ns, operator, steps)
    wait_for("the reference job's rendezvous pod to be gone",
             lambda: not pods_by_role(cluster, ns, "rendezvous"), timeout=60)

    def context() -> str:
        return describe(cluster, ns, name, operator)

    def full_restarts() -> list[dict[str, Any]]:
        return [i for i in status(cluster, ns, name).get("incidents", [])
                if i.get("action") == "FullRestart"]

    holder = socket.socket()
    messages: set[str] = set()
    try:
        holder.bind(("127.0.0.1", int(operator.env["RTJ_OPERATOR_RENDEZVOUS_PORT"])))
        holder.listen()
        apply(cluster, ns, manifest)

        def four() -> list[dict[str, Any]] | None:
            messages.add(str(status(cluster, ns, name).get("message", "")))
            found = full_restarts()
            return found if len(found) >= 4 else None

        held = wait_for("four full restarts while the rendezvous port is held", four,
                        timeout=240, interval=0.5, context=context)
    finally:
        holder.close()

    final = finish(cluster, ns, name, operator)
    assert final["state"] == "Succeeded", context()
    assert final["step"] == steps, final
    acted = [datetime.fromisoformat(i["actedTime"].replace("Z", "+00:00")) for i in held]
    gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(acted)]
    # Times in status are whole seconds: a 10 s back-off shows as at least 9 s.
    assert gaps[1] >= 9 and gaps[2] >= 19, (gaps, context())
    assert all(i["cause"] == "RendezvousLost" for i in held), held
    backoffs = [e["message"] for e in events(cluster, ns, "FullRestartBackOff")]
    assert any("2 full restarts in a row" in m and "in 10 s" in m for m in backoffs), backoffs
    assert any("3 full restarts in a row" in m and "in 20 s" in m for m in backoffs), backoffs
    assert any("the pods start again at" in m for m in messages), messages
    # The streak ended with the start: every full restart of it is closed as recovered.
    closed = [i for i in final.get("incidents", []) if i.get("action") == "FullRestart"]
    assert final["restarts"]["full"] == len(closed) >= 4, final
    assert closed[-1].get("recoveredTime"), closed
    assert summary(cluster, ns, f"{name}-0")["final_loss"] == reference
