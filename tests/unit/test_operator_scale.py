"""The operator at scale: the pod liveness document, the watch-cache slimming, the compact
ranks and the status-write rule, the idle finished job."""

from __future__ import annotations

import json
from typing import Any

import pytest
from prometheus_client.exposition import generate_latest
from rtj_operator import jobloop, reconcile, views
from rtj_operator.api.status import RankStatus, compact_ranks
from rtj_operator.intents import CreateObject, DeletePod
from rtj_operator.scraping import node_liveness_from_json
from rtj_trainer.launcher.podmetrics import PodRanks, procs_from_argv, rank_record
from rtj_trainer.metrics import Snapshot, TrainerMetrics

pytestmark = pytest.mark.unit


def _page(rank: int, local_rank: int, **values: Any) -> str:
    metrics = TrainerMetrics(rank=rank, local_rank=local_rank, job="j", attempt=0)
    snapshot = Snapshot(**values)
    metrics.watch(lambda: snapshot)
    return generate_latest(metrics.registry).decode()


def test_the_operator_reads_back_what_a_pod_endpoint_serves() -> None:
    pages = {
        "http://h:9400/metrics": _page(6, 0, heartbeat_timestamp=1.7e9, step=42,
                                       checkpoint_committed_step=40,
                                       checkpoint_committed_timestamp=1.69e9),
        "http://h:9401/metrics": _page(7, 1, heartbeat_timestamp=1.7e9 + 1, step=43),
    }
    ranks = PodRanks(host="h", metrics_port=9400, procs=2, fetch=pages.get)
    document = json.dumps(ranks.read())
    node = node_liveness_from_json(document, node_index=3, pod_uid="u", procs=2)
    assert node.complete and node.pod_uid == "u" and node.node_index == 3
    first, second = node.samples
    assert (first.rank, first.heartbeat, first.step, first.committed_step) == (6, 1.7e9, 42, 40)
    assert (second.rank, second.local_rank, second.step, second.committed_step) == (7, 1, 43, None)


def test_a_rank_that_stops_answering_keeps_its_last_heartbeat_one_never_seen_is_missing() -> None:
    pages: dict[str, str] = {"http://h:9400/metrics": _page(0, 0, heartbeat_timestamp=100.0)}
    ranks = PodRanks(host="h", metrics_port=9400, procs=2, fetch=pages.get)
    ranks.read()
    pages.clear()  # rank 0's worker died; rank 1 never answered
    document = ranks.read()
    last = rank_record(_page(0, 0, heartbeat_timestamp=100.0), 0).to_json()
    assert document == {"ranks": [{**last, "answered": False}]}
    node = node_liveness_from_json(json.dumps(document), node_index=0, pod_uid="u", procs=2)
    assert not node.complete and node.samples[0].heartbeat == 100.0


def test_a_pod_whose_workers_all_exited_0_says_it_finished_and_the_operator_reads_it() -> None:
    pages: dict[str, str] = {"http://h:9400/metrics": _page(0, 0, heartbeat_timestamp=100.0)}
    ranks = PodRanks(host="h", metrics_port=9400, procs=1, fetch=pages.get)
    first = ranks.read()
    assert "finished" not in first
    assert not node_liveness_from_json(json.dumps(first), node_index=0, pod_uid="u",
                                       procs=1).finished
    pages.clear()  # the workers exited 0; the launcher waits in its exit barrier
    ranks.mark_finished()
    document = ranks.read()
    assert document["finished"] is True and document["ranks"][0]["answered"] is False
    node = node_liveness_from_json(json.dumps(document), node_index=0, pod_uid="u", procs=1)
    assert node.finished and node.samples[0].heartbeat == 100.0


@pytest.mark.parametrize("text", ["[]", '{"ranks": 3}', '{"ranks": [{"localRank": -1}]}',
                                  "not json"])
def test_a_pod_document_of_another_shape_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        node_liveness_from_json(text, node_index=0, pod_uid="u", procs=8)


def test_the_worker_count_is_read_from_the_launcher_arguments() -> None:
    assert procs_from_argv(["--nnodes=2", "--nproc-per-node=8", "--no-python", "x"]) == 8
    assert procs_from_argv(["--nproc-per-node", "4"]) == 4
    assert procs_from_argv(["--nnodes=2"]) is None


def test_the_watch_cache_keeps_what_the_decisions_read() -> None:
    pod = {
        "metadata": {"name": "j-0", "uid": "u", "labels": {"training.resilient.dev/job": "j",
                                                          "training.resilient.dev/role": "trainer",
                                                          "training.resilient.dev/node-index": "0"},
                     "creationTimestamp": "2026-01-01T00:00:00Z", "managedFields": [{"x": 1}],
                     "annotations": {"big": "x" * 1000}},
        "spec": {"nodeName": "n", "containers": [{"name": "trainer", "env": ["..."] * 50}]},
        "status": {"phase": "Running", "podIP": "10.0.0.1", "startTime": "2026-01-01T00:00:01Z",
                   "conditions": [{"type": "PodScheduled", "status": "True"},
                                  {"type": "Ready", "status": "True"}],
                   "containerStatuses": [{"name": "trainer", "image": "i", "state": {
                       "running": {"startedAt": "2026-01-01T00:00:02Z"}}}]},
    }
    slim = views.slim_pod(pod)
    assert views.pod_view(slim) == views.pod_view(pod)
    assert len(json.dumps(slim)) < len(json.dumps(pod)) / 3


def test_a_large_job_writes_only_the_ranks_that_are_not_running() -> None:
    small = [RankStatus(node_index=i, state="Running") for i in range(64)]
    assert compact_ranks(small) == small
    large = [RankStatus(node_index=i, state="Running" if i != 7 else "Restarting")
             for i in range(1000)]
    assert [r.node_index for r in compact_ranks(large)] == [7]


def test_progress_alone_is_not_a_meaningful_status_change() -> None:
    current = {"state": "Running", "step": 10,
               "ranks": [{"nodeIndex": 0, "state": "Running", "step": 10,
                          "lastHeartbeatTime": "2026-01-01T00:00:00Z"}]}
    progress = {"step": 11, "ranks": [{"nodeIndex": 0, "state": "Running", "step": 11,
                                       "lastHeartbeatTime": "2026-01-01T00:00:03Z"}]}
    assert reconcile.only_progress(current, progress)
    state = {"ranks": [{"nodeIndex": 0, "state": "Restarting", "step": 11}]}
    assert not reconcile.only_progress(current, state)
    assert not reconcile.only_progress(current, {"state": "Recovering"})


@pytest.mark.parametrize(
    ("state", "pods", "ttl", "idle"),
    [("Succeeded", 0, None, True), ("Failed", 0, None, True), ("Failed", 1, None, False),
     ("Succeeded", 0, 60, False), ("Running", 0, None, False), (None, 0, None, False)],
)
def test_a_finished_job_without_pods_or_ttl_costs_no_pass(
    state: str | None, pods: int, ttl: int | None, idle: bool
) -> None:
    assert jobloop.finished_and_idle(state, pods, ttl) is idle


def test_a_pass_lists_while_the_watch_cache_lags_behind_its_own_writes() -> None:
    pod = {"metadata": {"name": "j-0", "uid": "u0"}}
    deleting = {"metadata": {"name": "j-0", "uid": "u0", "deletionTimestamp": "x"}}
    expected = reconcile.expectations_after(
        [CreateObject({"kind": "Pod", "metadata": {"name": "j-1"}}), DeletePod("j-0", "u0")],
        {"old": 0.0}, now=500.0)
    assert expected == {"j-1": 500.0, "-u0": 500.0}  # "old" outlived EXPECTATION_SECONDS
    lagging = ([pod], [], [])
    assert reconcile.unmet_expectations(expected, lagging) == {"j-1", "-u0"}
    caught_up = ([deleting, {"metadata": {"name": "j-1", "uid": "u1"}}], [], [])
    assert reconcile.unmet_expectations(expected, caught_up) == set()


def test_a_create_refused_by_admission_is_not_expected_in_the_watch_cache() -> None:
    expected = reconcile.expectations_after(
        [CreateObject({"kind": "Pod", "metadata": {"name": "j-0"}}),
         CreateObject({"kind": "Pod", "metadata": {"name": "j-1"}})],
        {}, now=10.0, refused=["j-1"])
    assert expected == {"j-0": 10.0}  # j-1 was never made: no LIST fallback waits for it


def test_a_finished_queued_job_gets_passes_until_its_workload_is_seen_finished() -> None:
    assert not jobloop.finished_and_idle("Succeeded", 0, None, workload_pending=True)
    assert jobloop.finished_and_idle("Succeeded", 0, None, workload_pending=False)


def test_a_created_workload_is_not_expected_in_the_watch_caches_of_pods_services_and_claims(
) -> None:
    expected = reconcile.expectations_after(
        [CreateObject({"kind": "Workload", "metadata": {"name": "resilienttrainingjob-j-abcde"}}),
         CreateObject({"kind": "Service", "metadata": {"name": "j"}})], {}, now=3.0)
    assert expected == {"j": 3.0}


def test_a_finished_job_whose_pods_ended_and_stay_for_their_logs_costs_no_pass() -> None:
    # review-2 F9: the ended trainer pods of a finished job are kept for their logs; counted as
    # pods, they cost a full pass every interval for ever.
    ended = [{"metadata": {"name": f"j-{i}"}, "status": {"phase": phase}}
             for i, phase in enumerate(("Succeeded", "Succeeded", "Failed"))]
    assert jobloop.running_pods(ended) == 0
    assert jobloop.finished_and_idle("Succeeded", jobloop.running_pods(ended), None)
    running = [*ended, {"metadata": {"name": "j-rdzv"}, "status": {"phase": "Running"}}]
    gone_soon = {"name": "j-2", "deletionTimestamp": "2026-12-04T00:00:00Z"}
    deleting = [*ended[:2], {"metadata": gone_soon, "status": {"phase": "Failed"}}]
    assert jobloop.running_pods(running) == 1 and jobloop.running_pods(deleting) == 1
    assert not jobloop.finished_and_idle("Succeeded", jobloop.running_pods(running), None)


def test_the_largest_status_of_an_8192_node_job_stays_under_512_kib() -> None:
    """Issue #33: every pod Pending (the job's start, the worst case for `ranks`), every list at
    the size the operator keeps, every message at its limit. Before the cap every Pending pod was
    listed (≈ 2.2 MiB: over etcd's 1.5 MiB)."""
    import json

    from unit.worst_status import worst_status

    status = worst_status(8192)
    size = len(json.dumps(status, separators=(",", ":")).encode())
    assert len(status["ranks"]) == 256
    assert size <= 512 * 1024, size


def test_a_large_job_lists_its_most_urgent_ranks_first_when_too_many_are_not_running() -> None:
    states = {5: "Failed", 4000: "Unresponsive", 7000: "Restarting"}
    ranks = [RankStatus(node_index=i, state=states.get(i, "Pending" if i % 2 else "Running"))
             for i in range(8192)]
    listed = compact_ranks(ranks)
    assert len(listed) == 256
    assert [r.node_index for r in listed][:1] == [1] and {5, 4000, 7000} <= {
        r.node_index for r in listed}
    assert [r.node_index for r in listed] == sorted(r.node_index for r in listed)
    assert all(r.state != "Running" for r in listed)
