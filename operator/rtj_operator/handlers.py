"""The kopf handlers: the only module with kopf decorators.

Each handler is a few lines: it hands the job to `reconcile.run_pass` (observe -> decide -> act),
writes the status with one patch and posts one Event per decision. Reconciliation is level-based:
a timer runs a pass every `RTJ_OPERATOR_RECONCILE_INTERVAL_SECONDS`, and create/update/resume run
one at once so that a new job or a `suspend` flip does not wait for the timer.

One more handler watches trainer pods themselves: a pod that failed is announced to the job's
other pods at once (`announce_pod_loss`, rtj_operator.decisions.podloss), so that a warm spare
takes over without waiting for the next pass or for NVRx's heartbeat timeout.

The jobs' children are observed through three kopf indexes (watch caches of every pod, Service
and claim with the job label, keyed by namespace and job), so a pass lists nothing. A finished
job with no pods left and no `ttlSecondsAfterFinished` costs nothing: its timer returns at once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import kopf
import kubernetes.client

from rtj_operator import actions, leader, metrics, naming, observe, reconcile, scraping
from rtj_operator.api import GROUP, PLURAL, VERSION
from rtj_operator.config import OperatorSettings, settings_from_environment
from rtj_operator.decisions import podloss
from rtj_operator.errors import InvalidJobError

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
    pod = observe.pod_view(body)
    labels = body.get("metadata", {}).get("labels") or {}
    key = (body.get("metadata", {}).get("namespace"), labels.get(naming.JOB_LABEL, ""))
    verdict = podloss.announcement(
        pod,
        in_process_restart=observe.container_env(
            body, naming.TRAINER_CONTAINER, podloss.IN_PROCESS_RESTART_ENV) == "1",
        peers=[observe.pod_view(peer) for peer in _cached(kwargs["job_pods"], key)],
        already_announced=pod.uid in announced,
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
    # One HTTP client for every job's liveness reads.
    memo["scraper"] = scraping.Scraper(concurrency=SETTINGS.scrape_concurrency,
                                       timeout_seconds=SETTINGS.scrape_timeout_seconds)
    # A mutable record shared by every job's memo (kopf copies the memo per object, shallowly).
    memo["health"] = {"last_pass_monotonic": time.monotonic(), "in_flight": {}}
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


@kopf.on.delete(*RESOURCE, id="cleanup", optional=True)
async def cleanup(body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """Delete the job's children at once (ownerReferences would let the GC do it later);
    a dynamic claim with claimDeletePolicy Retain is kept and released instead."""
    spec = body.get("spec", {})
    checkpoint = spec.get("checkpoint", {})
    keep_claims = checkpoint.get("claimDeletePolicy") == "Retain"
    await actions.delete_children(
        memo["api"], namespace=body.metadata.namespace or "",
        selector=naming.job_selector(body.metadata.name or ""), keep_claims=keep_claims,
        timeout=SETTINGS.api_request_timeout_seconds,
    )
    metrics.record_job_state(f"{body.metadata.namespace}/{body.metadata.name}", None)
    metrics.record_job_status(body.metadata.namespace or "", body.metadata.name or "", None)
