"""Checkpoint faults end to end (issue 11): commits that stop raise `CheckpointStale`, and a
job resumed at another world size fails at once with the trainer's own reason. The real
trainer under ft_launcher writes to the harness's shared volume (the FSx stand-in); the
operator runs as its own process (tests/e2e/conftest.py).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from e2e.test_operator_jobs import (
    apply,
    children,
    cpu_tiny,
    describe,
    events,
    status,
    wait_for,
)
from harness.cluster import Cluster

if TYPE_CHECKING:
    from e2e.conftest import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def condition(cluster: Cluster, ns: str, name: str, kind: str) -> dict[str, Any]:
    found: dict[str, Any] = next(
        (c for c in status(cluster, ns, name).get("conditions", []) if c["type"] == kind), {})
    return found


def committed_dirs(cluster: Cluster, ns: str) -> list[Path]:
    """The job's committed checkpoint folders on the shared volume (each has a manifest)."""
    return sorted(m.parent for m in cluster.shared_dir.glob(f"{ns}-*/**/step-*/manifest.json"))


@pytest.mark.long
def test_commits_that_stop_raise_checkpoint_stale_and_it_clears_when_they_catch_up(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """Pins review T1's missing alarm: a failed shard write left training going while nothing
    committed, and the only sign was a frozen `lastCheckpoint`. Here rank 1's shard writes fail
    for a stretch of checkpoints (a folder stands where its shard file must go, so the rename
    fails with an OS error as a broken volume would; the trainer gives those steps up, T1's
    fix). The operator raises `CheckpointStale` and a Warning Event once the step is more than
    `staleAfterIntervals` x `intervalSteps` past the newest commit, and clears it (Event
    `CheckpointCurrent`) once the writes succeed and a commit catches up."""
    ns, name = namespace, "stale"
    manifest = cpu_tiny(name, steps=2000, faults=None, interval_steps=10)
    manifest["spec"]["checkpoint"]["staleAfterIntervals"] = 2
    apply(cluster, ns, manifest)
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    wait_for("a committed checkpoint", lambda: committed_dirs(cluster, ns), timeout=240,
             context=context)
    newest = committed_dirs(cluster, ns)[-1]
    root, identity = newest.parent, newest.name.split(".", 1)[1]  # step-000000010.a1-l0-i0
    assert condition(cluster, ns, name, "CheckpointStale").get("status") == "False", context()
    step = status(cluster, ns, name).get("step") or 0
    # Rank 1's shard of each checkpoint from ~4 s ahead on, for 15 checkpoints (~150 steps).
    first = (step // 10 + 4) * 10
    blocked = [first + 10 * i for i in range(15)]
    for blocked_step in blocked:
        (root / f"step-{blocked_step:09d}.{identity}" / "shard-00001-of-00004.bin").mkdir(
            parents=True)

    stale = wait_for("CheckpointStale True", lambda: (
        c if (c := condition(cluster, ns, name, "CheckpointStale")).get("status") == "True"
        else None), timeout=180, context=context)
    assert stale["reason"] == "CheckpointStale", stale
    assert "past the newest committed checkpoint" in stale["message"], stale
    assert "staleAfterIntervals x intervalSteps = 2 x 10" in stale["message"], stale
    warning = events(cluster, ns, "CheckpointStale")
    assert warning and warning[0]["type"] == "Warning", warning
    assert status(cluster, ns, name)["state"] == "Running", context()  # no other action

    current = wait_for("CheckpointStale False again", lambda: (
        c if (c := condition(cluster, ns, name, "CheckpointStale")).get("status") == "False"
        else None), timeout=180, context=context)
    assert current["reason"] == "CheckpointCurrent", current
    assert (status(cluster, ns, name).get("lastCheckpoint") or {}).get("step", 0) > blocked[-1]
    assert events(cluster, ns, "CheckpointCurrent"), context()
    log = cluster.pod_log(ns, f"{name}-0")
    assert f"checkpoint of step {blocked[0]} will not be committed" in log, log[-3000:]


@pytest.mark.long
def test_resuming_at_another_world_size_fails_at_once_naming_both_sizes(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """Pins review T3: a job resumed with another `nodes` silently started again from step 0
    (every checkpoint rejected at the new world size). Now the trainer refuses to start
    (`WorldSizeChanged`, a fatal error) and the job ends `Failed`, reason `TrainerFatalError`,
    with a message naming both world sizes, without climbing the restart ladder."""
    ns, name = namespace, "resize"
    apply(cluster, ns, cpu_tiny(name, steps=2000, faults=None))
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    wait_for("a committed checkpoint", lambda: (
        (status(cluster, ns, name).get("lastCheckpoint") or {}).get("step", 0) >= 10),
        timeout=240, context=context)
    cluster.kubectl("patch", "rtj", name, "-n", ns, "--type=merge",
                    "-p", '{"spec": {"suspend": true}}')
    wait_for("every pod to be gone", lambda: not [
        c for c in children(cluster, ns, name) if c.startswith("pod/")],
        timeout=120, context=context)
    cluster.kubectl("patch", "rtj", name, "-n", ns, "--type=merge",
                    "-p", '{"spec": {"nodes": 1}}')
    began = time.monotonic()
    cluster.kubectl("patch", "rtj", name, "-n", ns, "--type=merge",
                    "-p", '{"spec": {"suspend": false}}')
    final = wait_for("the job to end", lambda: (
        s if (s := status(cluster, ns, name)).get("state") in ("Succeeded", "Failed") else None),
        timeout=180, interval=1, context=context)
    took = time.monotonic() - began

    assert final["state"] == "Failed", context()
    assert final["reason"] == "TrainerFatalError", context()
    message = final["message"]
    assert "WorldSizeChanged" in message, message
    assert "written by 4 ranks" in message and "this job has 2" in message, message
    assert final["restarts"]["rank"] == 0 and final["restarts"]["full"] == 0, context()
    assert final["restarts"]["launcher"] == 0, context()
    assert took < 120, f"took {took:.0f} s"
    assert events(cluster, ns, "TrainerFatalError"), context()
