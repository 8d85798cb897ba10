"""The pure helpers of a reconcile pass (`rtj_operator.reconcile`)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_the_status_patch_holds_only_changed_fields_and_removals() -> None:
    from rtj_operator.reconcile import status_patch

    current = {"state": "Running", "step": 10, "startTime": "2026-11-29T12:00:00Z"}
    desired = {"state": "Running", "step": 11, "startTime": None, "nodes": "2/2"}
    assert status_patch(current, desired) == {"step": 11, "startTime": None, "nodes": "2/2"}


def test_a_pass_computes_its_patch_as_if_its_own_unseen_writes_were_there() -> None:
    # The previous pass wrote state Recovering and removed startTime; the watch has not shown
    # it yet. A pass deciding Running again must write it (not skip it as "unchanged").
    from rtj_operator.reconcile import status_patch, unseen_writes, with_unseen_writes

    written = {"state": ("Recovering", 100.0), "startTime": (None, 100.0)}
    seen = {"state": "Running", "startTime": "2026-11-29T12:00:00Z", "step": 3}
    unseen = unseen_writes(written, seen, now=101.0)
    assert unseen == written
    current = with_unseen_writes(seen, unseen)
    assert current == {"state": "Recovering", "step": 3}
    assert status_patch(current, {"state": "Running", "step": 3}) == {"state": "Running"}


def test_an_own_write_is_forgotten_once_seen_or_when_old() -> None:
    from rtj_operator.reconcile import EXPECTATION_SECONDS, unseen_writes

    written = {"state": ("Recovering", 100.0), "startTime": (None, 100.0), "step": (4, 100.0)}
    seen = {"state": "Recovering", "step": 3}  # state shown, startTime shown removed
    assert unseen_writes(written, seen, now=101.0) == {"step": (4, 100.0)}
    assert unseen_writes(written, seen, now=100.0 + EXPECTATION_SECONDS) == {}


def test_a_pod_read_again_replaces_its_read_and_one_that_did_not_answer_loses_it() -> None:
    from rtj_operator.observed import NodeLiveness, PodView
    from rtj_operator.reconcile import merged_reads

    def pod(index: int, uid: str) -> PodView:
        return PodView(name=f"j-{index}", uid=uid, role="trainer", node_index=index)

    def read(index: int, uid: str, at: float) -> NodeLiveness:
        return NodeLiveness(node_index=index, pod_uid=uid, expected_ranks=1, read_time=at)

    previous = {0: read(0, "a", 1.0), 1: read(1, "b", 1.0), 2: read(2, "c", 1.0),
                3: read(3, "d", 1.0)}
    pods = {0: pod(0, "a"), 1: pod(1, "b"), 2: pod(2, "c2")}  # 2 replaced, 3 gone
    merged = merged_reads(previous, {0: read(0, "a", 5.0)}, [0, 1], pods)
    assert merged == {0: read(0, "a", 5.0)}  # 1 read again, silent; 2 and 3 dropped
    assert merged_reads(previous, {}, [], pods) == {0: previous[0], 1: previous[1]}


def test_a_read_of_every_pod_leaves_a_newer_read_of_one_pod_as_it_is() -> None:
    # A heartbeat deadline read pod 0 at t=7 while a read of every pod, begun at t=5, was under
    # way; that read's answer for pod 0 (from t=6) or its silence is older.
    from rtj_operator.observed import NodeLiveness, PodView
    from rtj_operator.reconcile import merged_reads

    pods = {i: PodView(name=f"j-{i}", uid=f"u{i}", role="trainer", node_index=i)
            for i in range(2)}

    def read(index: int, at: float) -> NodeLiveness:
        return NodeLiveness(node_index=index, pod_uid=f"u{index}", expected_ranks=1,
                            read_time=at)

    previous = {0: read(0, 7.0), 1: read(1, 1.0)}
    assert merged_reads(previous, {0: read(0, 6.0), 1: read(1, 6.0)}, [0, 1], pods,
                        since=5.0) == {0: read(0, 7.0), 1: read(1, 6.0)}
    assert merged_reads(previous, {}, [0, 1], pods, since=5.0) == {0: read(0, 7.0)}
