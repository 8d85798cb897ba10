"""The status and Events of a pass (`decisions/status.py`): conditions, restarts inside the
pods, bounded incidents, one Event per decision.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from rtj_operator.intents import PostEvent
from unit.decisions_builders import (
    T0,
    Outcome,
    beats,
    condition,
    decide,
    events,
    job,
    rendezvous,
    running,
    running_world,
    then,
    trainer,
    world,
)

pytestmark = pytest.mark.unit


def test_condition_transition_times_move_only_when_the_status_flips() -> None:
    j = job()
    one = running(j)
    later = T0 + timedelta(seconds=60)
    two = then(one, j, running_world(), now=later, liveness=beats(later))
    assert condition(two, "Running")["lastTransitionTime"] == \
        condition(one, "Running")["lastTransitionTime"] == "2026-11-29T12:00:30Z"
    assert "Running" not in events(two)


def test_launcher_restarts_seen_in_the_metrics_become_incidents() -> None:
    j = job()
    one = running(j)
    now = T0 + timedelta(seconds=60)
    two = then(one, j, running_world(), now=now,
               liveness=beats(now, restarts={"launcher": 1, "inprocess": 2, "pod": 0}))
    assert two.status["restarts"] == {"total": 3, "rank": 0, "full": 0, "launcher": 1,
                                      "inProcess": 2}
    actions = [i["action"] for i in two.status["incidents"]]
    assert actions == ["LauncherRestart", "InProcessRestart"]
    assert two.status["state"] == "Running"  # restarts inside the pods are not open incidents
    assert {"LauncherRestart", "InProcessRestart"} <= set(events(two))


def test_incidents_are_bounded_and_keep_the_operators_restarts_first() -> None:
    j = job(faultTolerance={"rankRestartBudget": {"max": 100, "windowSeconds": 600}})
    decision = running(j)
    now = T0 + timedelta(seconds=30)
    for n in range(1, 30):
        now += timedelta(seconds=3)
        decision = then(decision, j, running_world(), now=now,
                        liveness=beats(now, restarts={"launcher": n}))
    now += timedelta(seconds=3)
    decision = then(decision, j, world(trainer(0), rdzv=rendezvous()), now=now)
    incidents = decision.status["incidents"]
    assert len(incidents) == 20
    assert incidents[-1]["action"] == "RankRestart"


def test_every_decision_that_changes_something_posts_an_event() -> None:
    j = job()
    one = running(j)
    cases = [
        decide(j, world(services=False)),
        then(one, j, world(trainer(0), trainer(1, "Failed", exit_code=1), rdzv=rendezvous()),
             now=T0 + timedelta(seconds=60)),
        then(one, job(suspend=True), running_world(), now=T0 + timedelta(seconds=60)),
        then(one, j, world(trainer(0), trainer(1)), now=T0 + timedelta(seconds=60)),
    ]
    for decision in cases:
        changes = [a for a in decision.actions if not isinstance(a, PostEvent)]
        assert changes and len(decision.events) >= len(changes)


# --- status.lastCheckpoint after a fallback (review F14) ----------------------------------------


def _committed_200() -> tuple[Any, Outcome]:
    """A job whose ranks committed step 200 (at step 210): the job and the pass that recorded
    step 200 in status.lastCheckpoint."""
    j = job()
    now = T0 + timedelta(seconds=60)
    one = then(running(j), j, running_world(), now=now,
               liveness=beats(now, step=210, committed=200))
    assert one.status["lastCheckpoint"]["step"] == 200
    return j, one


def test_last_checkpoint_moves_back_when_a_new_attempt_resumed_from_an_older_checkpoint() -> None:
    # The trainers rejected step 200 (a corrupt shard) and resumed from step 100: every rank of
    # every pod of the new attempt reports 100 as its newest commit and trains below 200.
    j, one = _committed_200()
    pods = running_world(attempts=(1, 1))
    now = T0 + timedelta(seconds=120)
    two = then(one, j, pods, now=now, liveness=beats(now, step=120, committed=100, pods=pods))
    assert two.status["lastCheckpoint"] == {"step": 100, "time": "2026-11-29T12:02:00Z"}
    assert two.status["step"] == 120
    (moved,) = [e for e in two.events if e.reason == "CheckpointFellBack"]
    assert moved.type == "Warning"
    assert "from step 200 to step 100" in moved.message
    # Later commits move it up again as usual, and it says so once.
    later = now + timedelta(seconds=30)
    three = then(two, j, pods, now=later, liveness=beats(later, step=160, committed=150, pods=pods))
    assert three.status["lastCheckpoint"]["step"] == 150
    assert "CheckpointFellBack" not in events(three)


@pytest.mark.parametrize("case", ["a pod missed", "a rank missed", "not loaded yet", "lagging"])
def test_last_checkpoint_never_moves_back_without_evidence_from_every_rank(case: str) -> None:
    j, one = _committed_200()
    pods = running_world(attempts=(1, 1))
    now = T0 + timedelta(seconds=120)
    live = beats(now, step=120, committed=100, pods=pods)
    if case == "a pod missed":
        del live[1]  # the scrape of pod 1 failed: pod 0's report proves nothing alone
    elif case == "a rank missed":
        live[1] = replace(live[1], samples=live[1].samples[:1])
    elif case == "not loaded yet":  # a rank of the new attempt has not loaded a checkpoint
        live[1] = beats(now, step=0, pods=pods)[1]
    else:  # same processes behind rank 0's commit: they train past step 200
        live = beats(now, step=205, committed=190, pods=pods)
    two = then(one, j, pods, now=now, liveness=live)
    assert two.status["lastCheckpoint"]["step"] == 200
    assert "CheckpointFellBack" not in events(two)
