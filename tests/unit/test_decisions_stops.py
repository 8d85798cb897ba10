"""Checkpoint now, then stop (`decisions/stops.py`, the eviction rules of `podfaults.py` and
`recovery.py`): a drain's eviction is rescheduled without spending a budget, and every stop the
trainers committed is recorded in `status.lastStop` with one Event.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import Any

import pytest
from rtj_operator.api.vocabulary import StopReason
from rtj_operator.decisions.stops import deleted_stop, suspend_reason
from rtj_operator.intents import CreateObject, DeletePod
from rtj_operator.observed import PodView, StopSeen
from rtj_wire.termination import TerminationMessage
from unit.decisions_builders import (
    T0,
    Outcome,
    beats,
    condition,
    created,
    deleted,
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

EVICTED = {"disruption": "EvictionByEvictionAPI"}
CHECKPOINT_DIR = "/checkpoints/ns/tiny/step-000000037.a0-l0-i0-1"
ANNOTATION = "training.resilient.dev/stop-reason"


def stopped_at(step: int, checkpoint: str | None = CHECKPOINT_DIR) -> TerminationMessage:
    return TerminationMessage(outcome="Stopped", step=step, committed_step=step,
                          committed_time=1796086800.0, checkpoint=checkpoint,
                          reason="CheckpointedBeforeStop",
                          message=f"checkpointed step {step} before stopping", exit_code=0)


def seen(pod: PodView, at_seconds: float = 0, job_uid: str = "job-uid") -> StopSeen:
    return StopSeen(pod=pod, job_uid=job_uid, seen_at=T0 + timedelta(seconds=at_seconds))


def annotated(j: Any, value: str) -> Any:
    return j.model_copy(update={"metadata": j.metadata.model_copy(
        update={"annotations": {ANNOTATION: value}})})


def evicted_pod_1(phase: str = "Running", **view: Any) -> PodView:
    return trainer(1, phase, deleting=True, **EVICTED, **view)


def drain_of_pod_1() -> tuple[Outcome, Outcome]:
    """A running job, then a pass that sees pod 1 evicted (Terminating, DisruptionTarget)."""
    one = running(job())
    now = T0 + timedelta(seconds=40)
    observed = world(trainer(0), evicted_pod_1(), rdzv=rendezvous())
    two = then(one, job(), observed, now=now, liveness=beats(now))
    return one, two


# --- eviction: rescheduled, no budget -------------------------------------------------------------


def test_an_evicted_trainer_pod_is_rescheduled_without_spending_a_budget() -> None:
    _, two = drain_of_pod_1()
    (incident,) = two.status["incidents"]
    assert incident["cause"] == "PodEvicted" and incident["action"] == "Reschedule"
    assert incident["nodeIndex"] == 1 and "EvictionByEvictionAPI" in incident["message"]
    assert two.status["restarts"]["rank"] == 0 and two.status["restarts"]["total"] == 0
    assert not (two.status.get("restartRecords") or {}).get("rank")
    assert deleted(two) == []  # the eviction deletes it; its trainers need their grace period
    assert two.status["ranks"][1]["state"] == "Restarting"
    assert two.status["state"] == "Recovering" and two.status["reason"] == "Reschedule"
    assert not two.status.get("excludedNodes")  # a drain says nothing against the node
    assert "Reschedule" in events(two)


def test_an_evicted_pod_is_replaced_once_gone_and_the_incident_closes_when_all_ranks_run() -> None:
    _, two = drain_of_pod_1()
    now = T0 + timedelta(seconds=45)
    stopped = evicted_pod_1("Succeeded", exit_code=0, outcome=stopped_at(37))
    three = then(two, job(), world(trainer(0), stopped, rdzv=rendezvous()), now=now,
                 liveness=beats(now, pods=world(trainer(0))))
    assert created(three) == []  # the name is still taken
    assert three.status["lastStop"]["reason"] == "Evicted"
    assert three.status["lastStop"]["step"] == 37
    assert three.status["lastStop"]["checkpoint"] == CHECKPOINT_DIR
    assert "pod tiny-1 was evicted from node node-1" in three.status["lastStop"]["message"]
    assert three.status["lastCheckpoint"]["step"] == 37
    assert events(three).count("CheckpointedBeforeStop") == 1
    four = then(three, job(), world(trainer(0), rdzv=rendezvous()),
                now=now + timedelta(seconds=2))
    (pod,) = [a.manifest for a in four.of_type(CreateObject)]
    assert pod["metadata"]["name"] == "tiny-1"
    assert pod["metadata"]["labels"]["training.resilient.dev/attempt"] == "1"
    assert "CheckpointedBeforeStop" not in events(four)  # recorded once
    later = now + timedelta(seconds=30)
    back = world(trainer(0), trainer(1, attempt=1, started=later - timedelta(seconds=5)),
                 rdzv=rendezvous())
    five = then(four, job(), back, now=later, liveness=beats(later, pods=back))
    assert five.status["state"] == "Running"
    (incident,) = five.status["incidents"]
    assert incident["recoveredTime"] is not None and incident["seconds"] > 0
    assert five.status["restarts"]["total"] == 0


def test_an_eviction_needs_no_budget_even_when_every_budget_is_spent() -> None:
    spent = job(faultTolerance={"rankRestartBudget": {"max": 0, "windowSeconds": 600},
                                "fullRestartBudget": {"max": 0, "windowSeconds": 600}})
    one = running(spent)
    now = T0 + timedelta(seconds=40)
    two = then(one, spent, world(trainer(0), evicted_pod_1(), rdzv=rendezvous()), now=now)
    assert two.status["state"] == "Recovering"
    assert [i["action"] for i in two.status["incidents"]] == ["Reschedule"]


def test_a_pod_deleted_by_hand_is_still_a_fault_and_its_stop_is_not_recorded() -> None:
    one = running(job())
    now = T0 + timedelta(seconds=40)
    by_hand = trainer(1, "Succeeded", exit_code=0, deleting=True, outcome=stopped_at(37))
    two = then(one, job(), world(trainer(0), by_hand, rdzv=rendezvous()), now=now)
    (incident,) = two.status["incidents"]
    assert incident["cause"] == "PodDeleted" and incident["action"] == "RankRestart"
    assert two.status["restarts"]["rank"] == 1
    assert "lastStop" not in two.status and "CheckpointedBeforeStop" not in events(two)


def test_a_pod_the_scheduler_preempted_is_rescheduled_and_recorded_as_preempted() -> None:
    one = running(job())
    now = T0 + timedelta(seconds=40)
    preempted = trainer(1, "Succeeded", exit_code=0, deleting=True,
                        disruption="PreemptionByScheduler", outcome=stopped_at(37))
    two = then(one, job(), world(trainer(0), preempted, rdzv=rendezvous()), now=now)
    assert two.status["incidents"][0]["action"] == "Reschedule"
    assert "preempted" in two.status["incidents"][0]["message"]
    assert two.status["lastStop"]["reason"] == "Preempted"


def test_a_taint_eviction_after_a_node_fault_is_not_a_voluntary_disruption() -> None:
    one = running(job())
    now = T0 + timedelta(seconds=40)
    tainted = trainer(1, deleting=True, disruption="DeletionByTaintManager")
    two = then(one, job(), world(trainer(0), tainted, rdzv=rendezvous()), now=now)
    assert two.status["incidents"][0]["cause"] == "PodDeleted"


def test_an_evicted_pod_gone_before_a_pass_saw_it_is_an_eviction_not_a_vanished_pod() -> None:
    one = running(job())
    now = T0 + timedelta(seconds=40)
    gone = trainer(1, "Succeeded", exit_code=0, deleting=True, outcome=stopped_at(37), **EVICTED)
    two = then(one, job(), world(trainer(0), rdzv=rendezvous(), stops=(seen(gone, 39),)),
               now=now)
    (incident,) = two.status["incidents"]
    assert incident["cause"] == "PodEvicted" and incident["action"] == "Reschedule"
    assert two.status["lastStop"]["reason"] == "Evicted"
    assert two.status["lastStop"]["step"] == 37


def test_an_eviction_of_an_earlier_attempt_does_not_explain_a_vanished_pod() -> None:
    one = running(job())
    now = T0 + timedelta(seconds=40)
    older = trainer(1, "Succeeded", attempt=7, deleting=True, **EVICTED)  # not the current 0
    two = then(one, job(), world(trainer(0), rdzv=rendezvous(), stops=(seen(older, 1),)),
               now=now)
    assert two.status["incidents"][0]["cause"] == "PodVanished"


def test_when_every_trainer_pod_is_evicted_the_rendezvous_starts_afresh_too() -> None:
    one = running(job())
    now = T0 + timedelta(seconds=40)
    two = then(one, job(), world(trainer(0, deleting=True, **EVICTED), evicted_pod_1(),
                                 rdzv=rendezvous()), now=now)
    assert deleted(two) == ["tiny-rdzv"]  # no launcher is left to open the next round
    assert [i["action"] for i in two.status["incidents"]] == ["Reschedule", "Reschedule"]
    assert two.status["restarts"]["total"] == 0


# --- the rendezvous pod evicted: every pod starts again, no budget --------------------------------


def test_an_evicted_rendezvous_pod_restarts_every_pod_with_its_grace_period_and_no_budget() -> None:
    one = running(job())
    now = T0 + timedelta(seconds=40)
    # A launcher that lost the store stopped its workers with a checkpoint, then exited 1.
    lost_store = trainer(0, "Failed", exit_code=1, outcome=stopped_at(37))
    two = then(one, job(faultTolerance={"nonRetryableExitCodes": [1]}),
               world(lost_store, trainer(1), rdzv=rendezvous(deleting=True, **EVICTED)), now=now)
    assert two.status["state"] == "Recovering"  # exit 1 is non-retryable, but it stopped
    assert sorted(deleted(two)) == ["tiny-0", "tiny-1"]
    assert {a.grace_seconds for a in two.of_type(DeletePod)} == {None}  # their own
    (incident,) = two.status["incidents"]
    assert incident["cause"] == "PodEvicted" and incident.get("nodeIndex") is None
    assert incident["action"] == "Reschedule"
    assert two.status["restarts"]["full"] == 0 and not two.status.get("restartRecords")
    assert two.status["lastStop"]["reason"] == "Evicted"
    assert "rendezvous pod was evicted" in two.status["lastStop"]["message"]
    terminating = world(trainer(0, deleting=True), trainer(1, deleting=True),
                        rdzv=rendezvous(deleting=True, **EVICTED))
    three = then(two, job(), terminating, now=now + timedelta(seconds=2))
    assert three.status["incidents"] == two.status["incidents"]  # no second incident
    assert three.actions == []
    four = then(three, job(), world(), now=now + timedelta(seconds=4))
    assert created(four)[0] == "Pod/tiny-rdzv"  # everything starts again


def test_a_rendezvous_pod_gone_right_after_its_eviction_is_an_eviction_not_a_lost_one() -> None:
    one = running(job())
    now = T0 + timedelta(seconds=40)
    evicted = rendezvous(deleting=True, phase="Succeeded", **EVICTED)
    two = then(one, job(), world(trainer(0), trainer(1), stops=(seen(evicted, 39),)), now=now)
    (incident,) = two.status["incidents"]
    assert incident["cause"] == "PodEvicted" and incident["action"] == "Reschedule"
    later = now + timedelta(seconds=600)  # a later loss of the new rendezvous pod is a fault
    back = then(two, job(), world(trainer(0), trainer(1), stops=(seen(evicted, 39),)),
                now=later)
    assert [i["cause"] for i in back.status["incidents"]] == ["PodEvicted", "RendezvousLost"]


# --- suspend, preemption, deletion: status.lastStop -----------------------------------------------


def suspended_and_stopped(j: Any) -> Outcome:
    one = running(job())
    two = then(one, j, running_world(), now=T0 + timedelta(seconds=60))
    ended = world(
        trainer(0, "Succeeded", exit_code=0, deleting=True, outcome=stopped_at(37)),
        trainer(1, "Succeeded", exit_code=0, deleting=True, outcome=stopped_at(37)),
        rdzv=rendezvous(deleting=True),
    )
    return then(two, j, ended, now=T0 + timedelta(seconds=65))


def test_a_suspend_records_the_stop_with_its_step_checkpoint_and_time() -> None:
    three = suspended_and_stopped(job(suspend=True))
    stop = three.status["lastStop"]
    assert stop["reason"] == "Suspended" and stop["step"] == 37
    assert stop["checkpoint"] == CHECKPOINT_DIR and stop["time"] == "2026-12-01T01:00:00Z"
    assert three.status["lastCheckpoint"] == {"step": 37, "time": "2026-12-01T01:00:00Z"}
    assert events(three).count("CheckpointedBeforeStop") == 1


def test_a_suspend_for_a_preemption_says_preempted() -> None:
    three = suspended_and_stopped(annotated(job(suspend=True), "Preempted"))
    assert three.status["lastStop"]["reason"] == "Preempted"
    assert "the job was preempted" in three.status["lastStop"]["message"]
    assert condition(three, "Suspended")["status"] == "True"


def test_an_unknown_stop_reason_is_recorded_as_a_suspend_with_a_warning() -> None:
    three = suspended_and_stopped(annotated(job(suspend=True), "Because"))
    assert three.status["lastStop"]["reason"] == "Suspended"
    assert "'Because', not one of Suspended, Preempted" in three.status["lastStop"]["message"]
    warning = next(e for e in three.events if e.reason == "InvalidStopReason")
    assert warning.type == "Warning" and ANNOTATION in warning.message


def test_a_stop_seen_only_by_the_pod_watch_is_recorded_once_the_pods_are_gone() -> None:
    one = running(job())
    suspended = job(suspend=True)
    two = then(one, suspended, running_world(), now=T0 + timedelta(seconds=60))
    gone = trainer(0, "Succeeded", exit_code=0, deleting=True, outcome=stopped_at(37))
    three = then(two, suspended, world(stops=(seen(gone, 61),)), now=T0 + timedelta(seconds=65))
    assert three.status["lastStop"]["step"] == 37
    assert "checkpointed step 37" in condition(three, "Suspended")["message"]


def test_a_stop_of_another_job_of_the_same_name_is_not_this_jobs() -> None:
    from rtj_operator.views import observed_from

    gone = trainer(0, "Succeeded", exit_code=0, deleting=True, outcome=stopped_at(37))
    observed = observed_from(job_name="tiny", job_uid="job-uid", pods=[], services=[],
                             claims=[], stops=[seen(gone, 1, job_uid="deleted-job")])
    assert observed.stops == ()


def test_an_older_stop_never_replaces_a_newer_one() -> None:
    three = suspended_and_stopped(job(suspend=True))
    old = trainer(0, "Succeeded", attempt=9, deleting=True, outcome=stopped_at(12))
    four = then(three, job(suspend=True), world(stops=(seen(old, 70),)),
                now=T0 + timedelta(seconds=75))
    assert four.status["lastStop"]["step"] == 37
    assert "CheckpointedBeforeStop" not in events(four)


def test_the_stop_reason_annotation_takes_suspended_or_preempted() -> None:
    assert suspend_reason({}) == (StopReason.SUSPENDED, None)
    assert suspend_reason({ANNOTATION: "Preempted"}) == (StopReason.PREEMPTED, None)
    assert suspend_reason({ANNOTATION: " Suspended "}) == (StopReason.SUSPENDED, None)
    reason, complaint = suspend_reason({ANNOTATION: "preempted"})
    assert reason == StopReason.SUSPENDED and complaint and ANNOTATION in complaint


def test_a_deleted_jobs_stop_is_the_newest_step_its_trainers_committed() -> None:
    first = trainer(0, "Succeeded", outcome=stopped_at(36))
    second = trainer(1, "Succeeded", outcome=stopped_at(37))
    nothing = trainer(1, "Succeeded", attempt=1, **EVICTED)
    stop = deleted_stop([seen(first, 1), seen(second, 2), seen(nothing, 3)])
    assert stop is not None and stop.reason == StopReason.DELETED and stop.step == 37
    assert stop.message and stop.message.startswith("the job was deleted")
    assert deleted_stop([seen(nothing)]) is None


def test_a_stopped_pod_does_not_succeed_even_with_exit_0() -> None:
    one = running(job())
    now = T0 + timedelta(seconds=40)
    evicted = replace(evicted_pod_1("Succeeded", exit_code=0, outcome=stopped_at(37)),
                      deleting=False)
    two = then(one, job(), world(trainer(0), evicted, rdzv=rendezvous()), now=now)
    assert two.status["state"] != "Succeeded"


def test_a_deleted_job_waits_for_its_pods_at_most_their_grace_period_and_a_margin() -> None:
    import kopf
    from rtj_operator import handlers

    def deleting(grace: int | None) -> kopf.Body:
        template = {"terminationGracePeriodSeconds": grace} if grace is not None else {}
        return kopf.Body({"metadata": {"name": "tiny", "deletionTimestamp": "2026-11-29T12:00:00Z"},
                          "spec": {"podTemplate": template}})

    margin = handlers.DELETE_WAIT_MARGIN_SECONDS
    assert not handlers.deletion_wait_over(deleting(None), T0 + timedelta(seconds=120 + margin - 1))
    assert handlers.deletion_wait_over(deleting(None), T0 + timedelta(seconds=120 + margin))
    assert handlers.deletion_wait_over(deleting(10), T0 + timedelta(seconds=10 + margin))
    assert handlers.deletion_wait_over(kopf.Body({"metadata": {"name": "tiny"}}), T0)


def test_a_deleted_jobs_children_are_deleted_once_not_at_every_retry() -> None:
    # review-2 F10: every 2 s retry of the deletion sent a LIST of pods, Services and claims and
    # a DELETE per pod. Now the first try does; a later one only for a pod the watch cache shows
    # running and not being deleted (created by a pass that was in flight).
    from rtj_operator import handlers

    going = {"metadata": {"name": "tiny-0", "deletionTimestamp": "2026-11-29T12:00:00Z"},
             "status": {"phase": "Running"}}
    ended = {"metadata": {"name": "tiny-1"}, "status": {"phase": "Succeeded"}}
    stray = {"metadata": {"name": "tiny-1"}, "status": {"phase": "Pending"}}
    assert handlers.must_delete_children(False, [])
    assert handlers.must_delete_children(False, [going])
    assert not handlers.must_delete_children(True, [going, ended])
    assert handlers.must_delete_children(True, [going, stray])
