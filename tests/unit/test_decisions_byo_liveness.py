"""Hang detection for a team's own script (`decisions/hangs.py`, `not_reporting`; docs/byo.md):
a worker that reports nothing is supervised as a process only (never hung, never a node
excluded for silence, `HangDetection` False naming the pods); one that sends NVRx heartbeats
(the pod endpoint lists its ranks from their rank monitors) is watched as the built-in trainer
is, its clock starting when it connected; the built-in trainer keeps its strict rules."""

from __future__ import annotations

from datetime import datetime, timedelta

import pytest
from rtj_operator.api.models import runs_builtin_trainer
from rtj_operator.observed import NodeLiveness, Observed, RankSample
from unit.decisions_builders import (
    T0,
    Outcome,
    answering,
    condition,
    decide,
    deleted,
    events,
    job,
    running_world,
    then,
    world,
)

pytestmark = pytest.mark.unit

SCRIPT = ["python", "/workspace/train.py"]
"""A team's own command: not the built-in trainer."""


def script_job() -> object:
    return job(command=SCRIPT, args=["--epochs", "1"])


def nvrx_ranks(at: datetime | None, *, connected: datetime,
               observed: Observed | None = None) -> dict[int, NodeLiveness]:
    """Every pod lists its two ranks from their NVRx rank monitors: connected at `connected`,
    newest heartbeat `at` (None: none yet); no step (a script reports none)."""
    observed = observed or running_world()
    return {index: NodeLiveness(node_index=index, pod_uid=pod.uid, expected_ranks=2, samples=tuple(
        RankSample(local_rank=r, rank=index * 2 + r,
                   heartbeat=at.timestamp() if at is not None else None,
                   connected_time=connected.timestamp()) for r in range(2)))
        for index, pod in observed.trainer_pods.items()}


def passes(j: object, moments: list[datetime], liveness: object) -> Outcome:
    decision = decide(j, world())
    for now in moments:
        decision = then(decision, j, running_world(), now=now,
                        liveness=liveness(now) if callable(liveness) else liveness)
    return decision


def test_the_built_in_trainer_is_told_from_a_teams_own_command() -> None:
    assert runs_builtin_trainer(["python", "-m", "rtj_trainer"])
    assert runs_builtin_trainer(["/opt/venv/bin/python3.12", "-m", "rtj_trainer", "--preset", "1b"])
    assert not runs_builtin_trainer(SCRIPT)
    assert not runs_builtin_trainer(["torchrun", "-m", "rtj_trainer"])
    assert not runs_builtin_trainer(["python", "-m", "my_team.train"])
    assert job().spec.in_process_restart_enabled  # Auto, the built-in trainer: on
    assert not script_job().spec.in_process_restart_enabled  # Auto, a script: off


def test_a_script_that_reports_nothing_is_never_declared_hung_and_says_so() -> None:
    """Hours past both heartbeat timeouts: the pods run, no fault, no node excluded, the job is
    Running, and HangDetection is False naming every pod."""
    j = script_job()
    hours = [T0 + timedelta(seconds=30), T0 + timedelta(hours=1), T0 + timedelta(hours=3)]
    decision = passes(j, hours, answering())
    status = decision.status
    assert status["state"] == "Running"
    assert [r["state"] for r in status["ranks"]] == ["Running", "Running"]
    assert not deleted(decision) and not status.get("incidents")
    assert not status.get("excludedNodes")
    assert "HeartbeatStale" not in events(decision)
    hang = condition(decision, "HangDetection")
    assert hang["status"] == "False" and hang["reason"] == "WorkersReportNoHeartbeats"
    assert "tiny-0, tiny-1" in hang["message"] and "not detected" in hang["message"]


def test_the_built_in_trainer_answering_with_no_rank_is_still_a_hang() -> None:
    """The same silence from the built-in trainer is evidence: it always reports."""
    j = job()  # heartbeat 20 s + initial 60 s
    decision = passes(j, [T0 + timedelta(seconds=30), T0 + timedelta(seconds=90)], answering())
    assert [i["cause"] for i in decision.status["incidents"]] == ["HeartbeatTimeout"]
    assert deleted(decision) == ["tiny-0", "tiny-1", "tiny-rdzv"]  # a full restart
    assert condition(decision, "HangDetection")["status"] == "True"


def test_a_script_sending_nvrx_heartbeats_is_watched_and_a_stall_is_caught() -> None:
    """Heartbeats through the rank monitors: HangDetection True; when they stop, the pods turn
    Unresponsive after heartbeatTimeoutSeconds and are replaced after both timeouts."""
    j = script_job()
    start = T0 + timedelta(seconds=5)
    beating = passes(j, [T0 + timedelta(seconds=30), T0 + timedelta(seconds=60)],
                     lambda now: nvrx_ranks(now, connected=start))
    assert beating.status["state"] == "Running"
    assert condition(beating, "HangDetection")["status"] == "True"
    last = T0 + timedelta(seconds=60)
    stale = then(beating, j, running_world(), now=last + timedelta(seconds=25),
                 liveness=nvrx_ranks(last, connected=start))
    assert [r["state"] for r in stale.status["ranks"]] == ["Unresponsive", "Unresponsive"]
    assert "HeartbeatStale" in events(stale)
    hung = then(stale, j, running_world(), now=last + timedelta(seconds=85),
                liveness=nvrx_ranks(last, connected=start))
    assert [i["cause"] for i in hung.status["incidents"]] == ["HeartbeatTimeout"]
    assert deleted(hung) == ["tiny-0", "tiny-1", "tiny-rdzv"]


def test_a_script_rank_that_connected_but_has_not_beaten_gets_the_initial_timeout() -> None:
    """A worker's clock starts when it connected to its rank monitor (a script may load data for
    minutes before that): not Unresponsive before its first heartbeat, hung only after both
    timeouts from its connection."""
    j = script_job()
    connected = T0 + timedelta(minutes=10)  # after a long start that reported nothing
    early = passes(j, [T0 + timedelta(seconds=30), connected - timedelta(seconds=1)], answering())
    assert early.status["state"] == "Running" and not deleted(early)
    waiting = then(early, j, running_world(), now=connected + timedelta(seconds=70),
                   liveness=nvrx_ranks(None, connected=connected))
    assert not deleted(waiting) and "HeartbeatStale" not in events(waiting)
    assert not waiting.status.get("incidents")
    late = then(waiting, j, running_world(), now=connected + timedelta(seconds=85),
                liveness=nvrx_ranks(None, connected=connected))
    assert [i["cause"] for i in late.status["incidents"]] == ["HeartbeatTimeout"]
    assert deleted(late) == ["tiny-0", "tiny-1", "tiny-rdzv"]
