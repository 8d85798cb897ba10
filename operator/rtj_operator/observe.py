"""Read a job's children into an `Observed` record.

The operator keeps watch caches of every labelled pod, Service and claim (kopf indexes in
handlers.py, fed by one watch per kind, holding only the fields the decisions read:
`views.slim_pod`, `views.slim_object`), so a pass makes no API call to observe. Without them
(`children` None) a pass lists the three kinds by the job label, in a worker thread (the
kubernetes client is synchronous). The pure half, turning API objects into views, is `views.py`;
the stops the pod watch remembered come from `stopmemory.py`, and a queued job's Kueue objects are
read by `kueueobserve.py`.

Nodes are read once for every job: `NodeCache` holds the readiness of every node from one LIST
(served from the API server's watch cache, `resourceVersion=0`), refreshed at most every
`NODE_CACHE_SECONDS`, and each job's pods are annotated with their node's Ready condition and
lost-node taints. Without RBAC on nodes (`rbac.clusterScoped=false`) the operator logs that once
and works without node information: it then cannot tell a lost node from a slow one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

import kubernetes.client
from kubernetes.client.exceptions import ApiException

from rtj_operator import naming
from rtj_operator.observed import NodeView, Observed, StopSeen
from rtj_operator.views import PodViewCache, node_view, observed_from

LOG = logging.getLogger("rtj_operator")
NODE_CACHE_SECONDS = 10.0
"""How old the shared node list may be before a pass lists nodes again. The node controller
marks a node lost only after its grace period (40-50 s), so 10 s adds little to detection."""
NODE_MAX_STALE_SECONDS = 60.0
"""While LISTs of nodes fail, how old a list may still be served (a pass then acts on readiness
up to this old; older, it works without node information, as without RBAC on nodes)."""
FAILED_RETRY_SECONDS = 5.0
"""After a LIST of nodes failed, how long before one is tried again (not once per pass)."""
DISRUPTION_GRACE_SECONDS = 50.0
"""After a disruption (every node NotReady at once) ends, how long a node still NotReady keeps
its pods from counting as lost: the node lifecycle controller likewise gives every node a new
grace period when a zone leaves full disruption (its node-monitor-grace-period, 50 s)."""
FORBIDDEN_RETRY_SECONDS = 600.0
"""After the API server refused to list nodes, how long the operator works without them before
it tries again (RBAC may have been granted meanwhile)."""


Children = tuple[Iterable[Mapping[str, Any]], Iterable[Mapping[str, Any]],
                 Iterable[Mapping[str, Any]]]
"""A job's pods, Services and claims (JSON dicts, camelCase), from the watch caches."""


def _read_children(
    api: kubernetes.client.ApiClient, namespace: str, job_name: str, timeout: float
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
    """The job's pods, Services and claims, as JSON dicts parsed without the client's models
    (5,000 pods through the models took most of a pass: every env var, managed field...)."""
    core = kubernetes.client.CoreV1Api(api)
    selector = naming.job_selector(job_name)

    def items(response: Any) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = json.loads(response.data).get("items") or []
        return found

    pods = core.list_namespaced_pod(namespace, label_selector=selector,
                                    _request_timeout=timeout, _preload_content=False)
    services = core.list_namespaced_service(namespace, label_selector=selector,
                                            _request_timeout=timeout, _preload_content=False)
    claims = core.list_namespaced_persistent_volume_claim(
        namespace, label_selector=selector, _request_timeout=timeout, _preload_content=False)
    return items(pods), items(services), items(claims)


def _list_nodes(api: kubernetes.client.ApiClient, timeout: float) -> list[dict[str, Any]]:
    """Every node, as JSON dicts; from the watch cache, parsed without the client's models
    (a thousand nodes with their image lists are megabytes)."""
    response: Any = kubernetes.client.CoreV1Api(api).list_node(
        resource_version="0", _preload_content=False, _request_timeout=timeout)
    items: list[dict[str, Any]] = json.loads(response.data).get("items") or []
    return items


class NodeCache:
    """Every node's readiness, shared by the passes of every job: at most one LIST of nodes per
    `max_age_seconds`, however many jobs and pods there are, and no pass ever waits on another's
    LIST (review-2 F3). A list older than the maximum age is still served while one LIST runs
    in the background; a failed LIST (any error: a timeout or a connection reset is not an
    `ApiException`) keeps serving the last list up to `max_stale_seconds` old and is tried again
    after `FAILED_RETRY_SECONDS`. Only a pass with no list yet waits, for the one LIST in flight
    that every such pass shares.

    It also tells a disruption from lost nodes (`disruption`): when every node is NotReady at
    once, the node lifecycle controller's "full disruption", the control plane or the network
    failed, not every node, and no pod counts as lost until a node is Ready again and
    `DISRUPTION_GRACE_SECONDS` have passed (a 40 s etcd stall once marked every node Unknown
    and the operator force-deleted healthy pods as lost)."""

    def __init__(self, *, max_age_seconds: float = NODE_CACHE_SECONDS,
                 max_stale_seconds: float = NODE_MAX_STALE_SECONDS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_age_seconds = max_age_seconds
        self.max_stale_seconds = max_stale_seconds
        self._clock = clock
        self._nodes: dict[str, NodeView] | None = None
        self._listed_at = 0.0
        self._forbidden_at: float | None = None
        self._failed_at: float | None = None
        self._said_forbidden = False
        self._in_flight: asyncio.Task[None] | None = None
        self._disrupted: str | None = None
        """Since when every node is NotReady (a UTC time, for the message), else None."""
        self._recovered: tuple[float, str] | None = None
        """When the last disruption ended (monotonic, and as UTC text)."""

    async def nodes(
        self, lister: Callable[[], list[dict[str, Any]]]
    ) -> Mapping[str, NodeView] | None:
        """The nodes by name (listed again through `lister` when older than the maximum age);
        None when they cannot be read (no RBAC on nodes, or no LIST succeeded recently)."""
        now = self._clock()
        if self._forbidden_at is not None:
            if now - self._forbidden_at < FORBIDDEN_RETRY_SECONDS:
                return None
            self._forbidden_at = None
        fresh = self._nodes is not None and now - self._listed_at < self.max_age_seconds
        resting = self._failed_at is not None and now - self._failed_at < FAILED_RETRY_SECONDS
        if not fresh and not resting and self._in_flight is None:
            self._in_flight = asyncio.ensure_future(self._refresh(lister))
        if self._nodes is None and self._in_flight is not None:
            await asyncio.shield(self._in_flight)  # nothing to serve yet: share the one LIST
        return self._served()

    def _served(self) -> dict[str, NodeView] | None:
        if self._forbidden_at is not None or self._nodes is None:
            return None
        if self._clock() - self._listed_at > self.max_stale_seconds:
            return None  # too old to act on: a pass works without node information
        return self._nodes

    async def _refresh(self, lister: Callable[[], list[dict[str, Any]]]) -> None:
        try:
            items = await asyncio.to_thread(lister)
        except ApiException as error:
            if error.status in (401, 403):
                self._forbidden_at = self._clock()
                if not self._said_forbidden:
                    self._said_forbidden = True
                    LOG.warning(
                        "Cannot list nodes (%s %s): working without node information; a "
                        "pod on a lost node is seen only by its missing heartbeats and "
                        "is never force-deleted (grant get/list/watch on nodes: "
                        "rbac.clusterScoped=true)", error.status, error.reason)
            else:
                self._failed(f"{error.status} {error.reason}")
        except Exception as error:  # a timeout, a connection reset: urllib3's, not the client's
            self._failed(f"{type(error).__name__}: {error}")
        else:
            self._nodes = {view.name: view for view in map(node_view, items)}
            self._listed_at = self._clock()
            self._failed_at = None
            self._judge_disruption(self._nodes)
        finally:
            self._in_flight = None

    def _judge_disruption(self, nodes: Mapping[str, NodeView]) -> None:
        everyone_down = bool(nodes) and all(view.ready != "True" for view in nodes.values())
        stamp = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        if everyone_down and self._disrupted is None:
            self._disrupted = stamp
            LOG.warning("Every node (%d) is NotReady at once: a control-plane or network "
                        "disruption; no pod counts as lost until a node is Ready again",
                        len(nodes))
        elif not everyone_down and self._disrupted is not None:
            self._disrupted = None
            self._recovered = (self._clock(), stamp)
            LOG.warning("Nodes are Ready again after a disruption: a node still NotReady counts "
                        "as lost in %.0f s", DISRUPTION_GRACE_SECONDS)

    def disruption(self) -> str | None:
        """Why no node counts as lost now (for `Observed.nodes_disrupted` and the job's
        `ObservationDegraded` condition), or None: nodes are judged one by one."""
        if self._nodes is None:
            return None
        if self._disrupted is not None:
            return (f"every node ({len(self._nodes)}) is NotReady at once since "
                    f"{self._disrupted}: a control-plane or network disruption, so no pod "
                    "counts as lost on its node's word until a node is Ready again")
        if self._recovered is not None:
            at, stamp = self._recovered
            if self._clock() - at < DISRUPTION_GRACE_SECONDS:
                return (f"nodes came back from a disruption (every node NotReady) at {stamp}; "
                        f"a node still NotReady counts as lost {DISRUPTION_GRACE_SECONDS:.0f} s "
                        "after that")
            self._recovered = None
        return None

    def _failed(self, why: str) -> None:
        self._failed_at = self._clock()
        LOG.warning("Listing nodes failed (%s): serving the last list (up to %.0f s old) and "
                    "trying again in %.0f s", why, self.max_stale_seconds, FAILED_RETRY_SECONDS)


async def observe(
    api: kubernetes.client.ApiClient, *, namespace: str, job_name: str, job_uid: str,
    timeout: float, node_cache: NodeCache | None = None, children: Children | None = None,
    stops: Iterable[StopSeen] = (),
    views: PodViewCache | None = None,
    spent: list[float] | None = None,
) -> Observed:
    """The job's children from the watch caches (`children`), else read now (each API call
    bounded by `timeout` seconds), their nodes' readiness from `node_cache` when one is given,
    and the stops the pod watch remembered; `views` keeps the job's pod views between passes.
    `spent` gets the seconds spent viewing them, without the waits for a list."""
    if children is not None:
        pods, services, claims = children
    else:
        pods, services, claims = await asyncio.to_thread(
            _read_children, api, namespace, job_name, timeout)
    nodes = None
    disrupted = None
    if node_cache is not None:
        nodes = await node_cache.nodes(lambda: _list_nodes(api, timeout))
        disrupted = node_cache.disruption() if nodes is not None else None
    began = time.monotonic()
    observed = observed_from(
        job_name=job_name, job_uid=job_uid, pods=pods, services=services, claims=claims,
        nodes=nodes, stops=stops, nodes_disrupted=disrupted, cache=views,
    )
    if spent is not None:
        spent.append(time.monotonic() - began)
    return observed
