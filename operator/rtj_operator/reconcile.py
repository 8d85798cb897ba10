"""One reconcile pass of one job: observe, decide, act.

The handlers (`handlers.py`) call `run_pass` from kopf's timer and from the create/update/resume
handlers; a per-job lock keeps two passes of the same job from interleaving. The pass applies the
decided actions, returns the status fields that changed (the handler writes them with one patch)
and the Events to post.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import kubernetes.client
import pydantic
from pydantic.alias_generators import to_camel

from rtj_operator import actions, decisions, metrics, observe, scraping
from rtj_operator.api.models import parse_job, parse_status, plain
from rtj_operator.api.status import ResilientTrainingJobStatus, compact_ranks
from rtj_operator.config import OperatorSettings
from rtj_operator.errors import InvalidJobError
from rtj_operator.intents import CreateObject, DeletePod, PostEvent
from rtj_operator.podplan import plan_for


@dataclass
class JobMemo:
    """What the operator keeps in memory for one job between passes."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    memory: decisions.Memory = field(default_factory=decisions.Memory)
    expected: dict[str, float] = field(default_factory=dict)
    """This operator's own writes the watch cache has not shown yet ("<name>" created,
    "-<uid>" pod deleted), with when (monotonic) they were made: see `cache_lags`."""
    last_status_write: float | None = None
    """When (monotonic) this operator last wrote the job's status; progress-only changes wait
    `status_progress_interval_seconds` after it."""


@dataclass(frozen=True)
class PassResult:
    """The status fields to patch and the Events to post."""

    status_patch: dict[str, Any]
    events: list[PostEvent]


def api_status(status: ResilientTrainingJobStatus) -> dict[str, Any]:
    """The status as the API stores it (camelCase, JSON types), plus null for each top-level
    field the decision set to None on purpose: the merge patch then removes it from the object
    (startTime while suspended). A field the decision left unset keeps its value."""
    data = status.to_api()
    if "ranks" in data:
        data["ranks"] = [r.to_api() for r in compact_ranks(status.ranks)]
    for name in status.model_fields_set:
        if getattr(status, name) is None:
            data[to_camel(name)] = None
    return data


def status_patch(current: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch that turns status `current` into `desired` (None removes a field)."""
    return {key: value for key, value in desired.items() if current.get(key) != value}


PROGRESS_FIELDS = frozenset({"step", "goodput", "lastCheckpoint", "progressClock"})
"""Top-level status fields that change as training merely advances."""
PROGRESS_RANK_FIELDS = frozenset({"lastHeartbeatTime", "step"})
"""Fields of a ranks[] entry that change as training merely advances."""


def _without_progress(status: Mapping[str, Any]) -> dict[str, Any]:
    kept = {k: v for k, v in status.items() if k not in PROGRESS_FIELDS}
    ranks = kept.get("ranks")
    if isinstance(ranks, list):
        kept["ranks"] = [{k: v for k, v in r.items() if k not in PROGRESS_RANK_FIELDS}
                         if isinstance(r, Mapping) else r for r in ranks]
    return kept


def only_progress(current: Mapping[str, Any], patch: Mapping[str, Any]) -> bool:
    """Whether applying `patch` to status `current` changes nothing but progress (heartbeat
    times, steps, goodput, the newest checkpoint, the progress clock)."""
    return _without_progress({**current, **patch}) == _without_progress(current)


EXPECTATION_SECONDS = 120.0
"""An own write the watch cache still does not show after this long is forgotten (someone else
changed the object meanwhile); until then a pass lists the children instead of trusting the
cache."""


def _names_and_live_uids(children: observe.Children) -> tuple[set[str], set[str]]:
    pods, services, claims = children
    names: set[str] = set()
    live: set[str] = set()
    for group in (pods, services, claims):
        for item in group:
            meta = item.get("metadata") or {}
            names.add(meta.get("name", ""))
            if group is pods and not meta.get("deletionTimestamp"):
                live.add(meta.get("uid", ""))
    return names, live


def unmet_expectations(expected: Mapping[str, float], children: observe.Children) -> set[str]:
    """The own writes that `children` does not show yet: a created object missing, a deleted
    pod still there and not deleting."""
    names, live = _names_and_live_uids(children)
    return {key for key in expected
            if (key[1:] in live if key.startswith("-") else key not in names)}


def expectations_after(actions: list[Any], expected: Mapping[str, float],
                       now: float, refused: Iterable[str] = ()) -> dict[str, float]:
    """The expectations once `actions` were applied at `now` (stale ones dropped); a create the
    API server `refused` (by name) made nothing for the cache to show."""
    kept = {k: t for k, t in expected.items() if now - t < EXPECTATION_SECONDS}
    refused_names = set(refused)
    for action in actions:
        if isinstance(action, CreateObject):
            name = action.manifest["metadata"]["name"]
            if name not in refused_names:
                kept[name] = now
        elif isinstance(action, DeletePod):
            kept["-" + action.uid] = now
    return kept


def now_utc() -> datetime:
    """The clock of a pass, to whole seconds (status times are metav1.Time-like)."""
    return datetime.now(UTC).replace(microsecond=0)


async def run_pass(
    *,
    body: Mapping[str, Any],
    memo: JobMemo,
    api: kubernetes.client.ApiClient,
    settings: OperatorSettings,
    scraper: scraping.Scraper,
    node_cache: observe.NodeCache | None = None,
    children: observe.Children | None = None,
    stop_memory: observe.StopMemory | None = None,
) -> PassResult:
    """Observe the job's children (from the operator's watch caches, `children`; listed from
    the API server when None), their nodes (the operator-wide `node_cache`), the stops the pod
    watch remembered (`stop_memory`) and the ranks, decide, apply the actions."""
    started = time.monotonic()
    raw = plain(body)
    current_status = raw.get("status") or {}
    try:
        job = parse_job({k: v for k, v in raw.items() if k != "status"})
    except pydantic.ValidationError as error:
        message = f"the spec cannot be used: {error}"
        status = decisions.invalid_spec(
            raw.get("metadata", {}).get("generation"), message, now_utc()
        )
        raise InvalidJobError(message, status_patch(current_status, api_status(status))) \
            from error
    try:
        job = job.model_copy(update={"status": parse_status(current_status)})
    except pydantic.ValidationError:
        # A status this version cannot read (written by another version, or by hand) is
        # rebuilt from what the cluster shows; it never makes the job itself invalid.
        job = job.model_copy(update={"status": None})
    namespace = job.metadata.namespace or ""
    plan = plan_for(job, settings)
    if children is not None:
        unmet = unmet_expectations(memo.expected, children)
        memo.expected = {k: t for k, t in memo.expected.items()
                         if k in unmet and started - t < EXPECTATION_SECONDS}
        if memo.expected:
            children = None  # the watch cache lags behind our own writes: list this time
    stops = (stop_memory.seen(namespace, job.name, now_utc())
             if stop_memory is not None else ())
    observed = await observe.observe(
        api, namespace=namespace, job_name=job.name, job_uid=job.metadata.uid or "",
        timeout=settings.api_request_timeout_seconds, node_cache=node_cache, children=children,
        stops=stops,
    )
    liveness = await scraper.scrape(
        observed.trainer_pods.values(),
        base_port=settings.trainer_metrics_port,
        procs=plan.procs_per_node,
    )
    decision = decisions.decide(
        job=job, plan=plan, observed=observed, liveness=liveness, now=now_utc(),
        memory=memo.memory,
        settings=settings,
    )
    refused = await actions.apply(api, namespace=namespace, job_name=job.name,
                                  actions=decision.actions,
                                  timeout=settings.api_request_timeout_seconds)
    # A create refused by admission becomes the AdmissionRefused condition, not a retry loop.
    decision = decisions.with_refusals(decision, refused, now_utc())
    memo.memory = decision.memory
    memo.expected = expectations_after(decision.actions, memo.expected, time.monotonic(),
                                       refused=(r.name for r in refused))
    for applied in [*decision.actions, *decision.events]:
        metrics.ACTIONS.labels(action=type(applied).__name__).inc()  # PostEvent counted too
    for incident in decision.incidents:
        if incident.action in decisions.OPERATOR_ACTIONS:
            metrics.RESTARTS.labels(action=incident.action).inc()
    metrics.RECONCILE_SECONDS.observe(time.monotonic() - started)
    metrics.record_job_state(f"{namespace}/{job.name}", decision.status.state)
    metrics.record_job_status(namespace, job.name, decision.status)
    patch = status_patch(current_status, api_status(decision.status))
    now = time.monotonic()
    if patch and only_progress(current_status, patch) and memo.last_status_write is not None \
            and now - memo.last_status_write < settings.status_progress_interval_seconds:
        patch = {}  # training merely advanced: written with the next change or later
    if patch:
        memo.last_status_write = now
    return PassResult(status_patch=patch, events=decision.events)
