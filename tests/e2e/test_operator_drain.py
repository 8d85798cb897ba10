"""Checkpoint now, then stop (issue 14), for a node drain and a job's deletion, end to end: the
real control plane (the eviction API, the scheduler), process-backed nodes whose kubelet ends a
deleted pod with SIGTERM and SIGKILLs it after the grace period, the real trainer under
ft_launcher, and the operator as its own process (tests/e2e/conftest.py).

The cluster has three nodes and each job two trainer pods that take a whole node each, so one node
is free for a replacement. The drained node is uncordoned in a `finally`, so the session's
cluster stays usable. `kubectl drain` is limited to the job's pods (`--pod-selector`): the shared
test cluster may hold other tests' pods, and which pods a drain evicts changes nothing for ours.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from e2e.test_operator_jobs import (
    apply,
    checkpoint_dir,
    children,
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


def jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def last_state_until_gone(cluster: Cluster, ns: str, uid: str, since: str,
                          timeout: int) -> dict[str, Any]:
    """Watch the namespace's pods from resourceVersion `since` until the pod `uid` is deleted;
    return its trainer container's last `terminated` state (the deletion event carries it)."""
    last: dict[str, Any] = {}
    for event in cluster.api.watch(f"/api/v1/namespaces/{ns}/pods", since,
                                   timeout_seconds=timeout):
        pod = event.get("object") or {}
        if (pod.get("metadata") or {}).get("uid") != uid:
            continue
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (container.get("state") or {}).get("terminated")
            if container.get("name") == "trainer" and terminated:
                last = terminated
        if event.get("type") == "DELETED":
            return last
    pytest.fail(f"pod {uid} not deleted within {timeout} s")


def assert_no_step_lost_or_repeated(losses: list[dict[str, Any]], stopped_at: int,
                                    steps: int) -> None:
    """Every step once, in order; the step after the stop was trained by a new attempt."""
    assert [e["step"] for e in losses] == list(range(1, steps + 1))
    before = next(e for e in losses if e["step"] == stopped_at)
    after = next(e for e in losses if e["step"] == stopped_at + 1)
    assert before["attempt"] != after["attempt"], (before, after)


def test_a_drained_trainer_pod_checkpoints_its_step_and_the_job_resumes_from_it_elsewhere(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """Issue 14, node drain: `kubectl drain` evicts a trainer pod mid-run (no --force: the pods
    have a controller). Its trainers, and through the stop agreement every other rank, commit a
    checkpoint of the current step; the evicted pod ends at once with exit 0 (not killed at the
    end of its grace period), the operator replaces it on another node without spending a
    budget, training continues from exactly that step, the job succeeds, and status.lastStop
    records the stop."""
    ns, name, steps = namespace, "drain", 150
    apply(cluster, ns, cpu_tiny(name, steps=steps, faults=None))
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    wait_for("a committed checkpoint", lambda: (
        (status(cluster, ns, name).get("lastCheckpoint") or {}).get("step", 0) >= 20),
        timeout=300, context=context)
    trainers = pods_by_role(cluster, ns, "trainer")
    (rendezvous,) = pods_by_role(cluster, ns, "rendezvous").values()
    # A trainer pod alone on its node (the rendezvous pod's eviction is a unit-tier case).
    victim = next(n for n, p in sorted(trainers.items())
                  if p["spec"]["nodeName"] != rendezvous["spec"]["nodeName"])
    index = int(victim.rsplit("-", 1)[1])
    node = trainers[victim]["spec"]["nodeName"]
    since = cluster.api.get(f"/api/v1/namespaces/{ns}/pods")["metadata"]["resourceVersion"]
    drain = subprocess.Popen(
        ["kubectl", "drain", node, "--ignore-daemonsets", "--delete-emptydir-data",
         f"--pod-selector=training.resilient.dev/job={name}", "--timeout=120s"],
        env=cluster.env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        ended = last_state_until_gone(cluster, ns, trainers[victim]["metadata"]["uid"], since,
                                      timeout=120)
        out, _ = drain.communicate(timeout=60)
        assert drain.returncode == 0, out
        assert f"pod/{victim} evicted" in out and f"node/{node} drained" in out, out
        # The trainers stopped by themselves: exit 0 with the stop message, not 137 (SIGKILL).
        assert ended.get("exitCode") == 0, ended
        message = json.loads(ended["message"])
        assert message["outcome"] == "Stopped", message
        wait_for("the job to finish", lambda: status(cluster, ns, name).get("state")
                 in ("Succeeded", "Failed"), timeout=600, interval=2, context=context)
    finally:
        if drain.poll() is None:
            drain.kill()
            drain.communicate()
        cluster.uncordon_node(node)

    final = status(cluster, ns, name)
    assert final["state"] == "Succeeded", context()
    assert final["step"] == steps
    directory = checkpoint_dir(cluster, ns, f"{name}-checkpoints", name)
    losses = jsonl(directory / "losses.jsonl")
    first_attempt = losses[0]["attempt"]
    stopped_at = [e for e in losses if e["attempt"] == first_attempt][-1]["step"]
    assert 20 <= stopped_at < steps and message["committedStep"] == stopped_at
    assert stopped_at in [c["step"] for c in jsonl(directory / "commits.jsonl")]
    assert_no_step_lost_or_repeated(losses, stopped_at, steps)
    resumed = re.findall(r"resumed from (\S+) \(step (\d+)\)", cluster.pod_log(ns, f"{name}-0"))
    assert resumed and int(resumed[-1][1]) == stopped_at, resumed
    # Status records the stop, and the drain spent no budget.
    stop = final["lastStop"]
    assert stop["reason"] == "Evicted" and stop["step"] == stopped_at, stop
    assert stop["checkpoint"].endswith(resumed[-1][0]), (stop, resumed)
    assert f"pod {victim} was evicted from node {node}" in stop["message"]
    (incident,) = final["incidents"]
    assert (incident["cause"], incident["action"]) == ("PodEvicted", "Reschedule")
    assert incident["nodeIndex"] == index and incident["recoveredTime"]
    assert final["restarts"]["rank"] == 0 and final["restarts"]["full"] == 0
    assert not (final.get("restartRecords") or {}).get("rank")
    assert not final.get("excludedNodes")
    # ...nor a restart of the other pod's ft_launcher (its --max-restarts counts rounds).
    survivor = cluster.pod_log(ns, f"{name}-{1 - index}")
    assert "restarting the workers for a peer's stop (an eviction, not a fault): no restart " \
        "spent" in survivor, survivor[-3000:]
    # The replacement ran elsewhere (the drained node is cordoned), as attempt 1.
    rank = final["ranks"][index]
    assert rank["attempt"] == 1 and rank["node"] != node, rank
    said = [e["message"] for e in events(cluster, ns, "CheckpointedBeforeStop")]
    assert any(m.startswith(f"Evicted: checkpointed step {stopped_at}") for m in said), said
    # The trainers' own ledger: the attempt after the drain came up in a new pod.
    ended_with = summary(cluster, ns, f"{name}-0")
    assert ended_with["steps"] == steps
    assert ended_with["restarts"] == {"inprocess": 0, "launcher": 0, "pod": 1}


@pytest.mark.long
def test_a_deleted_job_commits_its_current_step_and_a_job_of_the_same_name_resumes_it(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """Issue 14, deletion: `kubectl delete rtj` deletes the pods with their grace period and
    returns once they are gone; their trainers committed a checkpoint of the step at deletion.
    A job applied again under the same name (its claim kept: claimDeletePolicy Retain; the
    checkpoint path defaults to <namespace>/<name>) resumes from exactly that step."""
    ns, name, steps = namespace, "again", 100
    manifest = cpu_tiny(name, steps=steps, faults=None)
    manifest["spec"]["checkpoint"]["claimDeletePolicy"] = "Retain"
    apply(cluster, ns, manifest)
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    wait_for("a committed checkpoint", lambda: (
        (status(cluster, ns, name).get("lastCheckpoint") or {}).get("step", 0) >= 20),
        timeout=300, context=context)

    began = time.monotonic()
    cluster.kubectl("delete", "rtj", name, "-n", ns, "--timeout=150s", timeout=180)
    waited = time.monotonic() - began
    # The job went only once its pods were gone: nothing but the kept claim is left.
    assert children(cluster, ns, name) == [f"persistentvolumeclaim/{name}-checkpoints"]
    directory = checkpoint_dir(cluster, ns, f"{name}-checkpoints", name)
    losses = jsonl(directory / "losses.jsonl")
    stopped_at = losses[-1]["step"]  # the last step trained before the deletion
    assert 20 <= stopped_at < steps
    assert jsonl(directory / "commits.jsonl")[-1]["step"] == stopped_at
    assert json.loads((directory / "job-state.json").read_text())["stopped_step"] == stopped_at
    said = [e["message"] for e in events(cluster, ns, "CheckpointedBeforeStop")]
    assert any(m.startswith(f"Deleted: checkpointed step {stopped_at}") for m in said), (
        said, f"deletion took {waited:.1f} s", operator.log()[-3000:])

    apply(cluster, ns, manifest)
    wait_for("the new job to finish", lambda: status(cluster, ns, name).get("state")
             in ("Succeeded", "Failed"), timeout=600, interval=2, context=context)
    final = status(cluster, ns, name)
    assert final["state"] == "Succeeded", context()
    assert final["step"] == steps
    resumed = re.findall(r"resumed from \S+ \(step (\d+)\)", cluster.pod_log(ns, f"{name}-0"))
    assert resumed and int(resumed[-1]) == stopped_at, cluster.pod_log(ns, f"{name}-0")[-3000:]
    assert_no_step_lost_or_repeated(jsonl(directory / "losses.jsonl"), stopped_at, steps)
    assert summary(cluster, ns, f"{name}-0")["restarts"] == {"inprocess": 0, "launcher": 0,
                                                             "pod": 0}  # a resume
