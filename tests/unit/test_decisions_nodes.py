"""Lost nodes, bad nodes and pods that never start (issue 11 items 1-3; review C1, C3, C7):
`NodeLost` with force deletion, per-pod heartbeat clocks, `status.excludedNodes` with the
anti-affinity of later pods, `podStartTimeoutSeconds` and the `PodsNotStarting` condition.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

import pytest
from rtj_operator.api.status import MAX_EXCLUDED_NODES
from rtj_operator.api.vocabulary import IncidentCause, RecoveryAction
from rtj_operator.intents import CreateObject, DeletePod
from unit.decisions_builders import (
    LOST_NODE,
    T0,
    Outcome,
    answering,
    beats,
    condition,
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
from unit.test_decisions_spares import scraped, spare_job

pytestmark = pytest.mark.unit

AFTER = T0 + timedelta(seconds=30)  # `running()` saw every rank beat at this moment


def deletes(decision: Outcome) -> list[tuple[str, bool]]:
    """(pod, force) of every DeletePod."""
    return [(a.name, a.force) for a in decision.of_type(DeletePod)]


def trainer_created(decision: Outcome, index: int) -> dict[str, Any]:
    name = f"tiny-{index}"
    return next(a.manifest for a in decision.of_type(CreateObject) if a.name == name)


def avoided(pod: dict[str, Any]) -> list[str]:
    """The nodes a pod manifest's preferred node anti-affinity avoids."""
    terms = pod["spec"]["affinity"]["nodeAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    return [v for t in terms for f in t["preference"].get("matchFields", []) for v in f["values"]]


# --- item 1: a partitioned or NotReady node -----------------------------------------------------


def test_a_pod_deleting_for_ever_on_an_unreachable_node_is_force_deleted_and_replaced() -> None:
    # Review C1 repro: taint eviction set a deletionTimestamp, the kubelet never confirms. The
    # operator used to wait for ever (no action at +1 h, +6 h, +24 h).
    j = job()
    one = running(j)
    later = AFTER + timedelta(hours=1)
    lost = world(trainer(0), trainer(1, deleting=True, **LOST_NODE), rdzv=rendezvous())
    two = then(one, j, lost, now=later, liveness={0: beats(later)[0]})
    assert deletes(two) == [("tiny-1", True)]
    incident = two.status["incidents"][-1]
    assert (incident["cause"], incident["nodeIndex"], incident["action"]) == (
        IncidentCause.NODE_LOST, 1, RecoveryAction.RANK_RESTART)
    assert "node node-1" in incident["message"]
    assert "ForceDeletedPod" in events(two)
    # Its name is free: rule 8 recreates it elsewhere.
    gone = world(trainer(0), rdzv=rendezvous())
    three = then(two, j, gone, now=later + timedelta(seconds=3), liveness={0: beats(later)[0]})
    assert avoided(trainer_created(three, 1)) == ["node-1"]


@pytest.mark.parametrize(
    ("view", "lost"),
    [
        ({"node_ready": "Unknown", "node_unreachable": True}, True),
        ({"node_ready": "False", "node_unreachable": True}, True),  # not-ready taint
        ({"node_ready": "False", "node_unreachable": False}, False),  # not tainted (yet)
        ({"node_ready": "True", "node_unreachable": True}, False),  # Ready again
        ({"node_ready": None, "node_unreachable": False}, False),  # nodes cannot be read
    ],
)
def test_a_node_is_lost_only_when_not_ready_and_tainted(view: dict[str, Any], lost: bool) -> None:
    j = job()
    one = running(j)
    later = AFTER + timedelta(seconds=25)  # past heartbeatTimeoutSeconds, not past + initial
    observed = world(trainer(0), trainer(1, **view), rdzv=rendezvous())
    two = then(one, j, observed, now=later, liveness={0: beats(later)[0]})
    assert deletes(two) == ([("tiny-1", True)] if lost else [])


def test_no_pod_is_lost_while_every_node_is_not_ready_and_the_job_says_why() -> None:
    """Every node NotReady at once (`NodeCache.disruption`): the pods on them are not force-
    deleted, nor is the rendezvous pod, and the job shows `ObservationDegraded` with the
    reason; once the disruption is over the same pod is lost as before."""
    j = job()
    one = running(j)
    later = AFTER + timedelta(seconds=60)  # past heartbeatTimeoutSeconds + initial
    lost = world(trainer(0, **LOST_NODE), trainer(1, **LOST_NODE),
                 rdzv=rendezvous(**LOST_NODE))
    why = "every node (3) is NotReady at once since 2026-12-05T04:27:00Z"
    disrupted = dataclasses.replace(lost, nodes_disrupted=why)
    two = then(one, j, disrupted, now=later, liveness={})
    assert deletes(two) == []
    assert not two.status.get("incidents")
    degraded = condition(two, "ObservationDegraded")
    assert degraded["status"] == "True" and why in degraded["message"]
    assert deletes(then(one, j, lost, now=later, liveness={})) != []  # without it: lost


def test_a_pod_on_a_lost_node_that_still_beats_is_left_alone() -> None:
    # Its processes still run: a second pod of its name would join the job beside them.
    j = job()
    one = running(j)
    later = AFTER + timedelta(seconds=25)
    observed = world(trainer(0), trainer(1, deleting=True, **LOST_NODE), rdzv=rendezvous())
    two = then(one, j, observed, now=later, liveness=beats(later))
    assert deletes(two) == []


@pytest.mark.parametrize(("peer_step", "fenced"), [(20, True), (11, False), (10, False)])
def test_a_pod_on_a_lost_node_whose_peers_train_on_is_not_force_deleted(
    peer_step: int, fenced: bool
) -> None:
    """review-2 F6: the node is cut off from the control plane (NotReady, tainted, no heartbeat
    reaches the operator) but not from its peers. Pod 1 last reported step 10; pod 0 has
    completed step 20 since: in synchronous training no step completes without pod 1's ranks,
    so pod 1 still trains. Force-deleting it would start a second `tiny-1` that waits beside it
    in a rendezvous nobody opens, is declared hung, and costs budget and a healthy node. Only
    one step of slack (the step in flight) counts as no word."""
    j = job()
    one = running(j)  # every rank at step 10
    later = AFTER + timedelta(seconds=60)  # past heartbeatTimeoutSeconds
    observed = world(trainer(0), trainer(1, **LOST_NODE), rdzv=rendezvous())
    two = then(one, j, observed, now=later, liveness={0: beats(later, step=peer_step)[0]})
    assert deletes(two) == ([] if fenced else [("tiny-1", True)])
    causes = [i["cause"] for i in two.status.get("incidents") or []]
    assert (IncidentCause.NODE_LOST in causes) is not fenced


def test_peers_stuck_past_the_pods_last_report_are_no_word() -> None:
    """The campaign of 2026-12-05: pod 1 froze with its node at step 14, last read at step 10;
    pod 0 completed steps up to 14 with it, then waited in a collective, its heartbeats stopped
    too. Its step stands past pod 1's last report, but it does not train on: pod 1 is lost
    (was: held until a HeartbeatTimeout replaced pod 0, ~290 s)."""
    j = job()
    one = running(j)  # every rank at step 10
    later = AFTER + timedelta(seconds=60)  # past heartbeatTimeoutSeconds (20)
    stuck = {0: dataclasses.replace(beats(AFTER + timedelta(seconds=5), step=14)[0],
                                    read_time=later.timestamp())}
    observed = world(trainer(0), trainer(1, **LOST_NODE), rdzv=rendezvous())
    two = then(one, j, observed, now=later, liveness=stuck)
    assert ("tiny-1", True) in deletes(two)
    causes = [i["cause"] for i in two.status.get("incidents") or []]
    assert IncidentCause.NODE_LOST in causes


def test_the_peers_word_needs_every_peer() -> None:
    # Without a word from the peers (pod 0 silent too), the lost pod is force-deleted as before.
    j = job()
    one = running(j)
    later = AFTER + timedelta(seconds=60)
    observed = world(trainer(0), trainer(1, **LOST_NODE), rdzv=rendezvous())
    assert deletes(then(one, j, observed, now=later, liveness={})) == [("tiny-1", True)]


@pytest.mark.parametrize(("spare", "fenced"), [
    ("standby", True),  # the spare still waits: pod 1's ranks are the ones missing
    ("took over", False),  # the spare trains in pod 1's ranks: pod 1 left the world
    ("silent", False),  # no word from every peer
])
def test_the_peers_word_holds_in_a_job_with_warm_spares(spare: str, fenced: bool) -> None:
    """review-2 F6 for warm spares (was: no fence at all with spares). Pod 1's node is lost to
    the control plane; pod 0 completed step 20 since pod 1 last reported step 10. With the
    spare (pod 2) still standby, the world (2 pods x 2 ranks) is pod 0's ranks plus pod 1's:
    pod 1 trains. Once the spare reports its ranks training, the peers fill the world and pod 1
    may be force-deleted."""
    before = world(trainer(0), trainer(1), trainer(2), rdzv=rendezvous())
    first = decide(spare_job(), before, liveness=scraped(before, T0, standby={2}))
    later = T0 + timedelta(seconds=60)  # past heartbeatTimeoutSeconds (20)
    lost = world(trainer(0), trainer(1, **LOST_NODE), trainer(2), rdzv=rendezvous())
    live = scraped(lost, later, step=20, silent=frozenset({1}),
                   standby={2} if spare == "standby" else set())
    if spare == "silent":
        del live[2]
    second = decide(spare_job(), lost, now=later, memory=first.memory, liveness=live)
    assert (("tiny-1", True) in deletes(second)) is not fenced, deletes(second)
    causes = [i["cause"] for i in second.status.get("incidents") or []]
    assert (IncidentCause.NODE_LOST in causes) is not fenced


def test_a_pod_on_a_lost_node_whose_last_read_is_old_is_force_deleted() -> None:
    """A pod deleted while its node is partitioned is not read any more (Terminating, frozen):
    the job's loop keeps its last read, fresh when it was taken. That read is no evidence that
    the pod still runs a minute later: once it is older than heartbeatTimeoutSeconds, the pod
    is lost and force-deleted (e2e test_a_pod_deleted_while_its_node_is_partitioned...)."""
    j = job()
    one = running(j)
    later = AFTER + timedelta(seconds=60)
    live = beats(later)
    live[1] = dataclasses.replace(beats(AFTER)[1], read_time=AFTER.timestamp())
    observed = world(trainer(0), trainer(1, deleting=True, **LOST_NODE), rdzv=rendezvous())
    two = then(one, j, observed, now=later, liveness=live)
    assert ("tiny-1", True) in deletes(two)


def test_a_pod_being_replaced_on_a_node_lost_since_is_force_deleted_without_a_new_fault() -> None:
    j = job()
    one = running(j)
    hung = AFTER + timedelta(seconds=81)
    live = {0: beats(hung)[0], 1: beats(AFTER)[1]}
    two = then(one, j, world(trainer(0), trainer(1), rdzv=rendezvous()), now=hung, liveness=live)
    assert deletes(two) == [("tiny-1", False)]  # graceful: its node was fine then
    stuck = world(trainer(0), trainer(1, deleting=True, **LOST_NODE), rdzv=rendezvous())
    three = then(two, j, stuck, now=hung + timedelta(seconds=60),
                 liveness={0: beats(hung + timedelta(seconds=60))[0]})
    assert deletes(three) == [("tiny-1", True)]
    assert len(three.status["incidents"]) == len(two.status["incidents"])
    assert three.status["restarts"]["rank"] == 1


def test_the_rendezvous_pod_on_a_lost_node_restarts_everything_with_force() -> None:
    j = job()
    one = running(j)
    later = AFTER + timedelta(seconds=5)
    observed = world(trainer(0), trainer(1), rdzv=rendezvous(**LOST_NODE))
    two = then(one, j, observed, now=later, liveness=beats(later))
    assert sorted(deletes(two)) == [("tiny-0", False), ("tiny-1", False), ("tiny-rdzv", True)]
    incident = two.status["incidents"][-1]
    assert (incident["cause"], incident["action"]) == (
        IncidentCause.RENDEZVOUS_LOST, RecoveryAction.FULL_RESTART)
    assert "node-r" in incident["message"]
    # Once the trainers are gone, a rendezvous pod still stuck deleting there is forced again.
    rest = world(rdzv=rendezvous(deleting=True, **LOST_NODE))
    three = then(two, j, rest, now=later + timedelta(seconds=3))
    assert deletes(three) == [("tiny-rdzv", True)]


def test_a_lost_pod_goes_to_a_warm_spare_first() -> None:
    before = world(trainer(0), trainer(1), trainer(2), rdzv=rendezvous())
    first = decide(spare_job(), before, liveness=scraped(before, T0, standby={2}))
    later = T0 + timedelta(seconds=30)  # past heartbeatTimeoutSeconds (20)
    lost = world(trainer(0), trainer(1, **LOST_NODE), trainer(2), rdzv=rendezvous())
    second = decide(spare_job(), lost, now=later, memory=first.memory,
                    liveness=scraped(lost, later, standby={2}, silent=frozenset({1})))
    incident = second.status["incidents"][-1]
    assert (incident["cause"], incident["action"], incident["nodeIndex"]) == (
        IncidentCause.NODE_LOST, RecoveryAction.SPARE_TAKEOVER, 1)
    assert deletes(second) == [("tiny-1", True)]
    assert second.status["restarts"]["rank"] == 0


def test_suspending_force_deletes_pods_stuck_on_lost_nodes() -> None:
    j = job()
    one = running(j)
    later = AFTER + timedelta(minutes=5)
    observed = world(trainer(0), trainer(1, deleting=True, **LOST_NODE), rdzv=rendezvous())
    two = then(one, job(suspend=True), observed, now=later)
    assert sorted(deletes(two)) == [("tiny-0", False), ("tiny-1", True), ("tiny-rdzv", False)]


# --- item 1: hang detection per pod -------------------------------------------------------------


def test_a_hung_pod_is_found_while_another_pod_is_being_replaced() -> None:
    # The old job-wide clock was off while any pod was not Running: pod 0 could hang for ever
    # behind a replacement that never finished terminating.
    j = job()
    one = running(j)
    hung = AFTER + timedelta(seconds=81)
    live = {0: beats(hung)[0], 1: beats(AFTER)[1]}
    two = then(one, j, world(trainer(0), trainer(1), rdzv=rendezvous()), now=hung, liveness=live)
    assert deleted(two) == ["tiny-1"]
    terminating = world(trainer(0), trainer(1, deleting=True), rdzv=rendezvous())
    much_later = hung + timedelta(seconds=81)
    three = then(two, j, terminating, now=much_later, liveness={0: beats(hung)[0]})
    incident = three.status["incidents"][-1]
    assert (incident["cause"], incident["nodeIndex"]) == (IncidentCause.HEARTBEAT_TIMEOUT, 0)
    assert deleted(three) == ["tiny-0"]


def test_a_pods_heartbeat_clock_starts_at_its_own_start_or_the_last_recovery() -> None:
    j = job()
    one = running(j)
    # Pod 1 was replaced and its new pod started at +200 s; pod 0 keeps beating.
    new_start = T0 + timedelta(seconds=200)
    observed = world(trainer(0), trainer(1, attempt=1, started=new_start), rdzv=rendezvous())
    before = new_start + timedelta(seconds=79)
    two = then(one, j, observed, now=before, liveness={0: beats(before)[0]})
    assert deletes(two) == []
    assert [r["state"] for r in two.status["ranks"]] == ["Running", "Starting"]
    after = new_start + timedelta(seconds=81)
    three = then(two, j, observed, now=after,
                 liveness={0: beats(after)[0], 1: answering(observed)[1]})
    assert deleted(three) == ["tiny-1"]


# --- item 2: bad nodes --------------------------------------------------------------------------


def test_a_heartbeat_timeout_excludes_the_node_and_the_replacement_avoids_it() -> None:
    j = job()
    one = running(j)
    hung = AFTER + timedelta(seconds=81)
    live = {0: beats(hung)[0], 1: beats(AFTER)[1]}
    two = then(one, j, world(trainer(0), trainer(1), rdzv=rendezvous()), now=hung, liveness=live)
    (excluded,) = two.status["excludedNodes"]
    assert excluded["node"] == "node-1" and excluded["nodeIndex"] == 1
    assert excluded["reason"] == IncidentCause.HEARTBEAT_TIMEOUT
    assert excluded["since"] == "2026-11-29T12:01:51Z"
    assert "no heartbeat" in excluded["message"]
    assert "NodeExcluded" in events(two)
    three = then(two, j, world(trainer(0), rdzv=rendezvous()), now=hung + timedelta(seconds=3),
                 liveness={0: beats(hung)[0]})
    assert avoided(trainer_created(three, 1)) == ["node-1"]
    assert three.status["excludedNodes"] == two.status["excludedNodes"]  # for the job's life


def test_a_failed_pod_does_not_exclude_its_node() -> None:
    # An exit code is the program's fault, not the node's.
    j = job()
    one = running(j)
    failed = world(trainer(0), trainer(1, "Failed", exit_code=1), rdzv=rendezvous())
    two = then(one, j, failed, now=AFTER + timedelta(seconds=5), liveness=beats(AFTER))
    assert deleted(two) == ["tiny-1"]
    assert "excludedNodes" not in two.status


def test_excluded_nodes_are_bounded_and_a_repeat_moves_to_the_end() -> None:
    old = [{"node": f"n-{i}", "reason": "HeartbeatTimeout", "since": "2026-11-29T11:00:00Z"}
           for i in range(MAX_EXCLUDED_NODES - 1)] + [
        {"node": "node-1", "reason": "NodeLost", "since": "2026-11-29T11:00:00Z"}]
    j = job(status={"excludedNodes": old}, faultTolerance={"podStartTimeoutSeconds": 60})
    late = T0 + timedelta(seconds=61)
    stuck = world(trainer(0), trainer(1, "Pending", waiting_reason="CreateContainerError"),
                  rdzv=rendezvous())
    two = decide(j, stuck, now=late)
    nodes = [e["node"] for e in two.status["excludedNodes"]]
    assert len(nodes) == MAX_EXCLUDED_NODES and nodes[-1] == "node-1"
    assert nodes.count("node-1") == 1
    assert two.status["excludedNodes"][-1]["reason"] == IncidentCause.POD_START_TIMEOUT
    # One more node pushes out the oldest.
    elsewhere = world(trainer(0), trainer(1, "Pending", attempt=1, node_name="node-x",
                                         waiting_reason="CreateContainerError"),
                      rdzv=rendezvous())
    three = then(two, j, elsewhere, now=late + timedelta(seconds=61))
    nodes = [e["node"] for e in three.status["excludedNodes"]]
    assert len(nodes) == MAX_EXCLUDED_NODES and nodes[-1] == "node-x" and "n-0" not in nodes


# --- item 3: pods that never start --------------------------------------------------------------


@pytest.mark.parametrize(
    ("view", "reason", "text"),
    [
        ({"node_name": None, "unscheduled_reason": "Unschedulable",
          "unscheduled_message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."},
         "Unschedulable", "Insufficient nvidia.com/gpu"),
        ({"waiting_reason": "ImagePullBackOff",
          "waiting_message": 'Back-off pulling image "img"'}, "ImagePullBackOff", "img"),
        ({"waiting_reason": "CreateContainerConfigError",
          "waiting_message": 'secret "s" not found'}, "CreateContainerConfigError", "secret"),
    ],
)
def test_why_a_pod_does_not_start_shows_at_once(view: dict[str, Any], reason: str,
                                                 text: str) -> None:
    j = job()
    first = decide(j, world())
    observed = world(trainer(0), trainer(1, "Pending", **view), rdzv=rendezvous())
    two = then(first, j, observed, now=T0 + timedelta(seconds=5))
    stuck = condition(two, "PodsNotStarting")
    assert (stuck["status"], stuck["reason"]) == ("True", reason)
    assert "tiny-1" in stuck["message"] and text in stuck["message"]
    assert deletes(two) == []


def test_a_container_being_created_is_not_a_problem_until_the_deadline() -> None:
    j = job(faultTolerance={"podStartTimeoutSeconds": 300})
    first = decide(j, world())
    observed = world(trainer(0), trainer(1, "Pending", waiting_reason="ContainerCreating"),
                     rdzv=rendezvous())
    two = then(first, j, observed, now=T0 + timedelta(seconds=60))
    assert condition(two, "PodsNotStarting")["status"] == "False"
    three = then(two, j, observed, now=T0 + timedelta(seconds=301))
    assert condition(three, "PodsNotStarting")["reason"] == "ContainerCreating"
    assert deleted(three) == ["tiny-1"]


def test_a_pod_past_its_start_deadline_is_replaced_away_from_its_node() -> None:
    j = job(faultTolerance={"podStartTimeoutSeconds": 300})
    first = decide(j, world())
    observed = world(trainer(0), trainer(1, "Pending", waiting_reason="CreateContainerError"),
                     rdzv=rendezvous())
    two = then(first, j, observed, now=T0 + timedelta(seconds=299))
    assert deletes(two) == []
    three = then(two, j, observed, now=T0 + timedelta(seconds=301))
    assert deleted(three) == ["tiny-1"]
    incident = three.status["incidents"][-1]
    assert (incident["cause"], incident["action"]) == (
        IncidentCause.POD_START_TIMEOUT, RecoveryAction.RANK_RESTART)
    assert "CreateContainerError" in incident["message"] and "podStartTimeoutSeconds=300" in (
        incident["message"])
    assert [e["node"] for e in three.status["excludedNodes"]] == ["node-1"]


@pytest.mark.parametrize("reason", ["ContainerCreating", "PodInitializing", "InvalidImageName",
                                    "CreateContainerConfigError"])
def test_a_pod_still_pulling_or_misconfigured_at_its_deadline_excludes_no_node(
    reason: str,
) -> None:
    # review-2 F11: a cold pull of a large image outlasting the timeout (the kubelet says
    # ContainerCreating while it pulls), or a spec that fails on every node alike, is no reason
    # to avoid the node.
    j = job(faultTolerance={"podStartTimeoutSeconds": 300})
    first = decide(j, world())
    observed = world(trainer(0), trainer(1, "Pending", waiting_reason=reason),
                     rdzv=rendezvous())
    late = then(first, j, observed, now=T0 + timedelta(seconds=301))
    assert deleted(late) == ["tiny-1"]
    incident = late.status["incidents"][-1]
    assert incident["cause"] == IncidentCause.POD_START_TIMEOUT
    assert "its node is not excluded" in incident["message"]
    assert "excludedNodes" not in late.status


def test_an_unscheduled_pod_past_its_deadline_excludes_no_node() -> None:
    j = job(faultTolerance={"podStartTimeoutSeconds": 60})
    first = decide(j, world())
    observed = world(trainer(0), trainer(1, "Pending", node_name=None,
                                         unscheduled_reason="Unschedulable"), rdzv=rendezvous())
    two = then(first, j, observed, now=T0 + timedelta(seconds=61))
    assert deleted(two) == ["tiny-1"]
    assert "excludedNodes" not in two.status


def test_every_pod_past_its_deadline_restarts_everything_then_fails() -> None:
    j = job(faultTolerance={"podStartTimeoutSeconds": 60})
    first = decide(j, world())
    pending = world(trainer(0, "Pending", node_name=None, unscheduled_reason="Unschedulable"),
                    trainer(1, "Pending", node_name=None, unscheduled_reason="Unschedulable"),
                    rdzv=rendezvous())
    two = then(first, j, pending, now=T0 + timedelta(seconds=61))
    assert two.status["incidents"][-1]["action"] == RecoveryAction.FULL_RESTART
    later = T0 + timedelta(seconds=200)
    again = world(trainer(0, "Pending", attempt=1, started=later - timedelta(seconds=70)),
                  trainer(1, "Pending", attempt=1, started=later - timedelta(seconds=70)),
                  rdzv=rendezvous())
    three = then(two, j, again, now=later)
    assert three.status["state"] == "Failed"
    assert three.status["reason"] == "RestartBudgetExceeded"


def test_a_rendezvous_pod_that_never_starts_restarts_everything() -> None:
    j = job(faultTolerance={"podStartTimeoutSeconds": 60})
    first = decide(j, world())
    observed = world(trainer(0), trainer(1),
                     rdzv=rendezvous("Pending", waiting_reason="ImagePullBackOff"))
    two = then(first, j, observed, now=T0 + timedelta(seconds=10))
    assert condition(two, "PodsNotStarting")["message"].startswith("pod tiny-rdzv")
    three = then(two, j, observed, now=T0 + timedelta(seconds=61))
    incident = three.status["incidents"][-1]
    assert (incident["cause"], incident["action"]) == (
        IncidentCause.POD_START_TIMEOUT, RecoveryAction.FULL_RESTART)
    assert "tiny-rdzv" in deleted(three)
