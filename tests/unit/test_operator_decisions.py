"""The decision table: what one reconcile pass does for each situation a job can be in.

`decide` is pure, so each case builds the job, the children the API server would return, the
scraped rank metrics and the clock, and checks the actions and the status. Passes are chained by
feeding a decision's `memory` into the next call, as the operator does.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from rtj_operator import decisions as d
from rtj_operator.api.models import parse_job
from rtj_operator.config import OperatorSettings
from rtj_operator.podplan import plan_for
from rtj_operator.views import ClaimView, NodeLiveness, Observed, PodView, RankSample

pytestmark = pytest.mark.unit

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
SETTINGS = OperatorSettings()
NAME = "tiny"


def job(status: dict[str, Any] | None = None, **spec: Any) -> Any:
    ft = {"heartbeatTimeoutSeconds": 20, "initialHeartbeatTimeoutSeconds": 60,
          "progressTimeoutSeconds": 120, "rankRestartBudget": {"max": 2, "windowSeconds": 600},
          "fullRestartBudget": {"max": 1, "windowSeconds": 600}}
    ft.update(spec.pop("faultTolerance", {}))
    body: dict[str, Any] = {
        "apiVersion": "training.resilient.dev/v1alpha1",
        "kind": "ResilientTrainingJob",
        "metadata": {"name": NAME, "namespace": "ns", "uid": "job-uid", "generation": 3},
        "spec": {"nodes": 2, "procsPerNode": 2, "image": "img",
                 "checkpoint": {"claimName": "ckpt"}, "faultTolerance": ft, **spec},
    }
    if status is not None:
        body["status"] = status
    return parse_job(body)


def trainer(index: int, phase: str = "Running", *, attempt: int = 0, exit_code: int | None = None,
            deleting: bool = False, started: datetime = T0) -> PodView:
    return PodView(
        name=f"{NAME}-{index}", uid=f"uid-{index}-{attempt}", role="trainer", node_index=index,
        attempt=attempt, phase=phase, deleting=deleting, exit_code=exit_code,
        started_at=started if phase != "Pending" else None,
        finished_at=started + timedelta(seconds=30) if exit_code is not None else None,
        node_name=f"node-{index}", pod_ip=f"127.1.0.{index + 2}",
    )


def rendezvous(phase: str = "Running", deleting: bool = False) -> PodView:
    return PodView(name=f"{NAME}-rdzv", uid="uid-rdzv", role="rendezvous", phase=phase,
                   deleting=deleting, started_at=T0)


def world(*pods: PodView, rdzv: PodView | None = None, claim: ClaimView | None = None,
          services: bool = True) -> Observed:
    return Observed(
        trainer_pods={p.node_index: p for p in pods if p.node_index is not None},
        rendezvous_pod=rdzv, rendezvous_service=services, headless_service=services,
        claim=claim,
    )


def running_world(attempts: tuple[int, int] = (0, 0), started: datetime = T0) -> Observed:
    return world(trainer(0, attempt=attempts[0], started=started),
                 trainer(1, attempt=attempts[1], started=started), rdzv=rendezvous())


def beats(at: datetime, step: int = 10, *, pods: Observed | None = None,
          committed: int | None = None, goodput: float | None = None,
          restarts: dict[str, int] | None = None) -> dict[int, NodeLiveness]:
    """Every rank of every pod answered with a heartbeat at `at` and step `step`."""
    observed = pods or running_world()
    result = {}
    for index, pod in observed.trainer_pods.items():
        samples = tuple(
            RankSample(local_rank=r, rank=index * 2 + r, heartbeat=at.timestamp(), step=step,
                       committed_step=committed,
                       committed_time=at.timestamp() if committed is not None else None,
                       goodput_ratio=goodput, restarts=restarts or {})
            for r in range(2)
        )
        result[index] = NodeLiveness(node_index=index, pod_uid=pod.uid, samples=samples,
                                     expected_ranks=2)
    return result


def decide(j: Any, observed: Observed, *, now: datetime = T0, liveness: Any = None,
           memory: d.Memory | None = None) -> d.Decision:
    decision = d.decide(job=j, plan=plan_for(j, SETTINGS), observed=observed,
                        liveness=liveness or {}, now=now, memory=memory or d.Memory(),
                        settings=SETTINGS)
    d.status_model(decision.status)  # every status we write is valid for the API
    return decision


def created(decision: d.Decision) -> list[str]:
    return [f"{a.kind}/{a.name}" for a in decision.of_type(d.CreateObject)]


def deleted(decision: d.Decision) -> list[str]:
    return [a.name for a in decision.of_type(d.DeletePod)]


def events(decision: d.Decision) -> list[str]:
    return [e.reason for e in decision.of_type(d.PostEvent)]


def condition(decision: d.Decision, kind: str) -> dict[str, Any]:
    return next(c for c in decision.status["conditions"] if c["type"] == kind)


def then(previous: d.Decision, j: Any, observed: Observed, **kwargs: Any) -> d.Decision:
    """The next pass, remembering what the previous one decided."""
    return decide(j, observed, memory=previous.memory, **kwargs)


def running(j: Any | None = None, now: datetime = T0 + timedelta(seconds=30)) -> d.Decision:
    """A job whose two pods run and heartbeat."""
    j = j or job()
    first = decide(j, world())
    return then(first, j, running_world(), now=now, liveness=beats(now))


# --- creation -----------------------------------------------------------------------------------


def test_a_new_job_gets_services_a_rendezvous_pod_and_every_trainer_pod() -> None:
    decision = decide(job(), world(services=False))
    assert created(decision) == [
        "Service/tiny", "Service/tiny-rdzv", "Pod/tiny-rdzv", "Pod/tiny-0", "Pod/tiny-1",
    ]
    pod = decision.of_type(d.CreateObject)[3].manifest
    assert pod["metadata"]["labels"]["training.resilient.dev/attempt"] == "0"
    assert decision.status["state"] == "Pending"
    assert decision.status["nodes"] == "0/2"
    assert [r["state"] for r in decision.status["ranks"]] == ["Pending", "Pending"]
    assert decision.status["startTime"] == "2026-11-29T12:00:00Z"
    assert events(decision).count("Created") == 5


def test_a_dynamic_checkpoint_volume_becomes_a_claim_owned_by_the_job() -> None:
    j = job(checkpoint={"storageClassName": "fsx", "size": "100Gi"})
    decision = decide(j, world())
    claim = next(a for a in decision.of_type(d.CreateObject) if a.kind == "PersistentVolumeClaim")
    assert claim.name == "tiny-checkpoints"
    assert claim.manifest["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim.manifest["spec"]["storageClassName"] == "fsx"
    assert claim.manifest["metadata"]["ownerReferences"][0]["uid"] == "job-uid"


def test_a_claim_with_retain_policy_is_released_from_the_job() -> None:
    j = job(checkpoint={"storageClassName": "fsx", "size": "100Gi",
                        "claimDeletePolicy": "Retain"})
    decision = decide(j, world(claim=ClaimView(name="tiny-checkpoints", owned_by_job=True)))
    assert decision.of_type(d.SetClaimOwner) == [d.SetClaimOwner("tiny-checkpoints", None)]
    assert "ClaimDeletePolicy" in events(decision)


def test_an_existing_claim_is_never_created() -> None:
    decision = decide(job(), world())
    assert not [a for a in decision.of_type(d.CreateObject) if a.kind != "Pod"]


def test_pods_that_exist_are_not_created_again() -> None:
    j = job()
    first = decide(j, world())
    second = then(first, j, world(trainer(0, "Pending"), trainer(1, "Pending"),
                                  rdzv=rendezvous("Pending")))
    assert second.actions == []
    assert second.status["state"] == "Pending"
    assert second.status["reason"] == d.REASON_CREATING


def test_running_pods_without_heartbeats_wait_for_them() -> None:
    j = job()
    first = decide(j, world())
    second = then(first, j, running_world(), now=T0 + timedelta(seconds=10))
    assert [r["state"] for r in second.status["ranks"]] == ["Starting", "Starting"]
    assert second.status["reason"] == d.REASON_STARTING
    assert condition(second, "Ready")["status"] == "False"


def test_a_job_is_running_once_every_rank_heartbeats() -> None:
    now = T0 + timedelta(seconds=30)
    first = decide(job(), world())
    decision = then(first, job(), running_world(), now=now,
                    liveness=beats(now, step=42, committed=40, goodput=0.931))
    status = decision.status
    assert status["state"] == "Running"
    assert status["nodes"] == "2/2" and status["nodesReady"] == 2
    assert status["step"] == 42
    assert status["lastCheckpoint"] == {"step": 40, "time": "2026-11-29T12:00:30Z"}
    assert status["goodput"] == "93.1%"
    assert condition(decision, "Running")["status"] == "True"
    assert condition(decision, "Ready")["status"] == "True"
    assert condition(decision, "Ready")["observedGeneration"] == 3
    assert [r["state"] for r in status["ranks"]] == ["Running", "Running"]
    assert status["ranks"][1]["node"] == "node-1"
    assert "Running" in events(decision)


def test_a_rank_missing_one_local_rank_is_not_ready() -> None:
    now = T0 + timedelta(seconds=30)
    live = beats(now)
    live[1] = replace(live[1], samples=live[1].samples[:1])
    first = decide(job(), world())
    decision = then(first, job(), running_world(), now=now, liveness=live)
    assert decision.status["nodes"] == "1/2"
    assert decision.status["state"] == "Pending"


def test_condition_transition_times_move_only_when_the_status_flips() -> None:
    j = job()
    one = running(j)
    later = T0 + timedelta(seconds=60)
    two = then(one, j, running_world(), now=later, liveness=beats(later))
    assert condition(two, "Running")["lastTransitionTime"] == \
        condition(one, "Running")["lastTransitionTime"] == "2026-11-29T12:00:30Z"
    assert "Running" not in events(two)


# --- rank restarts ------------------------------------------------------------------------------


def test_a_failed_pod_is_replaced_alone() -> None:
    j = job()
    one = running(j)
    now = T0 + timedelta(seconds=60)
    failed = world(trainer(0), trainer(1, "Failed", exit_code=1), rdzv=rendezvous())
    two = then(one, j, failed, now=now, liveness=beats(now, pods=failed))
    assert two.of_type(d.DeletePod) == [d.DeletePod("tiny-1", "uid-1-0")]
    assert created(two) == []
    incident = two.status["incidents"][-1]
    assert incident["cause"] == d.CAUSE_POD_FAILED and incident["action"] == "RankRestart"
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
    pod = three.of_type(d.CreateObject)[0].manifest
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


def test_a_pod_that_is_still_terminating_is_not_recreated_yet() -> None:
    j = job()
    one = running(j)
    failed = world(trainer(0), trainer(1, "Failed", exit_code=1), rdzv=rendezvous())
    two = then(one, j, failed, now=T0 + timedelta(seconds=60))
    terminating = world(trainer(0), trainer(1, "Failed", exit_code=1, deleting=True),
                        rdzv=rendezvous())
    three = then(two, j, terminating, now=T0 + timedelta(seconds=62))
    assert three.actions == []
    assert three.status["ranks"][1]["state"] == "Restarting"


def test_a_vanished_pod_is_recreated_at_once() -> None:
    j = job()
    one = running(j)
    two = then(one, j, world(trainer(0), rdzv=rendezvous()), now=T0 + timedelta(seconds=60))
    assert created(two) == ["Pod/tiny-1"]
    assert two.status["incidents"][-1]["cause"] == d.CAUSE_POD_VANISHED
    assert two.status["ranks"][1]["attempt"] == 1


def test_a_pod_deleted_by_someone_else_counts_as_a_fault() -> None:
    j = job()
    one = running(j)
    observed = world(trainer(0), trainer(1, deleting=True), rdzv=rendezvous())
    two = then(one, j, observed, now=T0 + timedelta(seconds=60))
    assert two.of_type(d.DeletePod) == []
    assert two.status["incidents"][-1]["cause"] == d.CAUSE_POD_DELETED
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
    assert three.status["reason"] == d.REASON_BUDGET
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
    four = then(three, j, world(), now=T0 + timedelta(seconds=66))
    assert created(four) == ["Pod/tiny-rdzv", "Pod/tiny-0", "Pod/tiny-1"]
    attempts = [a.manifest["metadata"]["labels"]["training.resilient.dev/attempt"]
                for a in four.of_type(d.CreateObject)[1:]]
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
    assert two.status["incidents"][-1]["cause"] == d.CAUSE_RENDEZVOUS_LOST
    assert created(two) == []


def test_a_failed_rendezvous_pod_is_deleted_with_the_trainers() -> None:
    j = job()
    one = running(j)
    two = then(one, j, world(trainer(0), trainer(1), rdzv=rendezvous("Failed")),
               now=T0 + timedelta(seconds=60))
    assert sorted(deleted(two)) == ["tiny-0", "tiny-1", "tiny-rdzv"]


# --- hangs --------------------------------------------------------------------------------------


def test_a_rank_without_heartbeat_past_both_timeouts_is_replaced() -> None:
    j = job()
    one = running(j)  # heartbeats at T0+30
    now = T0 + timedelta(seconds=30 + 20 + 60 + 1)
    live = beats(now)
    live[1] = beats(T0 + timedelta(seconds=30))[1]  # node 1 stuck at its old heartbeat
    two = then(one, j, running_world(), now=now, liveness=live)
    assert deleted(two) == ["tiny-1"]
    assert two.status["incidents"][-1]["cause"] == d.CAUSE_HEARTBEAT_TIMEOUT


def test_a_stale_heartbeat_within_the_launcher_grace_is_left_to_ft_launcher() -> None:
    j = job()
    one = running(j)
    now = T0 + timedelta(seconds=30 + 70)
    live = beats(now)
    live[1] = beats(T0 + timedelta(seconds=30))[1]
    two = then(one, j, running_world(), now=now, liveness=live)
    assert two.of_type(d.DeletePod) == []
    assert two.status["nodes"] == "1/2"


def test_an_unreachable_rank_keeps_its_last_heartbeat_and_times_out() -> None:
    j = job()
    one = running(j)
    now = T0 + timedelta(seconds=30 + 81)
    live = beats(now)
    del live[0]  # node 0's endpoints do not answer any more
    two = then(one, j, running_world(), now=now, liveness=live)
    assert deleted(two) == ["tiny-0"]


def test_a_pod_that_never_heartbeats_times_out_after_start() -> None:
    j = job()
    first = decide(j, world())
    two = then(first, j, running_world(), now=T0 + timedelta(seconds=79))
    assert two.of_type(d.DeletePod) == []
    three = then(two, j, running_world(), now=T0 + timedelta(seconds=81))
    assert sorted(deleted(three)) == ["tiny-0", "tiny-1", "tiny-rdzv"]  # both: a full restart


def test_no_hang_is_declared_while_a_pod_is_still_pending() -> None:
    j = job()
    first = decide(j, world())
    pending = world(trainer(0), trainer(1, "Pending"), rdzv=rendezvous())
    two = then(first, j, pending, now=T0 + timedelta(seconds=3000))
    assert two.of_type(d.DeletePod) == []


def test_a_stalled_step_restarts_the_job() -> None:
    j = job()
    one = running(j)  # step 10 at T0+30
    mid = T0 + timedelta(seconds=100)
    two = then(one, j, running_world(), now=mid, liveness=beats(mid, step=10))
    assert two.of_type(d.DeletePod) == []
    now = T0 + timedelta(seconds=30 + 121)
    three = then(two, j, running_world(), now=now, liveness=beats(now, step=10))
    assert sorted(deleted(three)) == ["tiny-0", "tiny-1", "tiny-rdzv"]
    assert three.status["incidents"][-1]["cause"] == d.CAUSE_PROGRESS_TIMEOUT


def test_an_advancing_step_is_not_a_stall() -> None:
    j = job()
    one = running(j)
    now = T0 + timedelta(seconds=30 + 121)
    two = then(one, j, running_world(), now=now, liveness=beats(now, step=11))
    assert two.of_type(d.DeletePod) == []


def test_a_single_lagging_node_is_replaced_alone_on_a_stall() -> None:
    j = job()
    one = running(j)
    now = T0 + timedelta(seconds=30 + 121)
    live = beats(now, step=12)
    live[1] = beats(now, step=10)[1]
    two = then(one, j, running_world(), now=now, liveness=live)
    assert deleted(two) == ["tiny-1"]


# --- permanent failures and completion ------------------------------------------------------------


@pytest.mark.parametrize("code", [93, 42])
def test_a_non_retryable_exit_code_fails_the_job(code: int) -> None:
    j = job(faultTolerance={"nonRetryableExitCodes": [42]})
    one = running(j)
    two = then(one, j, world(trainer(0), trainer(1, "Failed", exit_code=code),
                             rdzv=rendezvous()), now=T0 + timedelta(seconds=60))
    assert two.status["state"] == "Failed"
    assert two.status["reason"] == d.REASON_NON_RETRYABLE
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
    assert two.actions == [] or not two.of_type(d.DeletePod)
    assert two.status["state"] != "Succeeded"


def test_success_next_to_a_failure_is_a_partial_completion() -> None:
    j = job()
    one = running(j)
    mixed = world(trainer(0, "Succeeded", exit_code=0), trainer(1, "Failed", exit_code=1),
                  rdzv=rendezvous())
    two = then(one, j, mixed, now=T0 + timedelta(seconds=90))
    assert two.status["state"] == "Failed"
    assert two.status["reason"] == d.REASON_PARTIAL


def test_the_deadline_fails_the_job() -> None:
    j = job(activeDeadlineSeconds=100)
    one = running(j)
    two = then(one, j, running_world(), now=T0 + timedelta(seconds=100))
    assert two.status["state"] == "Failed"
    assert two.status["reason"] == d.REASON_DEADLINE
    assert sorted(deleted(two)) == ["tiny-0", "tiny-1", "tiny-rdzv"]


def _finished(j: Any, state: str, completion: datetime) -> d.Decision:
    status = {"state": state, "completionTime": completion.strftime("%Y-%m-%dT%H:%M:%SZ"),
              "ranks": [], "conditions": []}
    return decide(job(status=status, **j), world(trainer(0, "Succeeded", exit_code=0),
                                                 trainer(1, "Succeeded", exit_code=0)),
                  now=completion + timedelta(seconds=50))


def test_a_finished_job_is_deleted_after_its_ttl() -> None:
    assert _finished({"ttlSecondsAfterFinished": 60}, "Succeeded", T0).actions == []
    late = _finished({"ttlSecondsAfterFinished": 30}, "Succeeded", T0)
    assert late.of_type(d.DeleteJob) == [d.DeleteJob()]
    assert "Deleted" in events(late)


def test_a_finished_job_without_ttl_is_kept() -> None:
    assert _finished({}, "Failed", T0 - timedelta(days=3)).actions == []


def test_a_failed_job_stops_pods_that_still_run() -> None:
    j = job(status={"state": "Failed", "completionTime": "2026-11-29T12:00:00Z"})
    decision = decide(j, running_world())
    assert sorted(deleted(decision)) == ["tiny-0", "tiny-1", "tiny-rdzv"]
    assert decision.status["state"] == "Failed"


# --- suspend ------------------------------------------------------------------------------------


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
    assert not resumed.of_type(d.CreateObject) and not resumed.of_type(d.DeletePod)


# --- restarts inside the pods -------------------------------------------------------------------


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
        changes = [a for a in decision.actions if not isinstance(a, d.PostEvent)]
        assert changes and len(decision.of_type(d.PostEvent)) >= len(changes)
