"""Read what Kueue says of a job queued through it (label `kueue.x-k8s.io/queue-name`).

One GET of the job's Workload per pass and, while quota is reserved for it, of the ResourceFlavors
of its admission (`observe_queue`, into `observed.QueueView`); a job without the label costs no
Kueue call, and a cluster without Kueue (or an operator without RBAC on Kueue's objects) is no
error: the view says why it could not read (`QueueView.unavailable`). `workload_view` and
`flavor_view` are the pure half (JSON dicts into views). docs/kueue.md tells the whole story.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from typing import Any

import kubernetes.client
from kubernetes.client.exceptions import ApiException

from rtj_operator import kueueapi
from rtj_operator.observed import FlavorView, Placement, QueueView, WorkloadCondition, WorkloadView


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
