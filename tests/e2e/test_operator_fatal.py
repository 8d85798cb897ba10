"""Fatal trainer errors end the job, and the final status is the trainer's own (issue 11, items 7
and 8): the real trainer under the launcher shim, the harness kubelet's termination messages,
the operator as its own process (tests/e2e/conftest.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
from e2e.test_operator_jobs import (
    apply,
    cpu_tiny,
    describe,
    events,
    pods_by_role,
    status,
    wait_for,
)
from harness.cluster import Cluster
from rtj_wire import termination

if TYPE_CHECKING:
    from e2e.conftest import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_a_trainer_fatal_error_fails_the_job_at_once_with_the_trainers_reason(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    ns, name = namespace, "fatal"
    manifest = cpu_tiny(name, faults=None)
    # A configuration every restart would read again: memmap data without a path.
    manifest["spec"]["args"] += ["--set", "data.kind=memmap"]
    apply(cluster, ns, manifest)
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    final = wait_for("the job to end", lambda: (
        s if (s := status(cluster, ns, name)).get("state") in ("Succeeded", "Failed") else None),
        timeout=180, interval=1, context=context)

    assert final["state"] == "Failed", context()
    assert final["reason"] == "TrainerFatalError", context()
    assert "ConfigurationError" in final["message"] and "data.path" in final["message"]
    failed = next(c for c in final["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "TrainerFatalError"
    assert "data.path" in failed["message"]
    # No ladder: neither the launchers nor the operator restarted anything.
    assert final["restarts"]["rank"] == 0 and final["restarts"]["full"] == 0, context()
    assert final["restarts"]["launcher"] == 0, context()
    assert events(cluster, ns, "TrainerFatalError"), context()
    said = 0
    for pod in pods_by_role(cluster, ns, "trainer").values():
        terminated = pod["status"]["containerStatuses"][0]["state"].get("terminated")
        if terminated is None:  # stopped by the operator before it ended on its own
            continue
        assert terminated["exitCode"] == 93, terminated  # ft_launcher's "do not restart"
        outcome, _ = termination.parse(terminated.get("message"))
        if outcome is None:
            # Its launcher saw a peer's "do not restart" before its own workers failed (the
            # operator's SIGTERM reaches the launcher alone, which then ends 93 at its poll): no
            # worker wrote the file, and the message is empty or the log tail that
            # FallbackToLogsOnError puts there, which the operator ignores the same way.
            continue
        assert outcome.outcome == "Failed" and outcome.exit_code == 94, outcome
        assert outcome.reason == "ConfigurationError", outcome
        said += 1
    assert said >= 1, context()  # the trainer's own reason came from a termination message


@pytest.mark.long
def test_the_final_step_and_checkpoint_are_the_trainers_own(
    cluster: Cluster, namespace: str, operator: OperatorProcess
) -> None:
    """75 steps, a checkpoint every 10 and none at the end: the last scrape cannot know that the
    trainers reached 75, and the newest checkpoint is at 70. Only the termination messages say
    both."""
    ns, name = namespace, "final-step"
    manifest = cpu_tiny(name, steps=75, faults=None, interval_steps=10)
    manifest["spec"]["args"] += ["--set", "checkpoint.save_final=false"]
    apply(cluster, ns, manifest)
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    final = wait_for("the job to end", lambda: (
        s if (s := status(cluster, ns, name)).get("state") in ("Succeeded", "Failed") else None),
        timeout=400, interval=2, context=context)
    assert final["state"] == "Succeeded", context()
    assert final["step"] == 75, context()
    assert final["lastCheckpoint"]["step"] == 70, context()
    assert final["lastCheckpoint"]["time"], context()
    stale = next(c for c in final["conditions"] if c["type"] == "CheckpointStale")
    assert stale["status"] == "False"
