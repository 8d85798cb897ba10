"""Rules 1-6 and 8 (`decisions/lifecycle.py`): creating what is missing, suspend and resume,
the deadline, exit codes that must not be retried, completion and finished jobs.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

import pytest
from rtj_operator import builders
from rtj_operator import decisions as d
from rtj_operator.api.vocabulary import Reason
from rtj_operator.intents import (
    CreateObject,
    DeleteJob,
    DeletePod,
    SetClaimOwner,
    SyncNetworkPolicy,
)
from rtj_operator.observed import ClaimView
from rtj_operator.podplan import plan_for
from rtj_wire.termination import TerminationMessage
from unit.decisions_builders import (
    SETTINGS,
    T0,
    Outcome,
    beats,
    condition,
    created,
    decide,
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


def test_a_new_job_gets_services_a_rendezvous_pod_and_every_trainer_pod() -> None:
    decision = decide(job(), world(services=False))
    assert created(decision) == [
        "NetworkPolicy/tiny", "Service/tiny", "Service/tiny-rdzv", "Pod/tiny-rdzv", "Pod/tiny-0",
        "Pod/tiny-1",
    ]
    pod = decision.of_type(CreateObject)[4].manifest
    assert pod["metadata"]["labels"]["training.resilient.dev/attempt"] == "0"
    assert decision.status["state"] == "Pending"
    assert decision.status["nodes"] == "0/2"
    assert [r["state"] for r in decision.status["ranks"]] == ["Pending", "Pending"]
    assert decision.status["startTime"] == "2026-11-29T12:00:00Z"
    assert events(decision).count("Created") == 6


def test_a_dynamic_checkpoint_volume_becomes_a_claim_owned_by_the_job() -> None:
    j = job(checkpoint={"storageClassName": "fsx", "size": "100Gi"})
    decision = decide(j, world())
    claim = next(a for a in decision.of_type(CreateObject) if a.kind == "PersistentVolumeClaim")
    assert claim.name == "tiny-checkpoints"
    assert claim.manifest["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim.manifest["spec"]["storageClassName"] == "fsx"
    assert claim.manifest["metadata"]["ownerReferences"][0]["uid"] == "job-uid"


def test_a_claim_with_retain_policy_is_released_from_the_job() -> None:
    j = job(checkpoint={"storageClassName": "fsx", "size": "100Gi",
                        "claimDeletePolicy": "Retain"})
    decision = decide(j, world(claim=ClaimView(name="tiny-checkpoints", owned_by_job=True)))
    assert decision.of_type(SetClaimOwner) == [SetClaimOwner("tiny-checkpoints", None)]
    assert "ClaimDeletePolicy" in events(decision)


def test_an_existing_claim_is_never_created() -> None:
    decision = decide(job(), world())
    assert not [a for a in decision.of_type(CreateObject) if a.kind != "Pod"]


def test_pods_that_exist_are_not_created_again() -> None:
    j = job()
    first = decide(j, world())
    second = then(first, j, world(trainer(0, "Pending"), trainer(1, "Pending"),
                                  rdzv=rendezvous("Pending")))
    assert second.actions == []
    assert second.events == []  # events were part of actions
    assert second.status["state"] == "Pending"
    assert second.status["reason"] == Reason.CREATING


@pytest.mark.parametrize("code", [93, 42])
def test_a_non_retryable_exit_code_fails_the_job(code: int) -> None:
    j = job(faultTolerance={"nonRetryableExitCodes": [42]})
    one = running(j)
    two = then(one, j, world(trainer(0), trainer(1, "Failed", exit_code=code),
                             rdzv=rendezvous()), now=T0 + timedelta(seconds=60))
    assert two.status["state"] == "Failed"
    assert two.status["reason"] == Reason.NON_RETRYABLE
    assert f"exited with code {code}" in two.status["message"]
    assert sorted(deleted(two)) == ["tiny-0", "tiny-rdzv"]
    assert "NonRetryableExitCode" in events(two)


def test_a_retryable_exit_code_is_restarted() -> None:
    j = job(faultTolerance={"nonRetryableExitCodes": [42]})
    one = running(j)
    two = then(one, j, world(trainer(0), trainer(1, "Failed", exit_code=1), rdzv=rendezvous()),
               now=T0 + timedelta(seconds=60))
    assert two.status["state"] == "Recovering"


def test_every_pod_exiting_zero_is_success() -> None:
    j = job()
    one = running(j)
    done = world(trainer(0, "Succeeded", exit_code=0), trainer(1, "Succeeded", exit_code=0),
                 rdzv=rendezvous())
    two = then(one, j, done, now=T0 + timedelta(seconds=90))
    assert two.status["state"] == "Succeeded"
    assert two.status["completionTime"] == "2026-11-29T12:01:30Z"
    assert condition(two, "Succeeded")["status"] == "True"
    assert condition(two, "Ready")["status"] == "True"
    assert deleted(two) == ["tiny-rdzv"]
    assert [r["state"] for r in two.status["ranks"]] == ["Succeeded", "Succeeded"]


def test_success_reports_the_newest_step_seen() -> None:
    j = job()
    one = running(j)
    last = T0 + timedelta(seconds=60)
    two = then(one, j, running_world(), now=last, liveness=beats(last, step=79, committed=80))
    done = world(trainer(0, "Succeeded", exit_code=0), trainer(1, "Succeeded", exit_code=0),
                 rdzv=rendezvous())
    three = then(two, j, done, now=last + timedelta(seconds=3))
    assert three.status["step"] == 80
    assert three.status["lastCheckpoint"]["step"] == 80


def test_no_restart_once_a_pod_has_succeeded() -> None:
    j = job()
    one = running(j)
    half = world(trainer(0, "Succeeded", exit_code=0), trainer(1), rdzv=rendezvous())
    two = then(one, j, half, now=T0 + timedelta(seconds=90))
    assert two.actions == [] or not two.of_type(DeletePod)
    assert two.status["state"] != "Succeeded"


def test_the_rendezvous_pod_ending_after_a_trainer_finished_is_not_a_lost_rendezvous() -> None:
    # Training is over: one launcher's workers completed, it closed the rendezvous for good and
    # nvrx-control exited 0, while the other launcher still waits in torchelastic's exit barrier
    # (30 s when a standby spare never reaches it). Seen in the e2e spare test on a loaded
    # machine: a FullRestart (RendezvousLost) of a job that had finished its last step.
    j = job()
    one = running(j)
    ending = world(trainer(0, "Succeeded", exit_code=0), trainer(1),
                   rdzv=rendezvous("Succeeded", exit_code=0))
    two = then(one, j, ending, now=T0 + timedelta(seconds=90))
    assert not two.of_type(DeletePod), two.actions
    assert "FullRestart" not in events(two)
    assert two.status["state"] == "Running"
    done = world(trainer(0, "Succeeded", exit_code=0), trainer(1, "Succeeded", exit_code=0),
                 rdzv=rendezvous("Succeeded", exit_code=0))
    three = then(two, j, done, now=T0 + timedelta(seconds=95))
    assert three.status["state"] == "Succeeded"
    assert three.status["restarts"]["full"] == 0


def test_a_rendezvous_pod_that_ended_while_no_trainer_finished_is_still_lost() -> None:
    j = job()
    one = running(j)
    two = then(one, j, world(trainer(0), trainer(1), rdzv=rendezvous("Succeeded", exit_code=0)),
               now=T0 + timedelta(seconds=90))
    assert "FullRestart" in events(two)
    stopped = TerminationMessage(outcome="Stopped", step=40, committed_step=40)
    three = then(one, j, world(trainer(0, "Succeeded", exit_code=0, outcome=stopped), trainer(1),
                               rdzv=rendezvous("Succeeded", exit_code=0)),
                 now=T0 + timedelta(seconds=90))
    assert "FullRestart" in events(three)  # a pod that stopped on purpose did not finish


def test_success_next_to_a_failure_is_a_partial_completion() -> None:
    j = job()
    one = running(j)
    mixed = world(trainer(0, "Succeeded", exit_code=0), trainer(1, "Failed", exit_code=1),
                  rdzv=rendezvous())
    two = then(one, j, mixed, now=T0 + timedelta(seconds=90))
    assert two.status["state"] == "Failed"
    assert two.status["reason"] == Reason.PARTIAL


def test_the_deadline_fails_the_job() -> None:
    j = job(activeDeadlineSeconds=100)
    one = running(j)
    two = then(one, j, running_world(), now=T0 + timedelta(seconds=100))
    assert two.status["state"] == "Failed"
    assert two.status["reason"] == Reason.DEADLINE
    assert sorted(deleted(two)) == ["tiny-0", "tiny-1", "tiny-rdzv"]


def _finished(j: Any, state: str, completion: datetime) -> Outcome:
    status = {"state": state, "completionTime": completion.strftime("%Y-%m-%dT%H:%M:%SZ"),
              "ranks": [], "conditions": []}
    return decide(job(status=status, **j), world(trainer(0, "Succeeded", exit_code=0),
                                                 trainer(1, "Succeeded", exit_code=0)),
                  now=completion + timedelta(seconds=50))


def test_a_finished_job_is_deleted_after_its_ttl() -> None:
    assert _finished({"ttlSecondsAfterFinished": 60}, "Succeeded", T0).actions == []
    assert _finished({"ttlSecondsAfterFinished": 60}, "Succeeded", T0).events == []
    late = _finished({"ttlSecondsAfterFinished": 30}, "Succeeded", T0)
    assert late.of_type(DeleteJob) == [DeleteJob()]
    assert "Deleted" in events(late)


def test_a_finished_job_without_ttl_is_kept() -> None:
    assert _finished({}, "Failed", T0 - timedelta(days=3)).actions == []
    assert _finished({}, "Failed", T0 - timedelta(days=3)).events == []


def test_a_failed_job_stops_pods_that_still_run() -> None:
    j = job(status={"state": "Failed", "completionTime": "2026-11-29T12:00:00Z"})
    decision = decide(j, running_world())
    assert sorted(deleted(decision)) == ["tiny-0", "tiny-1", "tiny-rdzv"]
    assert decision.status["state"] == "Failed"


def test_suspend_deletes_the_pods_and_keeps_services_and_claim() -> None:
    j = job()
    one = running(j)
    suspended = job(suspend=True)
    two = then(one, suspended, running_world(), now=T0 + timedelta(seconds=60))
    assert sorted(deleted(two)) == ["tiny-0", "tiny-1", "tiny-rdzv"]
    assert created(two) == []
    assert two.status["state"] == "Suspended"
    assert two.status["startTime"] is None
    assert condition(two, "Suspended")["status"] == "True"
    assert condition(two, "Running")["status"] == "False"
    assert [r["state"] for r in two.status["ranks"]] == ["Suspended", "Suspended"]
    three = then(two, suspended, world(), now=T0 + timedelta(seconds=70))
    assert three.actions == []
    assert three.events == []  # events were part of actions


def stopped_at(step: int) -> TerminationMessage:
    return TerminationMessage(outcome="Stopped", step=step, committed_step=step,
                          committed_time=1796086800.0, reason="CheckpointedBeforeStop",
                          message=f"checkpointed step {step} before stopping", exit_code=0)


def test_suspend_gives_the_trainers_their_grace_period_to_checkpoint() -> None:
    one = running(job())
    two = then(one, job(suspend=True), running_world(), now=T0 + timedelta(seconds=60))
    assert {a.grace_seconds for a in two.of_type(DeletePod)} == {None}  # the pod's own


def test_a_checkpoint_committed_before_the_suspend_is_recorded_once() -> None:
    one = running(job())
    suspended = job(suspend=True)
    two = then(one, suspended, running_world(), now=T0 + timedelta(seconds=60))
    # The kubelet reported the containers' end; the pods are still Terminating.
    ended = world(
        trainer(0, "Succeeded", exit_code=0, deleting=True, outcome=stopped_at(37)),
        trainer(1, "Succeeded", exit_code=0, deleting=True, outcome=stopped_at(37)),
        rdzv=rendezvous(deleting=True),
    )
    three = then(two, suspended, ended, now=T0 + timedelta(seconds=65))
    assert three.status["lastCheckpoint"]["step"] == 37
    assert three.status["state"] == "Suspended"
    assert "checkpointed step 37 before stopping" in condition(three, "Suspended")["message"]
    assert three.status["lastStop"]["reason"] == "Suspended"
    assert three.status["lastStop"]["step"] == 37
    assert [e.message for e in three.events if e.reason == "CheckpointedBeforeStop"] == [
        "Suspended: checkpointed step 37 before stopping: the job was suspended; the trainers "
        "committed a checkpoint of step 37 before they stopped"]
    four = then(three, suspended, ended, now=T0 + timedelta(seconds=68))
    assert "CheckpointedBeforeStop" not in events(four)  # once
    five = then(four, suspended, world(), now=T0 + timedelta(seconds=70))  # pods gone
    assert five.status["lastCheckpoint"]["step"] == 37


def test_pods_that_stopped_on_purpose_do_not_make_the_job_succeed() -> None:
    one = running(job())
    stopped = world(
        trainer(0, "Succeeded", exit_code=0, outcome=stopped_at(12)),
        trainer(1, "Succeeded", exit_code=0, outcome=stopped_at(12)),
        rdzv=rendezvous(),
    )
    two = then(one, job(), stopped, now=T0 + timedelta(seconds=60))
    assert two.status["state"] != "Succeeded"


def test_resume_recreates_every_pod_with_the_next_attempt() -> None:
    j = job()
    one = running(j)
    two = then(one, job(suspend=True), running_world(), now=T0 + timedelta(seconds=60))
    three = then(two, job(suspend=True), world(), now=T0 + timedelta(seconds=70))
    resumed = then(three, j, world(), now=T0 + timedelta(seconds=80))
    assert created(resumed) == ["Pod/tiny-rdzv", "Pod/tiny-0", "Pod/tiny-1"]
    assert [r["attempt"] for r in resumed.status["ranks"]] == [1, 1]
    assert resumed.status["startTime"] == "2026-11-29T12:01:20Z"
    assert resumed.status["incidents"] == []
    assert resumed.status["restarts"]["total"] == 0


def test_resume_waits_for_suspended_pods_to_finish_terminating() -> None:
    j = job()
    one = running(j)
    two = then(one, job(suspend=True), running_world(), now=T0 + timedelta(seconds=60))
    resumed = then(two, j, world(trainer(0, deleting=True), rdzv=rendezvous(deleting=True)),
                   now=T0 + timedelta(seconds=62))
    assert not resumed.of_type(CreateObject) and not resumed.of_type(DeletePod)


def test_the_network_policy_is_created_with_the_headless_service_unless_switched_off() -> None:
    off = replace(SETTINGS, network_policy=False)
    j = job()
    decision = d.decide(job=j, plan=plan_for(j, off), observed=world(services=False),
                        liveness={}, now=T0, memory=d.Memory(), settings=off)
    assert not [a for a in decision.of_type(CreateObject) if a.kind == "NetworkPolicy"]
    assert "NetworkPolicy/tiny" not in created(decide(job(), world()))  # services exist


def test_the_rendezvous_pod_gets_a_disruption_budget_with_its_service_when_enabled() -> None:
    """#31: a drain's eviction of the rendezvous pod restarts the whole job; with the budget on,
    no voluntary eviction while it is Ready, made with the rendezvous Service. Off by default
    (drains always proceed, as for trainer pods)."""
    on = {"faultTolerance": {"rendezvousDisruptionBudget": "Enabled"}}
    decision = decide(job(**on), world(services=False))
    made = {f"{a.kind}/{a.name}": a.manifest for a in decision.of_type(CreateObject)}
    budget = made["PodDisruptionBudget/tiny-rdzv"]
    assert budget["apiVersion"] == "policy/v1"
    assert budget["spec"] == {
        "maxUnavailable": 0,
        "selector": {"matchLabels": {"training.resilient.dev/job": "tiny",
                                     "training.resilient.dev/role": "rendezvous"}},
        "unhealthyPodEvictionPolicy": "AlwaysAllow"}
    assert budget["metadata"]["ownerReferences"][0]["uid"] == "job-uid"
    assert "PodDisruptionBudget/tiny-rdzv" not in created(decide(job(**on), world()))  # once
    off = decide(job(), world(services=False))
    assert "PodDisruptionBudget/tiny-rdzv" not in created(off)
    assert "Service/tiny-rdzv" in created(off)


def _decide_with(settings: Any, observed: Any) -> Any:
    j = job()
    return d.decide(job=j, plan=plan_for(j, settings), observed=observed, liveness={}, now=T0,
                    memory=d.Memory(), settings=settings)


def test_the_headless_service_records_the_digest_of_the_network_policy_made_with_it() -> None:
    decision = decide(job(), world(services=False))
    made = {a.name + "/" + a.kind: a.manifest for a in decision.of_type(CreateObject)}
    policy, service = made["tiny/NetworkPolicy"], made["tiny/Service"]
    digest = builders.network_policy_digest(policy)
    assert service["metadata"]["annotations"] == {
        "training.resilient.dev/network-policy": digest}
    assert len(digest) == 16


def test_a_network_policy_rendered_from_older_settings_is_rendered_again() -> None:
    # review-2 F7: the policy was made once and never compared; an operator moved to another
    # namespace (or a Prometheus named later) could read no pod of a running job.
    moved = replace(SETTINGS, network_policy_operator_namespace="rtj-system",
                    network_policy_operator_labels="app.kubernetes.io/name=rtj-operator")
    j = job()
    old = builders.network_policy_digest(
        builders.network_policy(j, plan=plan_for(j, SETTINGS), settings=SETTINGS))
    decision = _decide_with(moved, replace(running_world(), network_policy=old))
    syncs = [a for a in decision.actions if isinstance(a, SyncNetworkPolicy)]
    assert len(syncs) == 1
    sync = syncs[0]
    assert sync.service == "tiny" and sync.manifest["metadata"]["name"] == "tiny"
    assert sync.digest == builders.network_policy_digest(sync.manifest) != old
    operator_rule = sync.manifest["spec"]["ingress"][1]
    assert operator_rule["from"][0]["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "rtj-system"}}
    assert [e.reason for e in decision.events].count("NetworkPolicyUpdated") == 1
    assert not decision.of_type(CreateObject)  # nothing else is made again
    # Once the Service records the new digest, nothing more is done.
    settled = _decide_with(moved, replace(running_world(), network_policy=sync.digest))
    assert not [a for a in settled.actions if isinstance(a, SyncNetworkPolicy)]


def test_a_service_made_before_digests_were_recorded_gets_its_policy_rendered_once() -> None:
    decision = _decide_with(SETTINGS, running_world())  # no annotation on the Service
    syncs = [a for a in decision.actions if isinstance(a, SyncNetworkPolicy)]
    assert len(syncs) == 1
    assert "NetworkPolicyUpdated" not in [e.reason for e in decision.events]  # a quiet upgrade


def test_with_network_policies_off_an_existing_policy_is_left_alone() -> None:
    off = replace(SETTINGS, network_policy=False)
    decision = _decide_with(off, replace(running_world(), network_policy="0123456789abcdef"))
    assert not [a for a in decision.actions if isinstance(a, SyncNetworkPolicy)]
    made = decide(job(), world(services=False))
    assert made.of_type(CreateObject)  # (the default settings make one)


# --- a pod lost after training finished on every rank ---------------------------------------------


def _finishing(now: datetime, index: int = 0) -> dict[int, Any]:
    """Pod `index`'s launcher reports every local worker exited 0 (it waits in the exit
    barrier); the other pod still beats."""
    live = beats(now, step=60)
    live[index] = replace(live[index], finished=True)
    return live


def test_a_pod_killed_after_training_finished_ends_the_job_succeeded_not_replaced() -> None:
    # The long e2e drill on a fast machine, 2026-12-04: pod 1 was SIGKILLed while pod 0 waited
    # in torchelastic's exit barrier with training done on every rank (final checkpoint
    # committed). The operator replaced pod 1; the replacement waited for a launcher round that
    # nobody else would join, missed its heartbeats, was replaced again, and so on: a job that
    # never ended. Training is done: nothing is lost, the job Succeeded.
    j = job()
    at_end = T0 + timedelta(seconds=55)
    one = then(running(j), j, running_world(), now=at_end,
               liveness=beats(at_end, step=60, committed=60))
    now = T0 + timedelta(seconds=60)
    killed = world(trainer(0), trainer(1, "Failed", exit_code=137), rdzv=rendezvous())
    two = then(one, j, killed, now=now, liveness=_finishing(now))
    assert two.status["state"] == "Succeeded", two.status
    assert two.status["reason"] == Reason.COMPLETED
    assert "pod tiny-1 failed (exit code 137)" in two.status["message"]
    assert created(two) == [] and "RankRestart" not in events(two)
    # The survivor would wait up to 300 s in the exit barrier for pod 1: it is stopped.
    assert sorted(deleted(two)) == ["tiny-0", "tiny-rdzv"]
    assert [r["state"] for r in two.status["ranks"]] == ["Succeeded", "Succeeded"]
    assert two.status["restarts"]["rank"] == 0 and two.status["restarts"]["full"] == 0
    assert two.status["step"] == 60 and two.status["lastCheckpoint"]["step"] == 60


def test_a_replacement_that_never_joined_the_finished_run_ends_the_job_succeeded() -> None:
    # The same, when the operator saw the kill before the survivor's mark and replaced pod 1:
    # the replacement waits for a launcher round that never comes.
    j = job()
    one = running(j)
    now = T0 + timedelta(seconds=60)
    replaced = then(one, j, world(trainer(0), trainer(1, "Failed", exit_code=137),
                                  rdzv=rendezvous()), now=now, liveness=beats(now, step=60))
    assert "RankRestart" in events(replaced)
    later = now + timedelta(seconds=5)
    waiting = world(trainer(0), trainer(1, attempt=1, started=now), rdzv=rendezvous())
    three = then(replaced, j, waiting, now=later, liveness=_finishing(later))
    assert three.status["state"] == "Succeeded", three.status
    assert "never joined the finished run" in three.status["message"]
    assert sorted(deleted(three)) == ["tiny-0", "tiny-1", "tiny-rdzv"]


def test_a_lost_rendezvous_pod_after_training_finished_is_no_full_restart() -> None:
    j = job()
    one = running(j)
    now = T0 + timedelta(seconds=60)
    killed = world(trainer(0), trainer(1), rdzv=rendezvous("Failed", exit_code=137))
    two = then(one, j, killed, now=now, liveness=_finishing(now))
    assert "FullRestart" not in events(two) and two.of_type(DeletePod) == []
    assert two.status["state"] == "Running"
    done = world(trainer(0, "Succeeded", exit_code=0), trainer(1, "Succeeded", exit_code=0),
                 rdzv=rendezvous("Failed", exit_code=137))
    three = then(two, j, done, now=now + timedelta(seconds=5))
    assert three.status["state"] == "Succeeded" and three.status["restarts"]["full"] == 0


def test_a_trainer_that_said_succeeded_next_to_a_failed_pod_is_a_success() -> None:
    # The trainer writes `Succeeded` only past its end-of-training barrier: every rank had
    # committed its final checkpoint, so pod 1's failure on its way out lost nothing. Without
    # that message (a trainer of another kind), the same pods stay a PartialCompletion.
    j = job()
    one = running(j)
    said = TerminationMessage(outcome="Succeeded", step=60, committed_step=60)
    mixed = world(trainer(0, "Succeeded", exit_code=0, outcome=said),
                  trainer(1, "Failed", exit_code=1), rdzv=rendezvous())
    two = then(one, j, mixed, now=T0 + timedelta(seconds=90))
    assert two.status["state"] == "Succeeded", two.status
    assert two.status["step"] == 60 and two.status["lastCheckpoint"]["step"] == 60
    assert "pod tiny-1 failed (exit code 1)" in two.status["message"]
