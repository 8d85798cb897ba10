"""Rule 7, recovering (`decisions/recovery.py`): rank restarts, full restarts, their budgets,
and failing the job when they are spent.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from rtj_operator.api.status import Incident
from rtj_operator.api.vocabulary import IncidentCause, Reason, RecoveryAction
from rtj_operator.decisions.recovery import RECOVERY_GRACE_SECONDS, full_restart_backoff
from rtj_operator.intents import CreateObject, DeletePod
from unit.decisions_builders import (
    T0,
    beats,
    condition,
    created,
    decide,
    deleted,
    events,
    job,
    rendezvous,
    running,
    then,
    trainer,
    world,
)

pytestmark = pytest.mark.unit


def test_a_failed_pod_is_replaced_alone() -> None:
    j = job()
    one = running(j)
    now = T0 + timedelta(seconds=60)
    failed = world(trainer(0), trainer(1, "Failed", exit_code=1), rdzv=rendezvous())
    two = then(one, j, failed, now=now, liveness=beats(now, pods=failed))
    # Its containers have ended: it is deleted at once (nothing of it runs to be given a
    # grace period). Its replacement waits for the next pass: this pass's status (the incident,
    # the budget record) is written first, so an operator killed in between still records it.
    assert two.of_type(DeletePod) == [DeletePod("tiny-1", "uid-1-0", force=True)]
    assert created(two) == []
    incident = two.status["incidents"][-1]
    assert incident["cause"] == IncidentCause.POD_FAILED and incident["action"] == "RankRestart"
    assert incident["nodeIndex"] == 1 and "exit code 1" in incident["message"]
    assert two.status["restarts"]["rank"] == 1 and two.status["restarts"]["total"] == 1
    assert two.status["ranks"][1]["state"] == "Restarting"
    assert two.status["ranks"][1]["restarts"] == 1
    assert two.status["state"] == "Recovering"
    assert condition(two, "Recovering")["status"] == "True"
    assert "RankRestart" in events(two)

    # The pod is gone: the replacement is created with the next attempt; nothing else changes.
    gone = world(trainer(0), rdzv=rendezvous())
    three = then(two, j, gone, now=now + timedelta(seconds=3))
    assert created(three) == ["Pod/tiny-1"]
    pod = three.of_type(CreateObject)[0].manifest
    assert pod["metadata"]["labels"]["training.resilient.dev/attempt"] == "1"
    assert len(three.status["incidents"]) == 1
    assert three.status["restarts"]["rank"] == 1

    # Both run and heartbeat again: the incident is closed with its recovery time.
    later = now + timedelta(seconds=20)
    back = world(trainer(0), trainer(1, attempt=1, started=now + timedelta(seconds=4)),
                 rdzv=rendezvous())
    four = then(three, j, back, now=later, liveness=beats(later, pods=back))
    closed = four.status["incidents"][-1]
    assert closed["recoveredTime"] == "2026-11-29T12:01:20Z"
    # Detected when the container ended (T0+30, its finishedAt), recovered at T0+80.
    assert closed["detectedTime"] == "2026-11-29T12:00:30Z"
    assert closed["seconds"] == 50.0
    assert four.status["state"] == "Running"


def test_a_hung_pod_still_runs_so_it_gets_a_short_grace_and_keeps_its_name_until_gone() -> None:
    j = job()
    one = running(j)  # heartbeats at T0+30
    now = T0 + timedelta(seconds=30 + 20 + 60 + 1)
    live = beats(now)
    live[1] = beats(T0 + timedelta(seconds=30))[1]  # node 1 stuck at its old heartbeat
    two = then(one, j, world(trainer(0), trainer(1), rdzv=rendezvous()), now=now, liveness=live)
    # A short grace: the trainers' checkpoint-then-stop on SIGTERM cannot help a broken job.
    assert two.of_type(DeletePod) == [
        DeletePod("tiny-1", "uid-1-0", grace_seconds=RECOVERY_GRACE_SECONDS)]
    assert created(two) == []


def test_a_pod_that_is_still_terminating_is_not_recreated_yet() -> None:
    """A pod being deleted gracefully (here by someone else) keeps its name until it is gone,
    even once its containers ended: no second pod of that name is created beside it."""
    j = job()
    one = running(j)
    deleted = world(trainer(0), trainer(1, deleting=True), rdzv=rendezvous())
    two = then(one, j, deleted, now=T0 + timedelta(seconds=60))
    assert two.status["incidents"][-1]["action"] == "RankRestart"
    assert two.of_type(DeletePod) == [] and created(two) == []
    terminating = world(trainer(0), trainer(1, "Failed", exit_code=143, deleting=True),
                        rdzv=rendezvous())
    three = then(two, j, terminating, now=T0 + timedelta(seconds=62))
    assert three.actions == []
    assert three.events == []  # events were part of actions
    assert three.status["ranks"][1]["state"] == "Restarting"


def test_a_vanished_pod_is_recreated_at_once() -> None:
    j = job()
    one = running(j)
    two = then(one, j, world(trainer(0), rdzv=rendezvous()), now=T0 + timedelta(seconds=60))
    assert created(two) == ["Pod/tiny-1"]
    assert two.status["incidents"][-1]["cause"] == IncidentCause.POD_VANISHED
    assert two.status["ranks"][1]["attempt"] == 1


def test_a_pod_deleted_by_someone_else_counts_as_a_fault() -> None:
    j = job()
    one = running(j)
    observed = world(trainer(0), trainer(1, deleting=True), rdzv=rendezvous())
    two = then(one, j, observed, now=T0 + timedelta(seconds=60))
    assert two.of_type(DeletePod) == []
    assert two.status["incidents"][-1]["cause"] == IncidentCause.POD_DELETED
    assert two.status["ranks"][1]["state"] == "Restarting"


def test_a_spent_rank_budget_escalates_to_a_full_restart() -> None:
    j = job(faultTolerance={"rankRestartBudget": {"max": 1, "windowSeconds": 600}})
    one = running(j)
    two = then(one, j, world(trainer(0), rdzv=rendezvous()), now=T0 + timedelta(seconds=60))
    assert two.status["restarts"]["rank"] == 1
    three = then(two, j, world(trainer(0), trainer(1, "Failed", attempt=1, exit_code=1),
                               rdzv=rendezvous()), now=T0 + timedelta(seconds=90))
    assert sorted(deleted(three)) == ["tiny-0", "tiny-1", "tiny-rdzv"]
    assert three.status["incidents"][-1]["action"] == "FullRestart"
    assert three.status["restarts"]["full"] == 1
    assert "RankRestartBudgetSpent" in events(three)
    assert [r["state"] for r in three.status["ranks"]] == ["Restarting", "Restarting"]


def test_rank_restarts_outside_the_window_do_not_count() -> None:
    j = job(faultTolerance={"rankRestartBudget": {"max": 1, "windowSeconds": 60}})
    one = running(j)
    two = then(one, j, world(trainer(0), rdzv=rendezvous()), now=T0 + timedelta(seconds=60))
    later = T0 + timedelta(seconds=200)
    three = then(two, j, world(trainer(0), trainer(1, "Failed", attempt=1, exit_code=1),
                               rdzv=rendezvous()), now=later)
    assert deleted(three) == ["tiny-1"]
    assert three.status["restarts"]["rank"] == 2


def test_a_spent_full_restart_budget_fails_the_job() -> None:
    j = job(faultTolerance={"restartStrategy": "FullRestart",
                            "fullRestartBudget": {"max": 1, "windowSeconds": 600}})
    one = running(j)
    two = then(one, j, world(trainer(0), trainer(1, "Failed", exit_code=1), rdzv=rendezvous()),
               now=T0 + timedelta(seconds=60))
    assert two.status["restarts"]["full"] == 1
    again = world(trainer(0, attempt=1), trainer(1, "Failed", attempt=1, exit_code=1),
                  rdzv=rendezvous())
    three = then(two, j, again, now=T0 + timedelta(seconds=120))
    assert three.status["state"] == "Failed"
    assert three.status["reason"] == Reason.BUDGET
    assert three.status["completionTime"] == "2026-11-29T12:02:00Z"
    assert condition(three, "Failed")["status"] == "True"
    assert sorted(deleted(three)) == ["tiny-0", "tiny-rdzv"]
    assert three.status["incidents"][-1]["action"] == "Fail"


def test_full_restart_strategy_restarts_every_pod_on_any_fault() -> None:
    j = job(faultTolerance={"restartStrategy": "FullRestart"})
    one = running(j)
    two = then(one, j, world(trainer(0), trainer(1, "Failed", exit_code=1), rdzv=rendezvous()),
               now=T0 + timedelta(seconds=60))
    assert sorted(deleted(two)) == ["tiny-0", "tiny-1", "tiny-rdzv"]
    assert two.status["restarts"] == {"total": 1, "rank": 0, "full": 1, "launcher": 0,
                                      "inProcess": 0}


def test_a_full_restart_tears_everything_down_before_starting_again() -> None:
    j = job(faultTolerance={"restartStrategy": "FullRestart"})
    one = running(j)
    two = then(one, j, world(trainer(0), trainer(1, "Failed", exit_code=1), rdzv=rendezvous()),
               now=T0 + timedelta(seconds=60))
    half = world(trainer(0, deleting=True))
    three = then(two, j, half, now=T0 + timedelta(seconds=63))
    assert three.actions == []
    assert three.events == []  # events were part of actions
    four = then(three, j, world(), now=T0 + timedelta(seconds=66))
    assert created(four) == ["Pod/tiny-rdzv", "Pod/tiny-0", "Pod/tiny-1"]
    attempts = [a.manifest["metadata"]["labels"]["training.resilient.dev/attempt"]
                for a in four.of_type(CreateObject)[1:]]
    assert attempts == ["1", "1"]


def test_every_pod_failing_at_once_is_one_full_restart() -> None:
    j = job()
    one = running(j)
    both = world(trainer(0, "Failed", exit_code=1), trainer(1, "Failed", exit_code=1),
                 rdzv=rendezvous())
    two = then(one, j, both, now=T0 + timedelta(seconds=60))
    assert two.status["restarts"]["full"] == 1 and two.status["restarts"]["rank"] == 0
    assert len(two.status["incidents"]) == 1


def test_a_lost_rendezvous_pod_restarts_every_pod() -> None:
    j = job()
    one = running(j)
    two = then(one, j, world(trainer(0), trainer(1)), now=T0 + timedelta(seconds=60))
    assert sorted(deleted(two)) == ["tiny-0", "tiny-1"]
    assert two.status["incidents"][-1]["cause"] == IncidentCause.RENDEZVOUS_LOST
    assert created(two) == []


def test_a_failed_rendezvous_pod_is_deleted_with_the_trainers() -> None:
    j = job()
    one = running(j)
    two = then(one, j, world(trainer(0), trainer(1), rdzv=rendezvous("Failed")),
               now=T0 + timedelta(seconds=60))
    assert sorted(deleted(two)) == ["tiny-0", "tiny-1", "tiny-rdzv"]


def test_the_full_restart_budget_holds_when_rank_restarts_fill_the_incident_list() -> None:
    # review C5: three full restarts, then eighteen rank restarts; the 20-entry incident list no
    # longer shows the full restarts, but their records do, so a fourth whole-job fault within
    # the day fails the job instead of restarting it again.
    def at(hours: float) -> str:
        return (T0 + timedelta(hours=hours)).strftime("%Y-%m-%dT%H:%M:%SZ")

    rank_times = [at(3 + n / 3) for n in range(18)]
    incidents = [{"cause": "PodFailed", "nodeIndex": 1, "detectedTime": t, "actedTime": t,
                  "action": "RankRestart"} for t in rank_times]
    status = {"state": "Running", "incidents": incidents,
              "restartRecords": {"rank": rank_times[-10:], "full": [at(0), at(1), at(2)]}}
    j = job(status, faultTolerance={"rankRestartBudget": {"max": 10, "windowSeconds": 3600},
                                    "fullRestartBudget": {"max": 3, "windowSeconds": 86400}})
    now = T0 + timedelta(hours=9)
    lost = world(trainer(0), trainer(1), rdzv=None)
    d = decide(j, lost, now=now, liveness=beats(now, pods=lost))
    assert d.status["state"] == "Failed"
    assert d.status["reason"] == Reason.BUDGET


def test_restart_records_keep_the_newest_max_of_each_kind() -> None:
    j = job(faultTolerance={"rankRestartBudget": {"max": 2, "windowSeconds": 600}})
    state = running(j)
    now = T0
    for n in range(3):  # three rank restarts, far enough apart to stay within the budget
        now = now + timedelta(seconds=400)
        failed = world(trainer(0), trainer(1, "Failed", attempt=n, exit_code=1),
                       rdzv=rendezvous())
        state = then(state, j, failed, now=now, liveness=beats(now, pods=failed))
        assert state.status["incidents"][-1]["action"] == "RankRestart"
    records = state.status["restartRecords"]
    assert len(records["rank"]) == 2 and records["full"] == []


def test_full_restarts_in_a_row_without_a_recovery_back_off() -> None:
    """A rendezvous pod that dies at every start: the first full restart starts the pods again
    at once, the second after 10 s, the third after 20 s (no recovery in between), instead of
    spending the whole budget within a minute."""
    j = job(faultTolerance={"fullRestartBudget": {"max": 10, "windowSeconds": 3600}})
    state = running(j)
    now = T0 + timedelta(seconds=60)
    waits = []
    for attempt in range(3):
        # The rendezvous pod failed (at its start, after the first time): every pod goes.
        dying = world(trainer(0, "Pending", attempt=attempt),
                      trainer(1, "Pending", attempt=attempt), rdzv=rendezvous("Failed"))
        state = then(state, j, dying, now=now)
        assert state.status["incidents"][-1]["action"] == "FullRestart"
        assert state.status["restarts"]["full"] == attempt + 1
        assert ("FullRestartBackOff" in events(state)) == (attempt > 0)
        # Everything is gone: the pods start again once the back-off has passed.
        started_at = None
        for waited in range(0, 40, 3):
            at = now + timedelta(seconds=3 + waited)
            state = then(state, j, world(), now=at)
            if created(state):
                started_at = at
                break
            assert "start again at" in state.status["message"], state.status["message"]
        assert started_at is not None
        assert created(state) == ["Pod/tiny-rdzv", "Pod/tiny-0", "Pod/tiny-1"]
        waits.append((started_at - now).total_seconds())
        now = started_at + timedelta(seconds=5)
    assert waits == [3, 12, 21], waits  # at once (the next pass), after 10 s, after 20 s


def test_a_recovery_between_full_restarts_resets_the_back_off() -> None:
    j = job(faultTolerance={"fullRestartBudget": {"max": 10, "windowSeconds": 3600}})
    state = running(j)
    now = T0 + timedelta(seconds=60)
    for attempt in range(3):
        lost = world(trainer(0, attempt=attempt), trainer(1, attempt=attempt),
                     rdzv=rendezvous("Failed"))
        state = then(state, j, lost, now=now)
        assert state.status["incidents"][-1]["action"] == "FullRestart"
        assert "FullRestartBackOff" not in events(state)
        state = then(state, j, world(), now=now + timedelta(seconds=3))
        assert created(state) == ["Pod/tiny-rdzv", "Pod/tiny-0", "Pod/tiny-1"]  # at once
        # Every rank runs and beats again: the incident is closed.
        now = now + timedelta(seconds=30)
        back = world(trainer(0, attempt=attempt + 1, started=now - timedelta(seconds=20)),
                     trainer(1, attempt=attempt + 1, started=now - timedelta(seconds=20)),
                     rdzv=rendezvous())
        state = then(state, j, back, now=now, liveness=beats(now, pods=back))
        assert state.status["incidents"][-1]["recoveredTime"] is not None, state.status
        now = now + timedelta(seconds=60)


def test_the_back_off_doubles_up_to_five_minutes() -> None:
    def full(minute: int, recovered: bool = False) -> Incident:
        at = T0 + timedelta(minutes=minute)
        return Incident(cause=IncidentCause.RENDEZVOUS_LOST, detected_time=at, acted_time=at,
                        action=RecoveryAction.FULL_RESTART,
                        recovered_time=at + timedelta(seconds=30) if recovered else None)

    assert full_restart_backoff([]) == (0, None)
    assert full_restart_backoff([full(0)]) == (1, None)
    assert full_restart_backoff([full(0), full(1)]) == (2, T0 + timedelta(minutes=1, seconds=10))
    streak = [full(m) for m in range(8)]
    assert full_restart_backoff(streak) == (8, T0 + timedelta(minutes=7, seconds=300))
    # Only the restarts since the last recovery count.
    assert full_restart_backoff([full(0), full(1), full(2, recovered=True), full(3)]) == (1, None)
