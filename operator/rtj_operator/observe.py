"""Read a job's children from the API server into an `Observed` record.

Three list calls by the job label (pods, services, claims) per pass; the kubernetes client is
synchronous, so the calls run in a worker thread and never block kopf's event loop. The pure
half, turning API objects into views, is separate (`pod_view`, `observed_from`) and unit-tested.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

import kubernetes.client

from rtj_operator import naming, termination
from rtj_operator.observed import ClaimView, Observed, PodView


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


def pod_view(pod: Mapping[str, Any]) -> PodView:
    """A pod (as a JSON dict, camelCase) seen through the decisions' eyes."""
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
        node_name=(pod.get("spec") or {}).get("nodeName"),
        pod_ip=status.get("podIP"),
        outcome=outcome,
        outcome_problem=problem,
    )


def observed_from(
    *,
    job_name: str,
    job_uid: str,
    pods: Iterable[Mapping[str, Any]],
    services: Iterable[Mapping[str, Any]],
    claims: Iterable[Mapping[str, Any]],
) -> Observed:
    """The Observed record of a job from its labelled children (JSON dicts)."""
    trainers: dict[int, PodView] = {}
    rendezvous: PodView | None = None
    for pod in pods:
        view = pod_view(pod)
        if view.role == naming.ROLE_TRAINER and view.node_index is not None:
            if view.name == naming.trainer_pod_name(job_name, view.node_index):
                trainers[view.node_index] = view
        elif view.role == naming.ROLE_RENDEZVOUS and view.name == naming.rendezvous_name(job_name):
            rendezvous = view
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
        claim=claim,
    )


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


async def observe(
    api: kubernetes.client.ApiClient, *, namespace: str, job_name: str, job_uid: str,
    timeout: float,
) -> Observed:
    """Read the job's children now (each API call bounded by `timeout` seconds)."""
    pods, services, claims = await asyncio.to_thread(
        _read_children, api, namespace, job_name, timeout)
    return observed_from(
        job_name=job_name, job_uid=job_uid, pods=pods, services=services, claims=claims
    )
