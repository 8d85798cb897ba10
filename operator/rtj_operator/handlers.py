"""The kopf handlers: the only module with kopf decorators.

Each handler is a few lines. Every job has one loop (`jobloop.run`, the kopf daemon
`reconcile`) that runs its passes (`reconcile.run_pass`: observe -> decide -> act), writes its
status with one patch per pass and posts one Event per decision. Reconciliation is level-based:
a pass reads every pod's liveness every `RTJ_OPERATOR_RECONCILE_INTERVAL_SECONDS`; in between, a
change of one of the job's pods (the pod watch below), a pod's heartbeat deadline or a spec
change wake the loop at once (jobloop.py says how bursts are coalesced). The loop starts with a
full pass when kopf first sees the job (a new job, or the operator (re)started).

One more handler watches trainer pods themselves: a pod that failed is announced to the job's
other pods at once (`announce_pod_loss`, rtj_operator.decisions.podloss), so that a warm spare
takes over without waiting for the next pass or for NVRx's heartbeat timeout.

The jobs' children are observed through three kopf indexes (watch caches of every pod, Service
and claim with the job label, keyed by namespace and job), so a pass lists nothing. A finished
job with no pods left and no `ttlSecondsAfterFinished` costs nothing: its loop skips the pass.
The same pod watch feeds `remember_stop`: pods ending on purpose (a stop checkpoint, an
eviction) are remembered past their removal (`stopmemory.StopMemory`).

Deleting a job deletes its children at once, each pod with its grace period, and the job goes
away only once its pods are gone (at most their grace period plus `DELETE_WAIT_MARGIN_SECONDS`):
its trainers commit a checkpoint of their current step first, which a job of the same name
resumes from, and no second set of trainers can write into the same directory meanwhile.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from datetime import datetime, timedelta
from typing import Any

import kopf

from rtj_operator import (
    actions,
    jobloop,
    leader,
    metrics,
    naming,
    observe,
    reconcile,
    scraping,
    stopmemory,
    views,
)
from rtj_operator.api import GROUP, PLURAL, VERSION
from rtj_operator.config import OperatorSettings, settings_from_environment
from rtj_operator.decisions import podloss, stops
from rtj_operator.podplan import DEFAULT_TERMINATION_GRACE_PERIOD_SECONDS

SETTINGS: OperatorSettings = settings_from_environment()
RESOURCE = (GROUP, VERSION, PLURAL)
LOG = logging.getLogger("rtj_operator")
"""Decisions are logged here; kopf's own per-object logger is quietened."""


def _job_memo(memo: kopf.Memo) -> reconcile.JobMemo:
    if "job" not in memo:
        memo["job"] = reconcile.JobMemo()
    job_memo: reconcile.JobMemo = memo["job"]
    return job_memo


def _job_loop(memo: kopf.Memo) -> jobloop.JobLoop:
    if "loop" not in memo:
        memo["loop"] = jobloop.JobLoop()
    loop: jobloop.JobLoop = memo["loop"]
    return loop


def stuck_passes(in_flight: dict[str, float], now: float, limit: float) -> list[str]:
    """The jobs whose reconcile pass has run longer than `limit` seconds (monotonic clock)."""
    return sorted(job for job, began in in_flight.items() if now - began > limit)


IndexKey = tuple[str | None, str]


# Async (not plain def) so that kopf calls them in the event loop, not through a worker thread:
# a thousand pods starting are thousands of watch events.
@kopf.index("pods", labels={naming.JOB_LABEL: kopf.PRESENT})
async def job_pods(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
                   **_: Any) -> dict[IndexKey, dict[str, Any]]:
    """Watch cache: every labelled pod (the fields the decisions read), by (namespace, job)."""
    return {(namespace, labels[naming.JOB_LABEL]): views.slim_pod(body)}


@kopf.on.event("pods", labels={naming.JOB_LABEL: kopf.PRESENT})
def remember_stop(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A job pod that ends on purpose (its trainers committed a stop checkpoint, or it is
    evicted), remembered past its removal for the passes (`stopmemory.StopMemory`)."""
    stop_memory: stopmemory.StopMemory | None = memo.get("stops")
    if stop_memory is not None:
        stop_memory.record(body, reconcile.now_utc())


def _int_or_zero(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


ANNOUNCED_KEEP_SECONDS = 3600.0
"""How long the operator remembers a pod it announced lost (one announcement per pod)."""


@kopf.on.event("pods", labels={naming.JOB_LABEL: kopf.PRESENT,
                               naming.ROLE_LABEL: naming.ROLE_TRAINER})
async def announce_pod_loss(event: kopf.RawEvent, body: kopf.Body, memo: kopf.Memo,
                            **kwargs: Any) -> None:
    """A trainer pod whose processes are all gone (Failed): tell the job's other running pods at
    once, so that their in-process wrapper stops waiting for its ranks (decisions.podloss).
    Runs on the pod's watch event, not at the next reconcile pass; the pass still records the
    incident and replaces the pod."""
    elector: leader.LeaseElector | None = memo.get("elector")
    if event.get("type") == "DELETED" or (elector is not None and not elector.is_leader()):
        return
    announced: dict[str, float] = memo["announced"]
    pod = views.pod_view(body)
    labels = body.get("metadata", {}).get("labels") or {}
    key = (body.get("metadata", {}).get("namespace"), labels.get(naming.JOB_LABEL, ""))
    verdict = podloss.announcement(
        pod,
        in_process_restart=views.container_env(
            body, naming.TRAINER_CONTAINER, podloss.IN_PROCESS_RESTART_ENV) == "1",
        # Viewed only when the pod failed (a generator): every event of a 5,000-pod job's
        # start viewed all 5,000 peers, and that was most of the operator's core.
        peers=(views.pod_view(peer) for peer in kwargs["job_pods"].get(key, [])),
        already_announced=pod.uid in announced,
        spares=_int_or_zero(views.container_env(body, naming.TRAINER_CONTAINER,
                                                  podloss.SPARES_ENV)),
    )
    if verdict is None:
        return
    now = time.monotonic()
    for uid in [u for u, at in announced.items() if now - at > ANNOUNCED_KEEP_SECONDS]:
        del announced[uid]
    announced[pod.uid] = now
    scraper: scraping.Scraper = memo["scraper"]
    told = await scraper.announce(verdict, base_port=SETTINGS.trainer_metrics_port)
    LOG.info("%s/%s: pod %s failed: told %d of %d running peer pods that its ranks are gone",
             key[0], key[1], pod.name, told, len(verdict.peers))


@kopf.index("services", labels={naming.JOB_LABEL: kopf.PRESENT})
async def job_services(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
                       **_: Any) -> dict[IndexKey, dict[str, Any]]:
    """Watch cache: every labelled Service, by (namespace, job)."""
    return {(namespace, labels[naming.JOB_LABEL]): views.slim_object(body)}


@kopf.index("persistentvolumeclaims", labels={naming.JOB_LABEL: kopf.PRESENT})
async def job_claims(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
                     **_: Any) -> dict[IndexKey, dict[str, Any]]:
    """Watch cache: every labelled claim, by (namespace, job)."""
    return {(namespace, labels[naming.JOB_LABEL]): views.slim_object(body)}


@kopf.on.event("pods", labels={naming.JOB_LABEL: kopf.PRESENT})
async def wake_on_pod_change(namespace: str | None, labels: kopf.Labels, body: kopf.Body,
                             memo: kopf.Memo, event: kopf.RawEvent, **_: Any) -> None:
    """A job's pod changed (what the decisions read of it) or is gone: wake the job's loop."""
    gone = event.get("type") == "DELETED"
    jobloop.pod_changed(memo["loops"], memo, key=(namespace or "", labels[naming.JOB_LABEL]),
                        view=None if gone else views.slim_pod(body))


def _children(kwargs: dict[str, Any], namespace: str | None, name: str) -> Any:
    """A function returning the job's pods, Services and claims from the watch caches (kopf
    hands a handler its indexes as keyword arguments named after them)."""
    key = (namespace, name)

    def children() -> observe.Children:
        return tuple(list(index.get(key, []))  # type: ignore[return-value]
                     for index in (kwargs["job_pods"], kwargs["job_services"],
                                   kwargs["job_claims"]))

    return children


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
    # A deleted job's finalizer goes once its loop (the `reconcile` daemon) has exited, which it
    # does within LONGEST_SLEEP_SECONDS of being stopped, but rarely within kopf's few instant
    # event-loop cycles; kopf then looks again only after `cancellation_polling` (60 s by
    # default), so every `kubectl delete rtj` took a minute longer than it had to.
    settings.background.cancellation_polling = jobloop.LONGEST_SLEEP_SECONDS
    # One named namespace: nothing to discover. kopf would otherwise list and watch namespaces
    # (and CRDs) cluster-wide, which a namespaced install may not, and retry for ~1 minute first.
    settings.scanning.disabled = bool(SETTINGS.namespace)
    # kopf logs every timer run ("Timer 'reconcile' succeeded") at INFO; keep the decisions.
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    # The same limit for kopf's own client (its watches and the handlers' progress writes).
    settings.networking.connect_timeout = SETTINGS.api_connect_timeout_seconds
    leader.load_config()
    memo["api"] = leader.api_client(SETTINGS)
    # One node list for every job (kopf copies the memo per object, shallowly).
    memo["nodes"] = observe.NodeCache()
    # What pods that ended on purpose said, for every job (the pod watch records it).
    memo["stops"] = stopmemory.StopMemory()
    # One HTTP client for every job's liveness reads.
    memo["scraper"] = scraping.Scraper(concurrency=SETTINGS.scrape_concurrency,
                                       timeout_seconds=SETTINGS.scrape_timeout_seconds)
    # A mutable record shared by every job's memo (kopf copies the memo per object, shallowly).
    memo["health"] = {"last_pass_monotonic": time.monotonic(), "in_flight": {}}
    # Every job's loop, by (namespace, name), for the pod watch to wake (shared likewise).
    memo["loops"] = {}
    # How many pods each job's last sweep read (shared likewise: it spaces every job's sweeps).
    memo["watched_pods"] = {}
    # The pods announced lost (uid -> when), shared by every pod's memo likewise.
    memo["announced"] = {}


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


@kopf.daemon(*RESOURCE, id="reconcile")
async def reconcile_continuously(body: kopf.Body, memo: kopf.Memo, stopped: kopf.DaemonStopped,
                                 **kwargs: Any) -> None:
    """The job's loop: its passes, from its first sight until it is deleted (jobloop.py)."""
    namespace, name = body.metadata.namespace, body.metadata.name or ""
    await jobloop.run(key=(namespace or "", name), body=body, memo=memo, job=_job_memo(memo),
                      loop=_job_loop(memo), stopped=stopped,
                      children=_children(kwargs, namespace, name), settings=SETTINGS)


@kopf.on.update(*RESOURCE, id="reconcile-on-update", field="spec")
async def reconcile_now(memo: kopf.Memo, **_: Any) -> None:
    """A changed spec (a `suspend` flip): a full pass now, not at the next interval. A new job
    and a restarted operator need nothing here: the job's loop starts with a full pass."""
    _job_loop(memo).wake(full=True)


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


def must_delete_children(already: bool, pods: list[Mapping[str, Any]]) -> bool:
    """Whether this try of a job's deletion sends the deletes (a LIST of pods, Services and
    claims, and a DELETE each): on the first try, and later only for a pod the watch cache shows
    running and not being deleted (one a pass in flight created after the first try). Sent at
    every 2 s retry, a 1,000-pod job's deletion was ~150 s of back-to-back LISTs and DELETEs
    (review-2 F10)."""
    if not already:
        return True
    return any(not (pod.get("metadata") or {}).get("deletionTimestamp")
               and (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
               for pod in pods)


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
    seen = list(kwargs["job_pods"].get((namespace, name), []))
    deleted: set[str] = memo.setdefault("children_deleted", set())
    uid = str(body.metadata.uid)
    if must_delete_children(uid in deleted, seen):
        await actions.delete_children(
            memo["api"], namespace=namespace, selector=naming.job_selector(name),
            keep_claims=keep_claims, timeout=SETTINGS.api_request_timeout_seconds,
        )
        deleted.add(uid)
    now = reconcile.now_utc()
    # Only pods that may still run are waited for: one that ended (Succeeded, Failed) has
    # nothing left to commit.
    pods = [pod for pod in seen
            if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")]
    if pods and not deletion_wait_over(body, now):
        raise kopf.TemporaryError(
            f"waiting for {len(pods)} pod(s) to end: the trainers commit a checkpoint of their "
            "current step first", delay=DELETE_POLL_SECONDS)
    stop_memory: stopmemory.StopMemory | None = memo.get("stops")
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
    deleted.discard(uid)
