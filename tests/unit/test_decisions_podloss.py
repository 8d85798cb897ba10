"""Which pod events the operator announces to a job's other pods as a lost pod, and to whom
(rtj_operator.decisions.podloss): only a Failed trainer pod of a job with in-process restart,
once, to the running trainer pods beside it."""

from __future__ import annotations

from typing import Any

import pytest
from rtj_operator import views
from rtj_operator.decisions import podloss
from rtj_operator.intents import AnnouncePodLoss
from rtj_operator.observed import PodView

pytestmark = pytest.mark.unit


def pod(index: int, *, phase: str = "Running", role: str = "trainer", deleting: bool = False,
        ip: str | None = "", uid: str = "") -> PodView:
    return PodView(name=f"job-{index}", uid=uid or f"uid-{index}", role=role, node_index=index,
                   phase=phase, deleting=deleting,
                   pod_ip=f"127.0.0.{index + 10}" if ip == "" else ip)


PEERS = [pod(0), pod(1, phase="Failed"), pod(2), pod(3, phase="Pending", ip=None),
         pod(4, deleting=True), pod(5, phase="Succeeded"), pod(9, role="rendezvous")]


def test_a_failed_trainer_pod_is_announced_to_the_running_trainer_pods_beside_it() -> None:
    verdict = podloss.announcement(pod(1, phase="Failed"), in_process_restart=True, peers=PEERS,
                                   already_announced=False, spares=1)
    assert verdict == AnnouncePodLoss(uid="uid-1", name="job-1", cause="PodFailed",
                                      peers=("127.0.0.10", "127.0.0.12"))
    assert verdict.document() == {"pods": [{"uid": "uid-1", "name": "job-1",
                                            "cause": "PodFailed"}]}


@pytest.mark.parametrize(("lost", "in_process", "announced", "why"), [
    (pod(1, phase="Running"), True, False, "running: its processes may live"),
    (pod(1, phase="Running", deleting=True), True, False, "Terminating: a graceful stop"),
    (pod(1, phase="Succeeded"), True, False, "exit 0: finished or stopped on purpose"),
    (pod(1, phase="Pending"), True, False, "never ran"),
    (pod(1, phase="Unknown"), True, False, "its node is unreachable: it may run cut off"),
    (pod(1, phase="Failed"), False, False, "no in-process wrapper listens"),
    (pod(1, phase="Failed"), True, True, "announced once only"),
    (pod(9, phase="Failed", role="rendezvous"), True, False, "not a trainer"),
])
def test_nothing_else_is_announced(lost: PodView, in_process: bool, announced: bool,
                                   why: str) -> None:
    assert podloss.announcement(lost, in_process_restart=in_process, peers=PEERS,
                                already_announced=announced, spares=1) is None, why


def test_the_peers_are_looked_at_only_for_a_pod_that_failed() -> None:
    """The pod watch hands the peers lazily: at a 5,000-pod job's start, viewing every peer at
    every pod event was most of the operator's core (bench.scale, 2026-12-05)."""
    looked: list[int] = []

    def peers() -> Any:
        for peer in PEERS:
            looked.append(peer.node_index or 0)
            yield peer

    for event in (pod(1), pod(1, phase="Pending"), pod(1, deleting=True)):
        assert podloss.announcement(event, in_process_restart=True, peers=peers(),
                                    already_announced=False, spares=1) is None
    assert looked == []
    assert podloss.announcement(pod(1, phase="Failed"), in_process_restart=True, peers=peers(),
                                already_announced=False, spares=1) is not None
    assert len(looked) == len(PEERS)


def test_a_job_without_warm_spares_is_not_told() -> None:
    """No spare can fill the lost ranks: the launchers restart with the replacement pod."""
    assert podloss.announcement(pod(1, phase="Failed"), in_process_restart=True, peers=PEERS,
                                already_announced=False, spares=0) is None


def test_a_failed_pod_with_no_running_peer_is_not_announced() -> None:
    peers = [pod(0, phase="Failed"), pod(1, phase="Failed"), pod(2, deleting=True)]
    assert podloss.announcement(pod(1, phase="Failed"), in_process_restart=True, peers=peers,
                                already_announced=False, spares=1) is None


def test_a_replacement_with_the_lost_pods_name_is_told_but_the_lost_pod_is_not() -> None:
    """Peers are pods (UIDs), not names: the new `job-1` already running is told."""
    peers = [pod(0), pod(1, phase="Failed"), pod(1, uid="uid-1b", ip="127.0.0.99")]
    verdict = podloss.announcement(pod(1, phase="Failed"), in_process_restart=True, peers=peers,
                                   already_announced=False, spares=1)
    assert verdict is not None and verdict.peers == ("127.0.0.10", "127.0.0.99")


def container(name: str, env: list[dict[str, Any]]) -> dict[str, Any]:
    return {"name": name, "env": env}


@pytest.mark.parametrize(("containers", "expected"), [
    ([container("trainer", [{"name": "RTJ_INPROCESS_RESTART", "value": "1"}])], "1"),
    ([container("trainer", [{"name": "RTJ_INPROCESS_RESTART", "value": "1"},
                            {"name": "RTJ_INPROCESS_RESTART", "value": "0"}])], "0"),
    ([container("sidecar", [{"name": "RTJ_INPROCESS_RESTART", "value": "1"}])], None),
    ([container("trainer", [{"name": "RTJ_INPROCESS_RESTART",
                             "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}])], None),
    ([container("trainer", [])], None),
    ([], None),
])
def test_the_in_process_switch_is_read_from_the_trainer_containers_environment(
    containers: list[dict[str, Any]], expected: str | None,
) -> None:
    body = {"spec": {"containers": containers}}
    assert views.container_env(body, "trainer", podloss.IN_PROCESS_RESTART_ENV) == expected
