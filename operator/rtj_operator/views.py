"""API objects (JSON dicts, camelCase) as the decisions see them: the pure half of observing.

`pod_view` and `node_view` turn a pod and a node into the records of `observed.py`, and
`observed_from` turns a job's labelled pods, Services and claims (and the nodes and stops the
operator keeps) into its `Observed` record. The operator's watch caches (kopf indexes in
handlers.py) keep only the fields these functions read (`slim_pod`, `slim_object`), so what the
caches hold is defined next to what is read from them. No API call here: `observe.py` reads the
objects, and tests/unit/test_operator_observe.py checks the views without a cluster.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from rtj_wire import termination

from rtj_operator import naming
from rtj_operator.observed import ClaimView, NodeView, Observed, PodView, StopSeen

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
        spec_hash=labels.get(naming.SPEC_HASH_LABEL),
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


class PodViewCache:
    """The views of one job's pods, kept between passes: a pod whose watch-cache entry is the
    same object as before (the watch replaces an entry when the pod changes) and whose node
    looks the same is not viewed again (5,000 pod views were a sixth of a pass). Bounded: when
    it holds over three times the pods of the last call, only that call's views are kept."""

    def __init__(self) -> None:
        self._views: dict[tuple[int, NodeView | None], tuple[Mapping[str, Any], PodView]] = {}

    def views(self, pods: Iterable[Mapping[str, Any]],
              nodes: Mapping[str, NodeView] | None) -> list[PodView]:
        found: list[PodView] = []
        used: list[tuple[int, NodeView | None]] = []
        for pod in pods:
            node_name = (pod.get("spec") or {}).get("nodeName")
            node = nodes.get(node_name) if nodes is not None and node_name else None
            key = (id(pod), node)
            kept = self._views.get(key)
            if kept is None or kept[0] is not pod:
                kept = (pod, pod_view(pod, nodes))
                self._views[key] = kept
            found.append(kept[1])
            used.append(key)
        if len(self._views) > 3 * len(used) + 16:
            self._views = {key: self._views[key] for key in used}
        return found


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
    nodes_disrupted: str | None = None,
    cache: PodViewCache | None = None,
) -> Observed:
    """The Observed record of a job from its labelled children (JSON dicts), the nodes by name
    (None: the operator cannot read nodes), why no node counts as lost now (`nodes_disrupted`,
    `NodeCache.disruption`) and the stops the pod watch saw (`StopMemory`); `cache` keeps the
    job's pod views between calls."""
    trainers: dict[int, PodView] = {}
    rendezvous: PodView | None = None
    seen = (cache.views(pods, nodes) if cache is not None
            else [pod_view(pod, nodes) for pod in pods])
    for view in seen:
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
        network_policy=_network_policy_digest(services, job_name),
        service_ports=_service_ports(services, job_name),
        claim=claim,
        stops=tuple(sorted((seen for seen in stops if seen.job_uid == job_uid),
                           key=lambda seen: seen.seen_at)),
        nodes_disrupted=nodes_disrupted,
    )


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
    meta = item.get("metadata") or {}
    ours = {key: value for key, value in (meta.get("annotations") or {}).items()
            if key == naming.NETWORK_POLICY_ANNOTATION}
    kept = _pick(meta, ("name", "ownerReferences"))
    if ours:
        kept["annotations"] = ours
    return {"metadata": kept,
            "spec": {"ports": ports} if ports else {},
            "status": _pick(item.get("status") or {}, ("phase",))}


def _network_policy_digest(services: Iterable[Mapping[str, Any]], job_name: str) -> str | None:
    """The digest of the job's NetworkPolicy on its headless Service (None: none recorded)."""
    for service in services:
        meta = service.get("metadata") or {}
        if meta.get("name") == naming.headless_service_name(job_name):
            value = (meta.get("annotations") or {}).get(naming.NETWORK_POLICY_ANNOTATION)
            return value if isinstance(value, str) else None
    return None


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
