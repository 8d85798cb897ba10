"""One reconcile pass of one job: observe, decide, act.

The job's loop (`jobloop.py`) calls `run_pass`; a per-job lock keeps two passes of the same job
from interleaving. A pass reads the liveness of every running trainer pod, of only some
(`Reads`: the pods whose heartbeat deadline came), or of none, reusing each pod's last read
(`JobMemo.liveness`; the decisions measure a heartbeat's age at its read). It applies the decided
actions and returns the status fields that changed (the loop writes them with one patch) and the
Events to post. The patch is computed against the status the watch shows, overlaid with this
operator's own writes the watch has not shown yet (`unseen_writes`).
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

from rtj_operator import (
    actions,
    decisions,
    kueueapi,
    kueueobserve,
    metrics,
    naming,
    observe,
    scraping,
    stopmemory,
    views,
)
from rtj_operator.api.models import ResilientTrainingJob, parse_job, parse_status, plain
from rtj_operator.api.status import ResilientTrainingJobStatus, compact_ranks
from rtj_operator.api.vocabulary import IncidentCause
from rtj_operator.config import OperatorSettings, pinned_to_services
from rtj_operator.errors import InvalidJobError
from rtj_operator.intents import CreateObject, DeletePod, PostEvent
from rtj_operator.observed import NodeLiveness, Observed, PodView, QueueView
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
    """When (monotonic) this operator last wrote the job's status (a patch the API server took:
    `remember_written`); progress-only changes wait `status_progress_interval_seconds` after
    it."""
    unanswered: bool = False
    """A request of this job's passes found the API server not answering since its last status
    write went through: the next write may carry values observed just before the return."""
    workload_settled: bool = False
    """A job queued through Kueue: its Workload was seen Finished (or there is none), so a
    finished job without pods needs no more passes (`jobloop.finished_and_idle`)."""
    liveness: dict[int, NodeLiveness] = field(default_factory=dict)
    """Each running trainer pod's last liveness read (stamped with its time), by node index; a
    pod that did not answer its last read is missing."""
    recheck: dict[int, float] = field(default_factory=dict)
    """The last decision's heartbeat deadlines (Unix time), by node index: a read of that pod
    just after it decides whether it is Unresponsive or hung."""
    renewable: dict[int, float] = field(default_factory=dict)
    """The deadlines of `recheck` that a quiet read may move without a pass, with the heartbeat
    each is timed from (`Decision.renewable`; the job's loop updates both)."""
    heartbeat_timeout_seconds: float = 0.0
    builtin_trainer: bool = True
    """The spec's heartbeatTimeoutSeconds and whether the workers are the built-in trainer,
    from the last pass: what a quiet read at a deadline is judged by (`renewed_deadline`)."""
    procs_per_node: int | None = None
    """Ranks per pod, from the last pass's plan: what a read of every pod between passes
    expects."""
    metrics_port: int | None = None
    """The first rank's metrics port the job's pods serve (the job's Service keeps it: an
    operator restarted with another setting still reads the port its pods listen on)."""
    written: dict[str, tuple[Any, float]] = field(default_factory=dict)
    """Top-level status fields this operator wrote (value, monotonic time) that the watch has
    not shown yet (`unseen_writes`)."""
    pod_views: views.PodViewCache = field(default_factory=views.PodViewCache)
    """The job's pod views, kept while a pod is unchanged in the watch cache."""


@dataclass(frozen=True)
class Reads:
    """Which trainer pods a pass reads the liveness of; the others' last reads are reused."""

    every_pod: bool = False
    pods: frozenset[int] = frozenset()
    """Node indexes to read (when not every pod)."""


READ_EVERY_POD = Reads(every_pod=True)
READ_NONE = Reads()


@dataclass(frozen=True)
class PassResult:
    """The status fields to patch and the Events to post."""

    status_patch: dict[str, Any]
    events: list[PostEvent]
    busy_seconds: float = 0.0
    """The pass's own work (viewing the pods, deciding, the patch), without its waits for reads
    and API calls: what spaces the job's next pass (`jobloop.PASS_SPACING_FACTOR`)."""


def unseen_writes(written: Mapping[str, tuple[Any, float]], seen: Mapping[str, Any],
                  now: float) -> dict[str, tuple[Any, float]]:
    """The own status writes (top-level field -> value, when) that status `seen` does not show
    yet (None: the field was removed), and that are younger than EXPECTATION_SECONDS (older
    ones: someone else changed the field meanwhile; the watch is right)."""
    return {key: (value, at) for key, (value, at) in written.items()
            if now - at < EXPECTATION_SECONDS and seen.get(key) != value}


def with_unseen_writes(seen: Mapping[str, Any],
                       unseen: Mapping[str, tuple[Any, float]]) -> dict[str, Any]:
    """Status `seen` as it is once the own writes it does not show yet are applied: what a
    pass computes its patch against, so that it neither skips nor undoes a write the watch is
    still delivering."""
    status = dict(seen)
    for key, (value, _at) in unseen.items():
        if value is None:
            status.pop(key, None)
        else:
            status[key] = value
    return status


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
        # Workloads and budgets are in no cache (and a budget shares the rendezvous pod's name).
        if isinstance(action, CreateObject) and action.kind not in ("Workload",
                                                                    "PodDisruptionBudget"):
            name = action.manifest["metadata"]["name"]
            if name not in refused_names:
                kept[name] = now
        elif isinstance(action, DeletePod):
            kept["-" + action.uid] = now
    return kept


def now_utc() -> datetime:
    """The clock of a pass, to whole seconds (status times are metav1.Time-like)."""
    return datetime.now(UTC).replace(microsecond=0)


def merged_reads(previous: Mapping[int, NodeLiveness], fresh: Mapping[int, NodeLiveness],
                 read: Iterable[int], pods: Mapping[int, Any],
                 since: float | None = None) -> dict[int, NodeLiveness]:
    """The job's last liveness reads once the pods `read` (node indexes) were read again and
    `fresh` holds those that answered: a pod read again that did not answer is silent now (no
    read kept), and a read of a pod since replaced (another UID at its index) or gone is
    dropped. A read that began at `since` (Unix time) leaves a pod's read made after that (a
    heartbeat deadline's, meanwhile) as it is. `pods` are the trainer pods (PodView) by node
    index."""
    merged = dict(previous)
    for index in read:
        kept = merged.get(index)
        if since is not None and kept is not None and (kept.read_time or 0.0) > since:
            continue
        if index in fresh:
            merged[index] = fresh[index]
        else:
            merged.pop(index, None)
    return {index: node for index, node in merged.items()
            if index in pods and pods[index].uid == node.pod_uid}


async def _read_liveness(memo: JobMemo, scraper: scraping.Scraper, observed: Observed,
                         reads: Reads, *, base_port: int, procs: int) -> dict[int, NodeLiveness]:
    """Read the pods `reads` names into the job's last reads, and return them all."""
    pods = observed.trainer_pods
    if reads.every_pod:
        memo.liveness = dict(await scraper.scrape(pods.values(), base_port=base_port,
                                                  procs=procs))
        return memo.liveness
    due = [pods[i] for i in sorted(reads.pods) if i in pods and scraping.readable(pods[i])]
    fresh = await scraper.scrape(due, base_port=base_port, procs=procs,
                                 urgent=True) if due else {}
    memo.liveness = merged_reads(memo.liveness, fresh, (p.node_index for p in due
                                                        if p.node_index is not None), pods)
    return memo.liveness


def trainer_views(job_name: str, pods: Iterable[Mapping[str, Any]],
                  cache: views.PodViewCache | None = None) -> dict[int, PodView]:
    """The job's trainer pods (from the watch cache) as the decisions see them, by node
    index."""
    return dict(views.observed_from(job_name=job_name, job_uid="", pods=pods, services=(),
                                    claims=(), cache=cache).trainer_pods)


ABSENCE_CAUSES = frozenset({IncidentCause.POD_VANISHED, IncidentCause.RENDEZVOUS_LOST})
"""Faults a pass may find only because a pod is missing from what it observed."""


def acts_on_absence(decision: decisions.Decision) -> bool:
    """Whether the decision opens an incident for a pod that is gone (or may be): one the pass
    must see again in a list before acting on a watch cache's word."""
    return any(incident.cause in ABSENCE_CAUSES for incident in decision.incidents)


class CacheLagging(Exception):
    """The watch cache does not show this operator's own writes yet, and the pass may not list
    the children instead (a pass woken by a pod change waits for the cache)."""


async def run_pass(
    *,
    body: Mapping[str, Any],
    memo: JobMemo,
    api: kubernetes.client.ApiClient,
    settings: OperatorSettings,
    scraper: scraping.Scraper,
    node_cache: observe.NodeCache | None = None,
    children: observe.Children | None = None,
    reads: Reads = READ_EVERY_POD,
    may_list: bool = True,
    trigger: str = "start",
    stop_memory: stopmemory.StopMemory | None = None,
) -> PassResult:
    """Observe the job's children (from the operator's watch caches, `children`; listed from
    the API server when None, or when the caches lag behind the operator's own writes and
    `may_list`: else CacheLagging), their nodes (the operator-wide `node_cache`), the stops the
    pod watch remembered (`stop_memory`) and the ranks (those `reads` names read now, the
    others' last reads reused), decide, apply the actions. `trigger` (what woke the pass)
    labels its duration metric."""
    started = time.monotonic()
    job, current_status = _parse(body, memo, started)
    namespace = job.metadata.namespace or ""
    if children is not None and _caches_lag(memo, children, started, may_list=may_list):
        children = None  # the watch cache lags behind our own writes: list this time
    stops = (stop_memory.seen(namespace, job.name, now_utc())
             if stop_memory is not None else ())
    given = settings
    busy = 0.0

    async def observe_and_decide(
        children: observe.Children | None,
    ) -> tuple[OperatorSettings, decisions.Decision]:
        nonlocal busy
        spent: list[float] = []
        observed = await observe.observe(
            api, namespace=namespace, job_name=job.name, job_uid=job.metadata.uid or "",
            timeout=given.api_request_timeout_seconds, node_cache=node_cache,
            children=children, stops=stops, views=memo.pod_views, spent=spent,
        )
        busy += sum(spent)  # the viewing only: a wait for the shared node list is no work
        # The job keeps the ports its Services were created with (an operator restarted with
        # other port settings must not split it).
        settings = pinned_to_services(given, observed.service_ports)
        plan = plan_for(job, settings)
        memo.procs_per_node = plan.procs_per_node
        memo.metrics_port = settings.trainer_metrics_port
        liveness = await _read_liveness(memo, scraper, observed, reads,
                                        base_port=settings.trainer_metrics_port,
                                        procs=plan.procs_per_node)
        queue = await _observe_queue(api, job, memo, settings)
        began = time.monotonic()
        decided = decisions.decide(
            job=job, plan=plan, observed=observed, liveness=liveness, now=now_utc(),
            memory=memo.memory, settings=settings, queue=queue,
        )
        busy += time.monotonic() - began
        return settings, decided

    settings, decision = await observe_and_decide(children)
    if children is not None and acts_on_absence(decision):
        # A pod missing from the watch cache is not yet a pod gone: at 5,000 pods the cache
        # lagged minutes behind their creation and a job was restarted for 2,190 pods that
        # existed. Confirmed by a list before anything is done about it.
        if not may_list:
            raise CacheLagging("pods missing from the watch cache: confirmed by a list first")
        settings, decision = await observe_and_decide(None)
    refused = await actions.apply(api, namespace=namespace, job_name=job.name,
                                  actions=decision.actions,
                                  timeout=settings.api_request_timeout_seconds)
    # A create refused by admission becomes the AdmissionRefused condition, not a retry loop.
    decision = decisions.with_refusals(decision, refused, now_utc())
    memo.memory = decision.memory
    memo.recheck = {index: moment.timestamp() for index, moment in decision.recheck.items()}
    memo.renewable = dict(decision.renewable)
    memo.heartbeat_timeout_seconds = job.spec.fault_tolerance.heartbeat_timeout_seconds
    memo.builtin_trainer = job.spec.runs_builtin_trainer
    memo.expected = expectations_after(decision.actions, memo.expected, time.monotonic(),
                                       refused=(r.name for r in refused))
    metrics.record_pass(
        namespace, job.name, trigger=trigger, seconds=time.monotonic() - started,
        status=decision.status, applied=[*decision.actions, *decision.events],
        restarts=[str(incident.action) for incident in decision.incidents
                  if incident.action in decisions.OPERATOR_ACTIONS],
        stale=decision.unresponsive,
        stale_after_seconds=job.spec.fault_tolerance.heartbeat_timeout_seconds,
    )
    began = time.monotonic()
    patch = _status_to_write(memo, current_status, decision.status, settings)
    return PassResult(status_patch=patch, events=decision.events,
                      busy_seconds=busy + time.monotonic() - began)


def _parse(body: Mapping[str, Any], memo: JobMemo,
           started: float) -> tuple[ResilientTrainingJob, dict[str, Any]]:
    """The job, and the status its pass computes the patch against: the watch's, overlaid with
    this operator's own writes the watch does not show yet. A spec that cannot be used raises
    InvalidJobError with the status that says so."""
    raw = plain(body)
    memo.written = unseen_writes(memo.written, raw.get("status") or {}, started)
    current_status = with_unseen_writes(raw.get("status") or {}, memo.written)
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
    return job, current_status


def _caches_lag(memo: JobMemo, children: observe.Children, started: float, *,
                may_list: bool) -> bool:
    """Whether the watch caches (`children`) still miss some of this operator's own writes
    (younger than EXPECTATION_SECONDS), so that the pass must list the children instead;
    CacheLagging when it may not (`may_list` False)."""
    unmet = unmet_expectations(memo.expected, children)
    memo.expected = {k: t for k, t in memo.expected.items()
                     if k in unmet and started - t < EXPECTATION_SECONDS}
    if not memo.expected:
        return False
    if not may_list:
        raise CacheLagging(f"{len(memo.expected)} own writes not in the watch cache yet")
    return True


async def _observe_queue(api: kubernetes.client.ApiClient, job: ResilientTrainingJob,
                         memo: JobMemo, settings: OperatorSettings) -> QueueView | None:
    """A job queued through Kueue: one GET of its Workload (and, while admitted, of its
    flavors); None for any other job."""
    queue_name = kueueapi.queue_name(job.metadata.labels)
    if queue_name is None:
        return None
    queue = await kueueobserve.observe_queue(
        api, namespace=job.metadata.namespace or "", queue_name=queue_name,
        workload_name=naming.workload_name(job.name, job.metadata.uid or ""),
        timeout=settings.api_request_timeout_seconds,
    )
    memo.workload_settled = queue.workload is None or queue.workload.true(kueueapi.FINISHED)
    return queue


def _status_to_write(memo: JobMemo, current_status: Mapping[str, Any],
                     status: ResilientTrainingJobStatus,
                     settings: OperatorSettings) -> dict[str, Any]:
    """The status patch of a pass; one that merely advances training waits until
    `status_progress_interval_seconds` after the last write (written with the next change or
    later). Only a write that went through counts (`remember_written`): one that failed (the
    API server down) is tried again by the next pass, not one interval later."""
    patch = status_patch(current_status, api_status(status))
    if patch and only_progress(current_status, patch) and memo.last_status_write is not None \
            and time.monotonic() - memo.last_status_write \
            < settings.status_progress_interval_seconds:
        patch = {}  # training merely advanced: written with the next change or later
    return patch


HELD_WRITE_SECONDS = 1.0
"""A status write that took longer than this was held by the API server (etcd down: it waits
instead of refusing): the values it wrote are stale by the time it went through."""


def remember_written(memo: JobMemo, patch: Mapping[str, Any], *, computed_at: float,
                     sent_at: float, stale: bool) -> None:
    """The status fields of `patch` were written: until the watch shows them, later passes
    compute their patches as if it did, and progress alone waits
    `status_progress_interval_seconds` from `computed_at` (monotonic), when the
    patch's values were current. Called only once the API server took the patch: a write that
    failed during an outage must not hold later progress back (the status caught up 11.6 s after
    kube-apiserver returned, bench.chaos apiserver-stop), nor may a write that hung through an
    outage and then went through with its old step (11.7-11.9 s after etcd returned,
    etcd-restart)."""
    now = time.monotonic()
    memo.written.update({key: (value, now) for key, value in patch.items()})
    if not patch:
        return
    # A write the API server held (sent at `sent_at`) carried values observed before the hold,
    # and went through just as etcd came back; counted from `computed_at`, the next progress
    # could still wait most of an interval (10.8 s after etcd's return, bench.chaos
    # etcd-restart at d8c8598). The next pass writes progress at once. Likewise the first
    # write after passes the API server did not answer (`stale`): it may carry values observed
    # just before kube-apiserver's return (11.08 s, bench.chaos apiserver-stop at 6aff325). A
    # pass that was merely slow (a scrape waiting on a silent pod) is not held: its progress
    # waits the interval from its observation.
    held = now - sent_at > HELD_WRITE_SECONDS
    memo.last_status_write = None if stale or held else computed_at
