"""The pure half of observing: API objects into views (`rtj_operator.views`), and how a
Workload GET's answer is read (`rtj_operator.kueueobserve`; the API client stands in for the
server)."""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import Any

import kubernetes.client
import pytest
from kubernetes.client.exceptions import ApiException
from rtj_operator import observe as observe_module
from rtj_operator.kueueobserve import observe_queue
from rtj_operator.observe import DISRUPTION_GRACE_SECONDS, FORBIDDEN_RETRY_SECONDS, NodeCache
from rtj_operator.stopmemory import StopMemory
from rtj_operator.views import (
    PodViewCache,
    node_view,
    observed_from,
    pod_view,
    slim_object,
    slim_pod,
)

pytestmark = pytest.mark.unit


def pod(name: str, role: str, index: int | None = None, **status: object) -> dict[str, object]:
    labels = {"training.resilient.dev/job": "j", "training.resilient.dev/role": role}
    if index is not None:
        labels |= {"training.resilient.dev/node-index": str(index),
                   "training.resilient.dev/attempt": "2"}
    return {"metadata": {"name": name, "uid": f"uid-{name}", "labels": labels},
            "spec": {"nodeName": "node-a"}, "status": status}


def test_a_failed_trainer_pod_shows_its_exit_code_and_times() -> None:
    view = pod_view(pod("j-1", "trainer", 1, phase="Failed", podIP="10.0.0.5", containerStatuses=[
        {"name": "trainer", "state": {"terminated": {
            "exitCode": 137, "reason": "Error", "startedAt": "2026-11-29T12:00:00Z",
            "finishedAt": "2026-11-29T12:05:00Z"}}}]))
    assert (view.node_index, view.attempt, view.phase, view.exit_code) == (1, 2, "Failed", 137)
    assert view.finished_at == datetime(2026, 11, 29, 12, 5, tzinfo=UTC)
    assert view.started_at == datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    assert view.terminated and not view.deleting and view.pod_ip == "10.0.0.5"


def test_children_are_sorted_into_trainers_rendezvous_services_and_claim() -> None:
    observed = observed_from(
        job_name="j", job_uid="job-uid",
        pods=[pod("j-0", "trainer", 0, phase="Running"), pod("j-rdzv", "rendezvous"),
              pod("other-0", "trainer", 0)],
        services=[{"metadata": {"name": "j"}}, {"metadata": {"name": "j-rdzv"}}],
        claims=[{"metadata": {"name": "j-checkpoints",
                              "ownerReferences": [{"uid": "job-uid"}]}}],
    )
    assert list(observed.trainer_pods) == [0]
    assert observed.trainer_pods[0].name == "j-0"
    assert observed.rendezvous_pod is not None and observed.rendezvous_pod.name == "j-rdzv"
    assert observed.headless_service and observed.rendezvous_service
    assert observed.claim is not None and observed.claim.owned_by_job


def test_the_ports_the_services_were_created_with_survive_the_watch_cache() -> None:
    services = [
        {"metadata": {"name": "j"}, "spec": {"clusterIP": "None", "ports": [
            {"name": "metrics", "port": 9400, "targetPort": 9400, "protocol": "TCP"}]}},
        {"metadata": {"name": "j-rdzv"}, "spec": {"ports": [
            {"name": "rendezvous", "port": 29400, "targetPort": 29400, "protocol": "TCP"}]}},
        {"metadata": {"name": "unrelated"}, "spec": {"ports": [{"name": "metrics", "port": 1}]}},
    ]
    observed = observed_from(job_name="j", job_uid="u", pods=[], claims=[],
                             services=[slim_object(s) for s in services])
    assert observed.service_ports == {"metrics": 9400, "rendezvous": 29400}
    assert observed_from(job_name="j", job_uid="u", pods=[], claims=[],
                         services=[]).service_ports == {}


def test_the_network_policy_digest_on_the_headless_service_survives_the_watch_cache() -> None:
    service = {"metadata": {"name": "j", "annotations": {
        "training.resilient.dev/network-policy": "0123456789abcdef",
        "kubectl.kubernetes.io/last-applied-configuration": "{...}"}},
        "spec": {"clusterIP": "None"}}
    slim = slim_object(service)
    assert slim["metadata"]["annotations"] == {  # only ours is kept
        "training.resilient.dev/network-policy": "0123456789abcdef"}
    observed = observed_from(job_name="j", job_uid="u", pods=[], claims=[], services=[slim])
    assert observed.network_policy == "0123456789abcdef"
    other = {"metadata": {"name": "j-rdzv", "annotations": {
        "training.resilient.dev/network-policy": "ffff"}}}
    assert observed_from(job_name="j", job_uid="u", pods=[], claims=[],
                         services=[slim_object(other), {"metadata": {"name": "j"}}]
                         ).network_policy is None


# --- nodes, and pods that do not start ----------------------------------------------------------

LOST_NODE_JSON = {
    "metadata": {"name": "node-a", "labels": {"kubernetes.io/hostname": "node-a"}},
    "spec": {"taints": [
        {"key": "node.kubernetes.io/unreachable", "effect": "NoSchedule",
         "timeAdded": "2026-11-29T12:00:40Z"},
        {"key": "node.kubernetes.io/unreachable", "effect": "NoExecute",
         "timeAdded": "2026-11-29T12:00:45Z"}]},
    "status": {"conditions": [
        {"type": "MemoryPressure", "status": "Unknown", "reason": "NodeStatusUnknown"},
        {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
         "message": "Kubelet stopped posting node status."}]},
}
HEALTHY_NODE_JSON = {
    "metadata": {"name": "node-b"},
    "spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]},
    "status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]},
}


def test_a_node_shows_its_ready_condition_and_lost_node_taints() -> None:
    lost, healthy = node_view(LOST_NODE_JSON), node_view(HEALTHY_NODE_JSON)
    assert (lost.name, lost.ready, lost.unreachable) == ("node-a", "Unknown", True)
    assert (healthy.name, healthy.ready, healthy.unreachable) == ("node-b", "True", False)
    not_ready = node_view({"metadata": {"name": "n"}, "spec": {"taints": [
        {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute"}]},
        "status": {"conditions": [{"type": "Ready", "status": "False"}]}})
    assert (not_ready.ready, not_ready.unreachable) == ("False", True)
    assert node_view({"metadata": {"name": "new"}}).ready is None


def test_a_pod_on_a_lost_node_is_marked_lost_only_with_node_information() -> None:
    raw = pod("j-1", "trainer", 1, phase="Running")
    nodes = {"node-a": node_view(LOST_NODE_JSON)}
    view = observed_from(job_name="j", job_uid="u", pods=[raw], services=[], claims=[],
                         nodes=nodes).trainer_pods[1]
    assert (view.node_ready, view.node_unreachable, view.node_lost) == ("Unknown", True, True)
    blind = pod_view(raw)  # the operator cannot read nodes
    assert (blind.node_ready, blind.node_lost) == (None, False)


def test_a_pod_view_is_kept_while_its_watch_entry_and_its_node_are_unchanged() -> None:
    """A 5,000-pod pass spent a sixth of its time viewing pods that had not changed; the cache
    views a pod again when the watch replaced its entry or its node changed, never otherwise."""
    cache = PodViewCache()
    running = pod("j-0", "trainer", 0, phase="Running")
    other = pod("j-1", "trainer", 1, phase="Running")
    healthy = {"node-a": node_view(HEALTHY_NODE_JSON | {"metadata": {"name": "node-a"}})}
    first = observed_from(job_name="j", job_uid="u", pods=[running, other], services=[],
                          claims=[], nodes=healthy, cache=cache).trainer_pods
    again = observed_from(job_name="j", job_uid="u", pods=[running, other], services=[],
                          claims=[], nodes=healthy, cache=cache).trainer_pods
    assert again[0] is first[0] and again[1] is first[1]  # not viewed again
    # The watch replaced pod 0's entry (it failed); pod 1's node was lost meanwhile.
    failed = pod("j-0", "trainer", 0, phase="Failed")
    lost = {"node-a": node_view(LOST_NODE_JSON)}
    later = observed_from(job_name="j", job_uid="u", pods=[failed, other], services=[],
                          claims=[], nodes=lost, cache=cache).trainer_pods
    assert later[0].phase == "Failed" and later[1].node_lost and not first[1].node_lost
    assert later == observed_from(job_name="j", job_uid="u", pods=[failed, other], services=[],
                                  claims=[], nodes=lost).trainer_pods  # the same as uncached
    # Bounded: views of entries no call shows any more are dropped.
    for n in range(40):
        observed_from(job_name="j", job_uid="u", pods=[pod("j-0", "trainer", 0, phase=str(n))],
                      services=[], claims=[], cache=cache)
    assert len(cache._views) <= 3 + 16


def test_an_unschedulable_pod_shows_the_schedulers_reason() -> None:
    raw = pod("j-1", "trainer", 1, phase="Pending", conditions=[
        {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
         "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.",
         "lastTransitionTime": "2026-11-29T12:00:01Z"}])
    raw["metadata"]["creationTimestamp"] = "2026-11-29T12:00:00Z"  # type: ignore[index]
    del raw["spec"]["nodeName"]  # type: ignore[attr-defined]
    view = pod_view(raw)
    assert view.created_at == datetime(2026, 11, 29, 12, 0, tzinfo=UTC)
    assert view.node_name is None
    assert view.start_problem == (
        "Unschedulable", "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")


def test_a_pod_whose_image_cannot_be_pulled_shows_the_kubelets_reason() -> None:
    raw = pod("j-1", "trainer", 1, phase="Pending",
              conditions=[{"type": "PodScheduled", "status": "True"},
                          {"type": "Ready", "status": "False", "reason": "ContainersNotReady"}],
              containerStatuses=[{"name": "trainer", "ready": False, "restartCount": 0,
                                  "image": "img", "imageID": "", "state": {"waiting": {
                                      "reason": "ImagePullBackOff",
                                      "message": 'Back-off pulling image "img"'}}}])
    view = pod_view(raw)
    assert view.unscheduled_reason is None and view.node_name == "node-a"
    assert view.start_problem == ("ImagePullBackOff", 'Back-off pulling image "img"')
    assert pod_view(pod("j-1", "trainer", 1, phase="Running")).start_problem is None


def test_the_node_cache_lists_nodes_once_per_age_for_every_job() -> None:
    now = [0.0]
    calls: list[int] = []

    def lister() -> list[dict[str, Any]]:
        calls.append(1)
        return [LOST_NODE_JSON, HEALTHY_NODE_JSON]

    async def scenario() -> None:
        cache = NodeCache(max_age_seconds=10, clock=lambda: now[0])
        first = await cache.nodes(lister)  # nothing yet: waits for the LIST
        now[0] = 9.0
        second = await cache.nodes(lister)
        assert first is not None and sorted(first) == ["node-a", "node-b"] and second is first
        assert len(calls) == 1
        now[0] = 10.5
        # Older than the maximum age: served at once while one LIST runs in the background.
        assert await cache.nodes(lister) is first
        await _settled(cache)
        assert len(calls) == 2 and await cache.nodes(lister) is not first

    asyncio.run(scenario())


def test_every_node_not_ready_at_once_is_a_disruption_until_a_node_is_back_and_a_grace_passed(
) -> None:
    """A 16 s etcd stall once left every kubelet unable to renew its Lease; the node lifecycle
    controller marked every node Unknown and tainted it, and the operator force-deleted healthy
    pods as lost (the 2-hour soak's 48 false alarms). Every node down at once is the control
    plane's failure: no pod counts as lost on its node's word until a node is Ready again and
    a grace period passed, after which a node still NotReady is lost as before."""
    now = [0.0]
    listed: list[list[dict[str, Any]]] = [[HEALTHY_NODE_JSON, LOST_NODE_JSON]]
    down_b = {**HEALTHY_NODE_JSON, "status": LOST_NODE_JSON["status"]}

    async def scenario() -> None:
        cache = NodeCache(max_age_seconds=10, clock=lambda: now[0])

        async def relist(nodes: list[dict[str, Any]]) -> str | None:
            listed[0] = nodes
            now[0] += 11  # older than the maximum age: listed again
            await cache.nodes(lambda: listed[0])
            await _settled(cache)
            return cache.disruption()

        await cache.nodes(lambda: listed[0])
        assert cache.disruption() is None  # one node lost, one Ready: judged one by one
        disrupted = await relist([down_b, LOST_NODE_JSON])
        assert disrupted is not None and "every node (2) is NotReady at once" in disrupted
        assert await relist([down_b, LOST_NODE_JSON]) == disrupted  # stable while it lasts
        back = await relist([HEALTHY_NODE_JSON, LOST_NODE_JSON])
        assert back is not None and "came back from a disruption" in back
        now[0] += DISRUPTION_GRACE_SECONDS - 11
        assert await relist([HEALTHY_NODE_JSON, LOST_NODE_JSON]) is None

    asyncio.run(scenario())


def test_a_disruption_reaches_the_observed_record() -> None:
    raw = pod("j-1", "trainer", 1, phase="Running")
    nodes = {"node-a": node_view(LOST_NODE_JSON)}
    seen = observed_from(job_name="j", job_uid="u", pods=[raw], services=[], claims=[],
                         nodes=nodes, nodes_disrupted="every node (1) is NotReady")
    assert seen.nodes_disrupted == "every node (1) is NotReady"
    assert seen.trainer_pods[1].node_lost  # the pod still shows its node as it is


def test_a_passs_viewing_time_leaves_out_its_wait_for_the_node_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What spaces a job's passes (`PassResult.busy_seconds`) is their own work: a pass that
    waited 0.3 s for the shared node list (as 100 jobs' passes did on a 5,000-node list) must
    not count that wait, or the job's next pass is held back three times as long."""
    import time

    def slow_list(_api: object, _timeout: float) -> list[dict[str, Any]]:
        time.sleep(0.3)
        return [HEALTHY_NODE_JSON]

    monkeypatch.setattr(observe_module, "_list_nodes", slow_list)

    async def one_pass() -> tuple[list[float], float]:
        spent: list[float] = []
        began = time.monotonic()
        await observe_module.observe(
            None, namespace="ns", job_name="j", job_uid="u",  # type: ignore[arg-type]
            timeout=1.0, node_cache=NodeCache(),
            children=([pod("j-0", "trainer", 0)], [], []), spent=spent)
        return spent, time.monotonic() - began

    spent, took = asyncio.run(one_pass())
    assert took >= 0.3 and len(spent) == 1 and spent[0] < 0.1


async def _settled(cache: NodeCache) -> None:
    while cache._in_flight is not None:
        await asyncio.sleep(0.01)


def test_a_node_list_that_times_out_fails_no_pass_and_no_pass_waits_on_another() -> None:
    # review-2 F3: a LIST failing with a urllib3 timeout (not an ApiException) failed every
    # job's pass, and the passes queued on one lock, each listing again: 4 passes took 1, 2, 3
    # and 4 s with 4 LISTs. Now: one LIST, shared; a failure is no exception to any pass.
    import time

    from urllib3.exceptions import ReadTimeoutError

    now = [0.0]
    calls: list[int] = []
    fail = [False]

    def lister() -> list[dict[str, Any]]:
        calls.append(1)
        time.sleep(0.3)
        if fail[0]:
            raise ReadTimeoutError(None, "/api/v1/nodes", "Read timed out. (read timeout=30)")
        return [LOST_NODE_JSON, HEALTHY_NODE_JSON]

    async def four_passes(cache: NodeCache) -> tuple[list[Any], float]:
        began = time.monotonic()
        got = await asyncio.gather(*(cache.nodes(lister) for _ in range(4)))
        return list(got), time.monotonic() - began

    async def scenario() -> None:
        cache = NodeCache(max_age_seconds=10, max_stale_seconds=60, clock=lambda: now[0])
        fail[0] = True  # nothing listed yet, and the LIST fails
        got, took = await four_passes(cache)
        assert got == [None] * 4 and len(calls) == 1 and took < 1.0
        got, _ = await four_passes(cache)  # failed a moment ago: not asked again yet
        assert got == [None] * 4 and len(calls) == 1
        now[0] = 10.0  # past the retry pause; this LIST succeeds
        fail[0] = False
        listed, _ = await four_passes(cache)
        assert len(calls) == 2 and all(n is listed[0] and n is not None for n in listed)
        now[0] = 25.0  # old now, and the LIST fails: the old list is served at once
        fail[0] = True
        got, took = await four_passes(cache)
        assert all(n is listed[0] for n in got) and took < 0.2
        await _settled(cache)
        assert len(calls) == 3
        now[0] = 71.0  # over 60 s old: too old to act on
        got, _ = await four_passes(cache)
        await _settled(cache)
        assert got == [None] * 4

    asyncio.run(scenario())


def test_without_rbac_on_nodes_the_cache_says_so_once_and_works_without(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    calls: list[int] = []

    def forbidden() -> list[dict[str, Any]]:
        calls.append(1)
        raise ApiException(status=403, reason="Forbidden")

    cache = NodeCache(max_age_seconds=10, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="rtj_operator"):
        assert asyncio.run(cache.nodes(forbidden)) is None
        now[0] = 60.0
        assert asyncio.run(cache.nodes(forbidden)) is None  # not asked again yet
        now[0] = FORBIDDEN_RETRY_SECONDS + 1
        assert asyncio.run(cache.nodes(forbidden)) is None
    assert len(calls) == 2
    warnings = [r for r in caplog.records if "Cannot list nodes" in r.getMessage()]
    assert len(warnings) == 1 and "rbac.clusterScoped=true" in warnings[0].getMessage()


class _Workloads:
    """CustomObjectsApi standing in for the API server: answers a Workload GET with `error`."""

    error: ApiException

    def __init__(self, _api: object) -> None:
        pass

    def get_namespaced_custom_object(self, *_: object, **__: object) -> Any:
        raise self.error


@pytest.mark.parametrize(("status", "body", "workload_missing", "why"), [
    # What kube-apiserver 1.34 answers: the object missing (Kueue installed) ...
    (404, '{"kind":"Status","apiVersion":"v1","status":"Failure","reason":"NotFound",'
          '"details":{"name":"w","group":"kueue.x-k8s.io","kind":"workloads"},"code":404}',
     True, None),
    # ... the API not served at all (no Kueue CRDs), and RBAC without Kueue's objects.
    (404, "404 page not found\n", False, "Kueue (v0.17 or later) is not installed"),
    (403, '{"kind":"Status","reason":"Forbidden","code":403}', False,
     "the operator's RBAC lacks Kueue's objects"),
])
def test_a_missing_workload_is_told_apart_from_a_cluster_without_kueue(
    monkeypatch: pytest.MonkeyPatch, status: int, body: str, workload_missing: bool,
    why: str | None,
) -> None:
    error = ApiException(status=status, reason="NotFound" if status == 404 else "Forbidden")
    error.body = body
    monkeypatch.setattr(_Workloads, "error", error, raising=False)
    monkeypatch.setattr(kubernetes.client, "CustomObjectsApi", _Workloads)
    client: Any = object()
    view = asyncio.run(observe_queue(client, namespace="ns", queue_name="q", workload_name="w",
                                     timeout=1))
    assert view.queue_name == "q" and view.workload is None
    if workload_missing:
        assert view.unavailable is None
    else:
        assert view.unavailable is not None and why in view.unavailable


# --- a drain's eviction and a stop, remembered past the pod ---------------------------------------

EVICTION = {"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
            "message": "Eviction API: evicting"}
STOPPED = {"name": "trainer", "state": {"terminated": {"exitCode": 0, "message": (
    '{"v":1,"outcome":"Stopped","step":37,"committedStep":37,"committedTime":1796086800.0,'
    '"checkpoint":"/checkpoints/ns/j/step-000000037.a0","reason":"CheckpointedBeforeStop",'
    '"message":"checkpointed step 37 before stopping","exitCode":0}')}}}


def owned(body: dict[str, Any], job_uid: str = "job-uid", namespace: str = "ns") -> dict[str, Any]:
    meta: dict[str, Any] = body["metadata"]
    meta["namespace"] = namespace
    meta["ownerReferences"] = [{"kind": "ResilientTrainingJob", "name": "j", "uid": job_uid,
                                "controller": True}]
    return body


def test_an_evicted_pod_shows_why_and_the_watch_cache_keeps_it() -> None:
    body = pod("j-1", "trainer", 1, phase="Running", conditions=[EVICTION])
    body["metadata"]["deletionTimestamp"] = "2026-11-29T12:00:00Z"
    view = pod_view(slim_pod(body))
    assert view.disruption == "EvictionByEvictionAPI" and view.voluntarily_disrupted
    assert view.deleting
    preempted = pod("j-1", "trainer", 1,
                    conditions=[{**EVICTION, "reason": "PreemptionByScheduler"}])
    assert pod_view(preempted).voluntarily_disrupted
    tainted = pod("j-1", "trainer", 1,
                  conditions=[{**EVICTION, "reason": "DeletionByTaintManager"}])
    assert pod_view(tainted).disruption == "DeletionByTaintManager"
    assert not pod_view(tainted).voluntarily_disrupted
    cleared = pod("j-1", "trainer", 1, conditions=[{**EVICTION, "status": "False"}])
    assert pod_view(cleared).disruption is None


def test_the_stop_memory_keeps_an_eviction_then_the_stop_of_the_same_pod() -> None:
    memory = StopMemory()
    t0 = datetime(2026, 11, 29, 12, tzinfo=UTC)
    evicted = owned(pod("j-1", "trainer", 1, phase="Running", conditions=[EVICTION]))
    first = memory.record(evicted, t0)
    assert first is not None and first.pod.voluntarily_disrupted and not first.stopped
    assert memory.record(evicted, t0.replace(second=1)) is None  # nothing new
    # The kubelet's last status: the termination message (a kubelet that dropped the
    # condition meanwhile loses nothing: the eviction is kept).
    ended = owned(pod("j-1", "trainer", 1, phase="Succeeded", containerStatuses=[STOPPED]))
    second = memory.record(ended, t0.replace(second=2))
    assert second is not None and second.stopped and second.committed_step == 37
    assert second.pod.voluntarily_disrupted and second.seen_at == t0
    assert second.pod.outcome is not None
    assert second.pod.outcome.checkpoint == "/checkpoints/ns/j/step-000000037.a0"
    (kept,) = memory.seen("ns", "j", t0.replace(minute=1))
    assert kept == second and kept.job_uid == "job-uid"


def test_the_stop_memory_ignores_pods_that_end_for_no_stop_and_forgets_old_ones() -> None:
    memory = StopMemory(max_age_seconds=60, max_per_job=2)
    t0 = datetime(2026, 11, 29, 12, tzinfo=UTC)
    assert memory.record(owned(pod("j-0", "trainer", 0, phase="Failed")), t0) is None
    assert memory.record(owned(pod("other", "sidecar", 0, conditions=[EVICTION])), t0) is None
    rendezvous = owned(pod("j-rdzv", "rendezvous", conditions=[EVICTION]))
    assert memory.record(rendezvous, t0) is not None  # an evicted rendezvous pod counts
    for n in range(3):
        memory.record(owned(pod(f"j-{n}", "trainer", n, containerStatuses=[STOPPED])),
                      t0.replace(second=n + 1))
    assert [s.pod.name for s in memory.seen("ns", "j", t0.replace(second=30))] == ["j-1", "j-2"]
    assert memory.seen("ns", "j", t0.replace(minute=5)) == []
    assert memory.seen("other-ns", "j", t0) == []
