"""The status and Events of a pass (`decisions/status.py`): conditions, restarts inside the
pods, bounded incidents, one Event per decision.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from rtj_operator.intents import PostEvent
from unit.decisions_builders import (
    T0,
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
