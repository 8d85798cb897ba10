"""Warm spares (`faultTolerance.spares`): standby pods, takeover at no budget, replacements that
wait for the next launcher round (decisions/hangs.py, decisions/recovery.py)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from rtj_operator.intents import DeletePod
from rtj_operator.observed import NodeLiveness, Observed, RankSample
from unit.decisions_builders import T0, created, decide, job, rendezvous, trainer, world

pytestmark = pytest.mark.unit


def spare_job(status: dict[str, Any] | None = None, **ft: Any) -> Any:
    return job(status, faultTolerance={"inProcessRestart": "Enabled", "spares": 1, **ft})


def three(**phases: str) -> Observed:
    """Pods 0 and 1 (active) and 2 (the spare)."""
    return world(*(trainer(i, phases.get(f"p{i}", "Running")) for i in range(3)),
                 rdzv=rendezvous())


def scraped(observed: Observed, at: Any, *, standby: set[int], step: int = 10,
            silent: frozenset[int] = frozenset()) -> dict[int, NodeLiveness]:
    """Every pod's ranks answered: beats and steps from the active ones, `standby` from spares."""
    result = {}
    for index, pod in observed.trainer_pods.items():
        if index in silent or pod.phase != "Running":
            continue
        spare = index in standby
        samples = tuple(
            RankSample(local_rank=r, rank=None if spare else index * 2 + r,
                       heartbeat=None if spare else at.timestamp(),
                       step=None if spare else step, standby=spare)
            for r in range(2))
        result[index] = NodeLiveness(node_index=index, pod_uid=pod.uid, samples=samples,
                                     expected_ranks=2)
    return result


def test_a_job_with_a_spare_creates_one_pod_more_and_tells_the_trainers() -> None:
    one = decide(spare_job(), world(rdzv=rendezvous()))
    assert sorted(created(one)) == ["Pod/tiny-0", "Pod/tiny-1", "Pod/tiny-2"]
    assert one.status["spares"] == {"desired": 1, "ready": 0, "waiting": []}


def test_a_waiting_spare_is_standby_and_never_hung() -> None:
    observed = three()
    hours_later = T0 + timedelta(hours=3)
    d = decide(spare_job(), observed, now=hours_later,
               liveness=scraped(observed, hours_later, standby={2}))
    assert d.status["state"] == "Running"
    assert [r["state"] for r in d.status["ranks"]] == ["Running", "Running", "Standby"]
    assert d.status["spares"] == {"desired": 1, "ready": 1, "waiting": []}
    assert d.status["nodes"] == "2/2"
    assert not d.of_type(DeletePod)


def test_a_lost_pod_is_taken_over_by_the_spare_at_no_budget() -> None:
    before = three()
    first = decide(spare_job(), before, liveness=scraped(before, T0, standby={2}))
    later = T0 + timedelta(seconds=30)
    lost = three(p1="Failed")
    second = decide(spare_job(), lost, now=later,
                    liveness=scraped(lost, later, standby={2}), memory=first.memory)
    incident = second.status["incidents"][-1]
    assert (incident["cause"], incident["action"], incident["nodeIndex"]) == (
        "PodFailed", "SpareTakeover", 1)
    # Gone for good (Failed): deleted at once; the new pod 1 comes with the next pass.
    assert [(a.name, a.force) for a in second.of_type(DeletePod)] == [("tiny-1", True)]
    assert created(second) == []
    assert second.status["restarts"]["rank"] == 0 and second.status["restarts"]["spare"] == 1
    assert second.status["spares"]["waiting"] == [1]
    assert any(e.reason == "SpareTakeover" for e in second.events)

    # The replacement for node 1 waits for the next launcher round: standby, never hung; the
    # former spare now trains and beats.
    again = world(trainer(0), trainer(1, attempt=1), trainer(2), rdzv=rendezvous())
    much_later = later + timedelta(hours=1)
    third = decide(spare_job(), again, now=much_later, memory=second.memory,
                   liveness=scraped(again, much_later, standby=set(), step=500,
                                    silent=frozenset({1})))
    assert [r["state"] for r in third.status["ranks"]] == ["Running", "Standby", "Running"]
    assert third.status["state"] == "Running"
    assert third.status["spares"] == {"desired": 1, "ready": 0, "waiting": [1]}
    assert not third.of_type(DeletePod)


def test_without_a_ready_spare_a_lost_pod_spends_the_rank_budget() -> None:
    lost = three(p1="Failed")
    d = decide(spare_job(), lost, liveness=scraped(lost, T0, standby=set(), silent=frozenset({2})))
    assert d.status["incidents"][-1]["action"] == "RankRestart"
    assert d.status["restarts"]["rank"] == 1


def test_a_lost_spare_is_replaced_at_no_budget() -> None:
    before = three()
    first = decide(spare_job(), before, liveness=scraped(before, T0, standby={2}))
    lost = three(p2="Failed")
    second = decide(spare_job(), lost, liveness=scraped(lost, T0, standby={2}),
                    memory=first.memory)
    assert second.status["incidents"][-1]["action"] == "SpareReplace"
    assert [a.name for a in second.of_type(DeletePod)] == ["tiny-2"]
    assert second.status["restarts"]["rank"] == 0


def test_the_job_succeeds_without_the_replacement_that_never_joined() -> None:
    status = {"spares": {"desired": 1, "ready": 0, "waiting": [1]}}
    done = world(trainer(0, "Succeeded", exit_code=0), trainer(1, attempt=1),
                 trainer(2, "Succeeded", exit_code=0), rdzv=rendezvous())
    d = decide(spare_job(status), done)
    assert d.status["state"] == "Succeeded"
    assert sorted(a.name for a in d.of_type(DeletePod)) == ["tiny-1", "tiny-rdzv"]


def test_spares_need_in_process_restart() -> None:
    with pytest.raises(ValueError, match="spares needs in-process restart"):
        job(faultTolerance={"inProcessRestart": "Disabled", "spares": 1})


def test_spares_with_a_teams_own_command_need_in_process_restart_enabled() -> None:
    """`Auto` is on for the built-in trainer only: a script of a team's own runs NVRx's
    in-process wrapper only if it says so."""
    with pytest.raises(ValueError, match="a command other than the built-in trainer"):
        job(command=["python", "train.py"], faultTolerance={"spares": 1})
    assert job(command=["python", "train.py"],
               faultTolerance={"spares": 1, "inProcessRestart": "Enabled"})


def test_a_pending_replacement_does_not_switch_off_hang_detection() -> None:
    status = {"spares": {"desired": 1, "ready": 0, "waiting": [1]}}
    much_later = T0 + timedelta(hours=1)
    # The replacement was created a minute ago: within podStartTimeoutSeconds.
    observed = world(trainer(0), trainer(1, "Pending", attempt=1,
                                         created_at=much_later - timedelta(minutes=1)),
                     trainer(2), rdzv=rendezvous())
    # Pod 2 beats now; pod 0's last beat is an hour old.
    stale = scraped(observed, T0, standby=set(), step=500)
    fresh = scraped(observed, much_later, standby=set(), step=500)
    d = decide(spare_job(status), observed, now=much_later, liveness={0: stale[0], 2: fresh[2]})
    incident = d.status["incidents"][-1]
    assert (incident["cause"], incident["nodeIndex"]) == ("HeartbeatTimeout", 0)
    assert d.status["ranks"][1]["state"] == "Pending"
