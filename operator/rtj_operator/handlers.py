"""The kopf handlers: the only module with kopf decorators.

Each handler is a few lines: it hands the job to `reconcile.run_pass` (observe -> decide -> act),
writes the status with one patch and posts one Event per decision. Reconciliation is level-based:
a timer runs a pass every `RTJ_OPERATOR_RECONCILE_INTERVAL_SECONDS`, and create/update/resume run
one at once so that a new job or a `suspend` flip does not wait for the timer.

The jobs' children are observed through three kopf indexes (watch caches of every pod, Service
and claim with the job label, keyed by namespace and job), so a pass lists nothing. A finished
job with no pods left and no `ttlSecondsAfterFinished` costs nothing: its timer returns at once.
The same pod watch feeds `remember_stop`: pods ending on purpose (a stop checkpoint, an
eviction) are remembered past their removal (`observe.StopMemory`).

Deleting a job deletes its children at once, each pod with its grace period, and the job goes
away only once its pods are gone (at most their grace period plus `DELETE_WAIT_MARGIN_SECONDS`):
its trainers commit a checkpoint of their current step first, which a job of the same name
resumes from, and no second set of trainers can write into the same directory meanwhile.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta
from typing import Any

import kopf
import kubernetes.client

from rtj_operator import actions, leader, metrics, naming, observe, reconcile, scraping
from rtj_operator.api import GROUP, PLURAL, VERSION
from rtj_operator.config import OperatorSettings, settings_from_environment
from rtj_operator.decisions import stops
from rtj_operator.errors import InvalidJobError
from rtj_operator.podplan import DEFAULT_TERMINATION_GRACE_PERIOD_SECONDS

SETTINGS: OperatorSettings = settings_from_environment()
RESOURCE = (GROUP, VERSION, PLURAL)
LOG = logging.getLogger("rtj_operator")
"""Decisions are logged here; kopf's own per-object logger is quietened (it logs every timer
run at INFO)."""


def _job_memo(memo: kopf.Memo) -> reconcile.JobMemo:
    if "job" not in memo:
        memo["job"] = reconcile.JobMemo()
    job_memo: reconcile.JobMemo = memo["job"]
    return job_memo


def stuck_passes(in_flight: dict[str, float], now: float, limit: float) -> list[str]:
    """The jobs whose reconcile pass has run longer than `limit` seconds (monotonic clock)."""
    return sorted(job for job, began in in_flight.items() if now - began > limit)


IndexKey = tuple[str | None, str]
FINISHED = ("Succeeded", "Failed")


@kopf.index("pods", labels={naming.JOB_LABEL: kopf.PRESENT})
def job_pods(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
             **_: Any) -> dict[IndexKey, dict[str, Any]]:
    """Watch cache: every labelled pod (the fields the decisions read), by (namespace, job)."""
    return {(namespace, labels[naming.JOB_LABEL]): observe.slim_pod(body)}


@kopf.on.event("pods", labels={naming.JOB_LABEL: kopf.PRESENT})
def remember_stop(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A job pod that ends on purpose (its trainers committed a stop checkpoint, or it is
    evicted), remembered past its removal for the passes (`observe.StopMemory`)."""
    stop_memory: observe.StopMemory | None = memo.get("stops")
    if stop_memory is not None:
        stop_memory.record(body, reconcile.now_utc())


@kopf.index("services", labels={naming.JOB_LABEL: kopf.PRESENT})
def job_services(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
                 **_: Any) -> dict[IndexKey, dict[str, Any]]:
    """Watch cache: every labelled Service, by (namespace, job)."""
    return {(namespace, labels[naming.JOB_LABEL]): observe.slim_object(body)}


@kopf.index("persistentvolumeclaims", labels={naming.JOB_LABEL: kopf.PRESENT})
def job_claims(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
               **_: Any) -> dict[IndexKey, dict[str, Any]]:
    """Watch cache: every labelled claim, by (namespace, job)."""
    return {(namespace, labels[naming.JOB_LABEL]): observe.slim_object(body)}


def _indexes(kwargs: dict[str, Any]) -> tuple[Any, Any, Any]:
    """The three watch caches kopf hands a handler (as keyword arguments named after them)."""
    return kwargs["job_pods"], kwargs["job_services"], kwargs["job_claims"]


def _cached(index: kopf.Index[IndexKey, dict[str, Any]], key: IndexKey) -> list[dict[str, Any]]:
    return list(index.get(key, []))


def finished_and_idle(state: str | None, pods: int, ttl: object) -> bool:
    """A finished job with no pod left and no TTL: nothing for a pass to do (C13)."""
    return state in FINISHED and pods == 0 and ttl is None


async def _reconcile(body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo,
                     indexes: tuple[Any, Any, Any]) -> None:
    elector: leader.LeaseElector | None = memo.get("elector")
    if elector is not None and not elector.is_leader():
        # Frozen past the renew deadline: the renewal thread is about to stop the process, and
        # another replica may lead already. Act on nothing, write nothing (not even a retry
        # delay into kopf's progress annotations, which the next leader would read).
        LOG.warning("%s/%s: skipping the pass: the Lease was not renewed in time",
                    body.metadata.namespace, body.metadata.name)
        return
    job_memo = _job_memo(memo)
    key = f"{body.metadata.namespace}/{body.metadata.name}"
    index_key = (body.metadata.namespace, body.metadata.name or "")
    pods_index, services_index, claims_index = indexes
    children = (_cached(pods_index, index_key), _cached(services_index, index_key),
                _cached(claims_index, index_key))
    remembered = job_memo.memory.status
    state = remembered.state if remembered is not None else (body.get("status") or {}).get(
        "state")
    if finished_and_idle(state, len(children[0]),
                         (body.get("spec") or {}).get("ttlSecondsAfterFinished")):
        return
    in_flight: dict[str, float] = memo["health"]["in_flight"]
    async with job_memo.lock:
        in_flight[key] = time.monotonic()
        try:
            result = await reconcile.run_pass(
                body=body, memo=job_memo, api=memo["api"], settings=SETTINGS,
                scraper=memo["scraper"], node_cache=memo["nodes"], children=children,
                stop_memory=memo.get("stops"),
            )
        except InvalidJobError as error:  # permanent: write why, never retry
            metrics.RECONCILE_PASSES.labels(outcome="invalid").inc()
            if error.status:
                patch.status.update(error.status)
                kopf.event(body, type="Warning", reason="InvalidSpec", message=str(error))
            return
        except kopf.TemporaryError:
            metrics.RECONCILE_PASSES.labels(outcome="retry").inc()
            raise
        finally:
            in_flight.pop(key, None)
    metrics.RECONCILE_PASSES.labels(outcome="ok").inc()
    memo["health"]["last_pass_monotonic"] = time.monotonic()
    patch.status.update(result.status_patch)
    for event in result.events:
        LOG.info("%s/%s %s: %s", body.metadata.namespace, body.metadata.name, event.reason,
                 event.message)
        kopf.event(body, type=event.type, reason=event.reason, message=event.message[:1024])


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    """Operator-wide settings: our finalizer and annotation prefix, watch timeouts, clients."""
    settings.persistence.finalizer = naming.FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(
        prefix=naming.ANNOTATION_PREFIX
    )
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=naming.ANNOTATION_PREFIX, key="last-handled-configuration"
    )
    # Re-open watches every few minutes: a silently dropped connection must not leave the
    # operator blind (kopf's docs on "Watching"; a known issue with idle TCP connections).
    settings.watching.server_timeout = 300
    settings.watching.client_timeout = 330
    settings.posting.level = logging.INFO
    # One named namespace: nothing to discover. kopf would otherwise list and watch namespaces
    # (and CRDs) cluster-wide, which a namespaced install may not, and retry for ~1 minute first.
    settings.scanning.disabled = bool(SETTINGS.namespace)
    # kopf logs every timer run ("Timer 'reconcile' succeeded") at INFO; keep the decisions.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    leader.load_config()
    memo["api"] = kubernetes.client.ApiClient()
    # One node list for every job (kopf copies the memo per object, shallowly).
    memo["nodes"] = observe.NodeCache()
    # What pods that ended on purpose said, for every job (the pod watch records it).
    memo["stops"] = observe.StopMemory()
    # One HTTP client for every job's liveness reads.
    memo["scraper"] = scraping.Scraper(concurrency=SETTINGS.scrape_concurrency,
                                       timeout_seconds=SETTINGS.scrape_timeout_seconds)
    # A mutable record shared by every job's memo (kopf copies the memo per object, shallowly).
    memo["health"] = {"last_pass_monotonic": time.monotonic(), "in_flight": {}}


@kopf.on.cleanup()
async def close_clients(memo: kopf.Memo, **_: Any) -> None:
    scraper: scraping.Scraper | None = memo.get("scraper")
    if scraper is not None:
        await scraper.close()


@kopf.on.probe(id="seconds_since_last_pass")
def seconds_since_last_pass(memo: kopf.Memo, **_: Any) -> float:
    """Liveness detail (`GET /healthz`): seconds since any job's last successful pass."""
    last: float = memo["health"]["last_pass_monotonic"]
    return round(time.monotonic() - last, 1)


@kopf.on.probe(id="stuck_passes")
def no_stuck_pass(memo: kopf.Memo, **_: Any) -> int:
    """Liveness (`GET /healthz` fails): a pass running longer than RTJ_OPERATOR_STUCK_PASS_SECONDS
    means the event loop or an API call is stuck; the kubelet then restarts the operator."""
    stuck = stuck_passes(memo["health"]["in_flight"], time.monotonic(),
                         SETTINGS.stuck_pass_seconds)
    if stuck:
        raise RuntimeError(f"reconcile passes stuck for over {SETTINGS.stuck_pass_seconds:g} s: "
                           f"{', '.join(stuck)}")
    return len(memo["health"]["in_flight"])


@kopf.timer(*RESOURCE, id="reconcile", interval=SETTINGS.reconcile_interval_seconds)
async def reconcile_periodically(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kwargs: Any
) -> None:
    """The level-based loop: every interval, observe everything and converge."""
    await _reconcile(body, patch, memo, _indexes(kwargs))


@kopf.on.create(*RESOURCE, id="reconcile-on-create")
@kopf.on.resume(*RESOURCE, id="reconcile-on-resume")
@kopf.on.update(*RESOURCE, id="reconcile-on-update", field="spec")
async def reconcile_now(
    body: kopf.Body, patch: kopf.Patch, memo: kopf.Memo, **kwargs: Any
) -> None:
    """A new job, a changed spec or a restarted operator: converge now, not at the next tick."""
    await _reconcile(body, patch, memo, _indexes(kwargs))


DELETE_WAIT_MARGIN_SECONDS = 30
"""How much longer than the trainer pods' grace period a deleted job waits for them to go."""
DELETE_POLL_SECONDS = 2.0


def deletion_wait_over(body: kopf.Body, now: datetime) -> bool:
    """Whether a deleted job has waited for its pods as long as it may: their grace period
    (`podTemplate.terminationGracePeriodSeconds`, else the default) plus the margin, counted
    from its deletionTimestamp."""
    requested = body.metadata.get("deletionTimestamp")
    if not requested:
        return True
    since = datetime.fromisoformat(str(requested).replace("Z", "+00:00"))
    template = (body.get("spec") or {}).get("podTemplate") or {}
    grace = template.get("terminationGracePeriodSeconds")
    grace = grace if isinstance(grace, int) else DEFAULT_TERMINATION_GRACE_PERIOD_SECONDS
    return now >= since + timedelta(seconds=grace + DELETE_WAIT_MARGIN_SECONDS)


@kopf.on.delete(*RESOURCE, id="cleanup", optional=True)
async def cleanup(body: kopf.Body, memo: kopf.Memo, patch: kopf.Patch, **kwargs: Any) -> None:
    """Delete the job's children at once (ownerReferences would let the GC do it later), each
    pod with its grace period; a dynamic claim with claimDeletePolicy Retain is kept and
    released instead. Then wait until the pods are gone (their trainers commit a checkpoint of
    their current step: recorded as `status.lastStop`, reason `Deleted`, with an Event)."""
    spec = body.get("spec", {})
    checkpoint = spec.get("checkpoint", {})
    keep_claims = checkpoint.get("claimDeletePolicy") == "Retain"
    namespace, name = body.metadata.namespace or "", body.metadata.name or ""
    await actions.delete_children(
        memo["api"], namespace=namespace, selector=naming.job_selector(name),
        keep_claims=keep_claims, timeout=SETTINGS.api_request_timeout_seconds,
    )
    now = reconcile.now_utc()
    pods = _cached(kwargs["job_pods"], (namespace, name))
    if pods and not deletion_wait_over(body, now):
        raise kopf.TemporaryError(
            f"waiting for {len(pods)} pod(s) to end: the trainers commit a checkpoint of their "
            "current step first", delay=DELETE_POLL_SECONDS)
    stop_memory: observe.StopMemory | None = memo.get("stops")
    said = [seen for seen in (stop_memory.seen(namespace, name, now) if stop_memory else [])
            if seen.job_uid == body.metadata.uid]
    stop = stops.deleted_stop(said)
    if stop is not None:
        patch.status["lastStop"] = stop.to_api()
        where = f" ({stop.checkpoint})" if stop.checkpoint else ""
        LOG.info("%s/%s %s: Deleted: checkpointed step %d before stopping%s", namespace, name,
                 stops.CHECKPOINTED_BEFORE_STOP, stop.step, where)
        kopf.event(body, type="Normal", reason=stops.CHECKPOINTED_BEFORE_STOP,
                   message=f"Deleted: checkpointed step {stop.step} before stopping{where}: "
                           f"{stop.message}"[:1024])
    metrics.record_job_state(f"{namespace}/{name}", None)
    metrics.record_job_status(namespace, name, None)
