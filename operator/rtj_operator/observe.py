"""Read a job's children into an `Observed` record.

The operator keeps watch caches of every labelled pod, Service and claim (kopf indexes in
handlers.py, fed by one watch per kind, holding only the fields the decisions read:
`slim_pod`, `slim_object`), so a pass makes no API call to observe. Without them (`children`
None) a pass lists the three kinds by the job label, in a worker thread (the kubernetes client
is synchronous). The pure half, turning API objects into views, is separate (`pod_view`,
`node_view`, `observed_from`) and unit-tested.

A job queued through Kueue (label `kueue.x-k8s.io/queue-name`) also has its Workload read, one
GET per pass, and, while it is admitted, the ResourceFlavors of the admission (`observe_queue`);
a job without the label costs no Kueue call, and a cluster without Kueue is no error.

Nodes are read once for every job: `NodeCache` holds the readiness of every node from one LIST
(served from the API server's watch cache, `resourceVersion=0`), refreshed at most every
`NODE_CACHE_SECONDS`, and each job's pods are annotated with their node's Ready condition and
lost-node taints. Without RBAC on nodes (`rbac.clusterScoped=false`) the operator logs that once
and works without node information: it then cannot tell a lost node from a slow one.

A trainer pod asked to stop (a suspend, a preemption, an eviction, the job's deletion) says in its
termination message that it committed a checkpoint of its current step, and a pod the eviction
API ends carries a `DisruptionTarget` condition that says why. The kubelet removes the pod right
after its container ended, so a pass every few seconds would often miss both: `StopMemory` keeps
them from the first pod event that carries them (a watch handler in handlers.py; the deletion
event carries the pod's last state too), in memory only. An operator restarted in that window
misses them: the stop goes unrecorded (the resumed trainers still report the checkpoint through
their metrics) and an evicted pod it never saw is a vanished one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime
from typing import Any

import kubernetes.client
from kubernetes.client.exceptions import ApiException

from rtj_operator import kueueapi, naming, termination
from rtj_operator.observed import (
    ClaimView,
    FlavorView,
    NodeView,
    Observed,
    Placement,
    PodView,
    QueueView,
    StopSeen,
    WorkloadCondition,
    WorkloadView,
)

LOG = logging.getLogger("rtj_operator")
NODE_CACHE_SECONDS = 10.0
"""How old the shared node list may be before a pass lists nodes again. The node controller
marks a node lost only after its grace period (40-50 s), so 10 s adds little to detection."""
FORBIDDEN_RETRY_SECONDS = 600.0
"""After the API server refused to list nodes, how long the operator works without them before
it tries again (RBAC may have been granted meanwhile)."""
LOST_NODE_TAINTS = frozenset({"node.kubernetes.io/unreachable", "node.kubernetes.io/not-ready"})


def _int_label(labels: Mapping[str, str], key: str) -> int | None:
    try:
        return int(labels[key])
    except (KeyError, ValueError):
        return None


def _container_status(pod: Mapping[str, Any], container: str) -> Mapping[str, Any]:
    for status in pod.get("status", {}).get("containerStatuses") or []:
        if status.get("name") == container:
            return status  # type: ignore[no-any-return]
    return {}


def _time(value: object) -> datetime | None:
    if isinstance(value, datetime):
        return value
    if isinstance(value, str) and value:
        return datetime.fromisoformat(value.replace("Z", "+00:00"))
    return None


def _condition(obj: Mapping[str, Any], kind: str) -> Mapping[str, Any]:
    for condition in (obj.get("status") or {}).get("conditions") or []:
        if condition.get("type") == kind:
            return condition  # type: ignore[no-any-return]
    return {}


def node_view(node: Mapping[str, Any]) -> NodeView:
    """A node (as a JSON dict, camelCase): its Ready condition and lost-node taints."""
    taints = (node.get("spec") or {}).get("taints") or []
    return NodeView(
        name=(node.get("metadata") or {}).get("name", ""),
        ready=_condition(node, "Ready").get("status"),
        unreachable=any(t.get("key") in LOST_NODE_TAINTS for t in taints),
    )


def pod_view(pod: Mapping[str, Any], nodes: Mapping[str, NodeView] | None = None) -> PodView:
    """A pod (as a JSON dict, camelCase) seen through the decisions' eyes; `nodes` (by name)
    tell whether its node is lost."""
    meta = pod.get("metadata", {})
    labels = meta.get("labels") or {}
    role = labels.get(naming.ROLE_LABEL, "")
    container = (naming.TRAINER_CONTAINER if role == naming.ROLE_TRAINER
                 else naming.RENDEZVOUS_CONTAINER)
    status = pod.get("status", {}) or {}
    state = _container_status(pod, container).get("state") or {}
    terminated = state.get("terminated") or {}
    running = state.get("running") or {}
    outcome, problem = termination.parse(terminated.get("message"))
    waiting = state.get("waiting") or {}
    scheduled = _condition(pod, "PodScheduled")
    unscheduled = scheduled if scheduled.get("status") == "False" else {}
    disruption = _condition(pod, "DisruptionTarget")
    node_name = (pod.get("spec") or {}).get("nodeName")
    node = nodes.get(node_name) if nodes is not None and node_name else None
    return PodView(
        name=meta.get("name", ""),
        uid=meta.get("uid", ""),
        role=role,
        node_index=_int_label(labels, naming.NODE_INDEX_LABEL),
        attempt=_int_label(labels, naming.ATTEMPT_LABEL),
        phase=status.get("phase") or "Pending",
        deleting=meta.get("deletionTimestamp") is not None,
        exit_code=terminated.get("exitCode"),
        reason=terminated.get("reason") or status.get("reason"),
        started_at=_time(running.get("startedAt") or terminated.get("startedAt")
                         or status.get("startTime")),
        finished_at=_time(terminated.get("finishedAt")),
        node_name=node_name,
        pod_ip=status.get("podIP"),
        outcome=outcome,
        outcome_problem=problem,
        created_at=_time(meta.get("creationTimestamp")),
        unscheduled_reason=unscheduled.get("reason") or (
            "Unscheduled" if unscheduled else None),
        unscheduled_message=unscheduled.get("message"),
        waiting_reason=waiting.get("reason"),
        waiting_message=waiting.get("message"),
        node_ready=node.ready if node is not None else None,
        node_unreachable=node.unreachable if node is not None else False,
        disruption=(disruption.get("reason") or "DisruptionTarget"
                    if disruption.get("status") == "True" else None),
    )


def container_env(pod: Mapping[str, Any], container: str, name: str) -> str | None:
    """The literal value of variable `name` in the pod's container `container` (the last one
    wins, as in the kubelet); None when it is not set to a literal value."""
    value = None
    for spec in (pod.get("spec") or {}).get("containers") or []:
        if spec.get("name") == container:
            for entry in spec.get("env") or []:
                if entry.get("name") == name:
                    literal = entry.get("value")
                    value = literal if isinstance(literal, str) else None
    return value


def observed_from(
    *,
    job_name: str,
    job_uid: str,
    pods: Iterable[Mapping[str, Any]],
    services: Iterable[Mapping[str, Any]],
    claims: Iterable[Mapping[str, Any]],
    nodes: Mapping[str, NodeView] | None = None,
    stops: Iterable[StopSeen] = (),
) -> Observed:
    """The Observed record of a job from its labelled children (JSON dicts), the nodes by name
    (None: the operator cannot read nodes) and the stops the pod watch saw (`StopMemory`)."""
    trainers: dict[int, PodView] = {}
    rendezvous: PodView | None = None
    for pod in pods:
        view = pod_view(pod, nodes)
        if view.role == naming.ROLE_TRAINER and view.node_index is not None:
            if view.name == naming.trainer_pod_name(job_name, view.node_index):
                trainers[view.node_index] = view
        elif view.role == naming.ROLE_RENDEZVOUS and view.name == naming.rendezvous_name(job_name):
            rendezvous = view
    services = list(services)
    service_names = {s.get("metadata", {}).get("name") for s in services}
    claim: ClaimView | None = None
    for item in claims:
        meta = item.get("metadata", {})
        if meta.get("name") == naming.dynamic_claim_name(job_name):
            owners = meta.get("ownerReferences") or []
            claim = ClaimView(
                name=meta["name"],
                owned_by_job=any(o.get("uid") == job_uid for o in owners),
                phase=(item.get("status") or {}).get("phase"),
            )
    return Observed(
        trainer_pods=trainers,
        rendezvous_pod=rendezvous,
        rendezvous_service=naming.rendezvous_name(job_name) in service_names,
        headless_service=naming.headless_service_name(job_name) in service_names,
        service_ports=_service_ports(services, job_name),
        claim=claim,
        stops=tuple(sorted((seen for seen in stops if seen.job_uid == job_uid),
                           key=lambda seen: seen.seen_at)),
    )


Children = tuple[Iterable[Mapping[str, Any]], Iterable[Mapping[str, Any]],
                 Iterable[Mapping[str, Any]]]
"""A job's pods, Services and claims (JSON dicts, camelCase), from the watch caches."""


def _pick(source: Mapping[str, Any], keys: Iterable[str]) -> dict[str, Any]:
    return {key: source[key] for key in keys if source.get(key) is not None}


def slim_pod(pod: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a pod that `pod_view` reads (what the watch cache keeps of each pod)."""
    meta = pod.get("metadata") or {}
    status = pod.get("status") or {}
    return {
        "metadata": _pick(meta, ("name", "uid", "labels", "deletionTimestamp",
                                 "creationTimestamp")),
        "spec": _pick(pod.get("spec") or {}, ("nodeName",)),
        "status": {
            **_pick(status, ("phase", "reason", "podIP", "startTime")),
            "conditions": [c for c in status.get("conditions") or []
                           if c.get("type") in ("PodScheduled", "DisruptionTarget")],
            "containerStatuses": [
                _pick(c, ("name", "state")) for c in status.get("containerStatuses") or []
                if c.get("name") in (naming.TRAINER_CONTAINER, naming.RENDEZVOUS_CONTAINER)],
        },
    }


def slim_object(item: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a Service or claim that `observed_from` reads."""
    ports = [_pick(port, ("name", "port")) for port in (item.get("spec") or {}).get("ports") or []]
    return {"metadata": _pick(item.get("metadata") or {}, ("name", "ownerReferences")),
            "spec": {"ports": ports} if ports else {},
            "status": _pick(item.get("status") or {}, ("phase",))}


def _service_ports(services: Iterable[Mapping[str, Any]], job_name: str) -> dict[str, int]:
    """The ports the job's Services were created with: `rendezvous` (the rendezvous Service)
    and `metrics` (the headless Service), by port name."""
    wanted = {naming.rendezvous_name(job_name): "rendezvous",
              naming.headless_service_name(job_name): "metrics"}
    ports: dict[str, int] = {}
    for service in services:
        port_name = wanted.get((service.get("metadata") or {}).get("name", ""))
        for port in (service.get("spec") or {}).get("ports") or []:
            if port_name is not None and port.get("name") == port_name \
                    and isinstance(port.get("port"), int):
                ports[port_name] = port["port"]
    return ports


def _controller_uid(meta: Mapping[str, Any]) -> str:
    for owner in meta.get("ownerReferences") or []:
        if owner.get("controller"):
            return str(owner.get("uid") or "")
    return ""


STOPS_KEPT_SECONDS = 3600.0
"""How long `StopMemory` keeps a stop (passes read it within seconds)."""
STOPS_KEPT_PER_JOB = 64
"""How many stopped pods `StopMemory` keeps per job (the newest)."""


class StopMemory:
    """The job pods that were ending on purpose, by job, shared by every job's passes (see the
    module docstring): trainer pods whose termination message says `Stopped`, and trainer or
    rendezvous pods a voluntary disruption ends (an eviction, a preemption). One entry per pod
    UID, updated when a later event says more; an entry is forgotten after `max_age_seconds`,
    and a job keeps its newest `max_per_job`."""

    def __init__(self, *, max_age_seconds: float = STOPS_KEPT_SECONDS,
                 max_per_job: int = STOPS_KEPT_PER_JOB) -> None:
        self.max_age_seconds = max_age_seconds
        self.max_per_job = max_per_job
        self._jobs: dict[tuple[str, str], dict[str, StopSeen]] = {}

    def record(self, pod: Mapping[str, Any], now: datetime) -> StopSeen | None:
        """Remember `pod` (a JSON dict) if it is a trainer pod whose termination message says
        `Stopped` or a job pod a voluntary disruption ends; returns the entry when it is new or
        says more than before (first the eviction, then the stop)."""
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        job = labels.get(naming.JOB_LABEL)
        if not job or labels.get(naming.ROLE_LABEL) not in (naming.ROLE_TRAINER,
                                                            naming.ROLE_RENDEZVOUS):
            return None
        view = pod_view(pod)
        stopped = view.outcome is not None and view.outcome.stopped
        if not stopped and not view.voluntarily_disrupted:
            return None
        seen = self._jobs.setdefault((meta.get("namespace") or "", job), {})
        before = seen.get(view.uid)
        if before is not None and (before.pod.outcome is not None or not stopped) and (
                before.pod.disruption is not None or view.disruption is None):
            return None
        if before is not None and view.disruption is None:
            view = dataclasses.replace(view, disruption=before.pod.disruption)
        stop = StopSeen(pod=view, job_uid=_controller_uid(meta),
                        seen_at=before.seen_at if before is not None else now)
        seen[view.uid] = stop
        if len(seen) > self.max_per_job:
            oldest = sorted(seen.values(), key=lambda s: s.seen_at)[: len(seen) - self.max_per_job]
            for gone in oldest:
                seen.pop(gone.pod.uid, None)
        return stop

    def seen(self, namespace: str, job_name: str, now: datetime) -> list[StopSeen]:
        """The stops remembered for a job (every UID of that name), oldest first; older ones are
        forgotten."""
        key = (namespace, job_name)
        kept = {uid: stop for uid, stop in self._jobs.get(key, {}).items()
                if (now - stop.seen_at).total_seconds() <= self.max_age_seconds}
        if kept:
            self._jobs[key] = kept
        else:
            self._jobs.pop(key, None)
        return sorted(kept.values(), key=lambda stop: stop.seen_at)


def _as_json(api: kubernetes.client.ApiClient, items: Iterable[Any]) -> list[dict[str, Any]]:
    sanitize: Any = api.sanitize_for_serialization  # untyped in the client's stubs
    return [sanitize(item) for item in items]


def _read_children(
    api: kubernetes.client.ApiClient, namespace: str, job_name: str, timeout: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    core = kubernetes.client.CoreV1Api(api)
    selector = naming.job_selector(job_name)
    pods = core.list_namespaced_pod(namespace, label_selector=selector,
                                    _request_timeout=timeout).items
    services = core.list_namespaced_service(namespace, label_selector=selector,
                                            _request_timeout=timeout).items
    claims = core.list_namespaced_persistent_volume_claim(namespace, label_selector=selector,
                                                          _request_timeout=timeout).items
    return _as_json(api, pods), _as_json(api, services), _as_json(api, claims)


def _list_nodes(api: kubernetes.client.ApiClient, timeout: float) -> list[dict[str, Any]]:
    """Every node, as JSON dicts; from the watch cache, parsed without the client's models
    (a thousand nodes with their image lists are megabytes)."""
    response: Any = kubernetes.client.CoreV1Api(api).list_node(
        resource_version="0", _preload_content=False, _request_timeout=timeout)
    items: list[dict[str, Any]] = json.loads(response.data).get("items") or []
    return items


class NodeCache:
    """Every node's readiness, shared by the passes of every job: at most one LIST of nodes per
    `max_age_seconds`, however many jobs and pods there are."""

    def __init__(self, *, max_age_seconds: float = NODE_CACHE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age_seconds = max_age_seconds
        self._clock = clock
        self._lock = asyncio.Lock()
        self._nodes: dict[str, NodeView] | None = None
        self._listed_at = 0.0
        self._forbidden_at: float | None = None
        self._said_forbidden = False

    async def nodes(
        self, lister: Callable[[], list[dict[str, Any]]]
    ) -> Mapping[str, NodeView] | None:
        """The nodes by name, listed again through `lister` when older than the maximum age;
        None when they cannot be read (no RBAC on nodes, or the LIST failed)."""
        async with self._lock:
            now = self._clock()
            if self._forbidden_at is not None:
                if now - self._forbidden_at < FORBIDDEN_RETRY_SECONDS:
                    return None
                self._forbidden_at = None
            if self._nodes is not None and now - self._listed_at < self.max_age_seconds:
                return self._nodes
            try:
                items = await asyncio.to_thread(lister)
            except ApiException as error:
                if error.status in (401, 403):
                    self._forbidden_at = now
                    if not self._said_forbidden:
                        self._said_forbidden = True
                        LOG.warning(
                            "Cannot list nodes (%s %s): working without node information; a "
                            "pod on a lost node is seen only by its missing heartbeats and "
                            "is never force-deleted (grant get/list/watch on nodes: "
                            "rbac.clusterScoped=true)", error.status, error.reason)
                    return None
                LOG.warning("Listing nodes failed (%s %s): this pass has no node information",
                            error.status, error.reason)
                self._nodes = None
                return None
            self._nodes = {view.name: view for view in map(node_view, items)}
            self._listed_at = now
            return self._nodes


async def observe(
    api: kubernetes.client.ApiClient, *, namespace: str, job_name: str, job_uid: str,
    timeout: float, node_cache: NodeCache | None = None, children: Children | None = None,
    stops: Iterable[StopSeen] = (),
) -> Observed:
    """The job's children from the watch caches (`children`), else read now (each API call
    bounded by `timeout` seconds), their nodes' readiness from `node_cache` when one is given,
    and the stops the pod watch remembered."""
    if children is not None:
        pods, services, claims = children
    else:
        pods, services, claims = await asyncio.to_thread(
            _read_children, api, namespace, job_name, timeout)
    nodes = None
    if node_cache is not None:
        nodes = await node_cache.nodes(lambda: _list_nodes(api, timeout))
    return observed_from(
        job_name=job_name, job_uid=job_uid, pods=pods, services=services, claims=claims,
        nodes=nodes, stops=stops,
    )


# --- Kueue ----------------------------------------------------------------------------------------


def placement_of(item: Mapping[str, Any]) -> Placement:
    """A Placement from an object with `nodeSelector` and `tolerations` (a pod template, a pod
    set update)."""
    return Placement(node_selector=dict(item.get("nodeSelector") or {}),
                     tolerations=tuple(dict(t) for t in item.get("tolerations") or []))


def workload_view(workload: Mapping[str, Any]) -> WorkloadView:
    """A Kueue Workload (a JSON dict) seen through the decisions' eyes."""
    meta = workload.get("metadata") or {}
    spec = workload.get("spec") or {}
    status = workload.get("status") or {}
    conditions = [c for c in status.get("conditions") or [] if isinstance(c, Mapping)]
    admission = status.get("admission") or {}
    flavors = {
        str(a.get("name", "")): tuple(sorted(set((a.get("flavors") or {}).values())))
        for a in admission.get("podSetAssignments") or []
    }
    updates: dict[str, tuple[Placement, ...]] = {}
    for check in status.get("admissionChecks") or []:
        for update in check.get("podSetUpdates") or []:
            name = str(update.get("name", ""))
            updates[name] = (*updates.get(name, ()), placement_of(update))
    return WorkloadView(
        name=meta.get("name", ""),
        resource_version=meta.get("resourceVersion", ""),
        generation=meta.get("generation"),
        queue_name=spec.get("queueName", ""),
        active=spec.get("active", True) is not False,
        pod_sets=tuple(spec.get("podSets") or []),
        conditions={c.get("type", ""): WorkloadCondition(
            status=c.get("status", ""), reason=c.get("reason", ""),
            message=c.get("message", "")) for c in conditions},
        raw_conditions=tuple(dict(c) for c in conditions),
        cluster_queue=admission.get("clusterQueue"),
        flavors=flavors,
        check_updates=updates,
    )


def flavor_view(flavor: Mapping[str, Any]) -> FlavorView:
    """A Kueue ResourceFlavor (a JSON dict): its node labels and tolerations."""
    spec = flavor.get("spec") or {}
    return FlavorView(
        name=(flavor.get("metadata") or {}).get("name", ""),
        node_labels=dict(spec.get("nodeLabels") or {}),
        tolerations=tuple(dict(t) for t in spec.get("tolerations") or []),
    )


def _missing_object(error: ApiException, name: str) -> bool:
    """A 404 for the object itself (a Status naming it), not for an API the server lacks."""
    try:
        body = json.loads(error.body or "{}")
    except ValueError:
        return False
    details = body.get("details") if isinstance(body, dict) else None
    return isinstance(details, dict) and details.get("name") == name


def _unavailable(error: ApiException) -> str:
    if error.status == 404:
        return (f"the API server does not serve {kueueapi.API_VERSION} {kueueapi.WORKLOADS}: "
                "Kueue (v0.17 or later) is not installed")
    return (f"the API server refused to read {kueueapi.API_VERSION} {kueueapi.WORKLOADS} "
            f"({error.status} {error.reason}): the operator's RBAC lacks Kueue's objects")


def _read_queue(api: kubernetes.client.ApiClient, namespace: str, queue_name: str,
                workload_name: str, timeout: float) -> QueueView:
    custom = kubernetes.client.CustomObjectsApi(api)
    try:
        raw: Any = custom.get_namespaced_custom_object(
            kueueapi.GROUP, kueueapi.VERSION, namespace, kueueapi.WORKLOADS, workload_name,
            _request_timeout=timeout)
    except ApiException as error:
        if error.status == 404 and _missing_object(error, workload_name):
            return QueueView(queue_name=queue_name)
        if error.status in (401, 403, 404):
            return QueueView(queue_name=queue_name, unavailable=_unavailable(error))
        raise
    workload = workload_view(raw)
    flavors: dict[str, FlavorView] = {}
    if workload.true(kueueapi.QUOTA_RESERVED):
        for name in sorted({f for names in workload.flavors.values() for f in names}):
            try:
                flavor: Any = custom.get_cluster_custom_object(
                    kueueapi.GROUP, kueueapi.VERSION, kueueapi.RESOURCE_FLAVORS, name,
                    _request_timeout=timeout)
                flavors[name] = flavor_view(flavor)
            except ApiException as error:
                if error.status not in (403, 404):
                    raise  # a missing or unreadable flavor is left out: the decision says so
    return QueueView(queue_name=queue_name, workload=workload, flavors=flavors)


async def observe_queue(
    api: kubernetes.client.ApiClient, *, namespace: str, queue_name: str, workload_name: str,
    timeout: float,
) -> QueueView:
    """The job's Workload and, while quota is reserved for it, the flavors of its admission
    (each API call bounded by `timeout` seconds)."""
    return await asyncio.to_thread(_read_queue, api, namespace, queue_name, workload_name,
                                   timeout)
