"""When each job's reconcile pass runs: one loop per job (the kopf daemon `reconcile` in
handlers.py), woken by what changed rather than by a fixed timer alone.

A pass runs
- at once when the loop starts (a new job, or the operator (re)started) and when the spec
  changes (`JobLoop.wake(full=True)`), reading the liveness of every running trainer pod;
- RTJ_OPERATOR_RECONCILE_INTERVAL_SECONDS (±10 %, so that many jobs spread out) after the last
  such pass ended: the level-based pass, reading every pod;
- soon after one of the job's pods changed (the pod watch calls `JobLoop.wake()`): a pod that
  failed, vanished or is being deleted is acted on at once, not at the next interval after a
  full read. Such a pass reads no liveness (the pods' last reads are reused; the decisions
  measure a heartbeat's age at its read) and lists nothing: while the watch cache lags behind
  the operator's own writes it waits for the cache (`reconcile.CacheLagging`). Bursts (a
  thousand pods starting) are coalesced: at most one such pass every
  max(EVENT_PASS_GAP_SECONDS, the last pass's duration);
- just after a pod's heartbeat deadline (the decision's `recheck`, `JobMemo.recheck`): it reads
  only the pods due, so that a stale heartbeat is published a moment after it goes stale, and a
  hang acted on a moment after its threshold, whatever the interval and the job's size.

Every pass of the job runs in this loop, one at a time, and the loop writes the job's status
itself (one merge patch of the status subresource per pass) and then posts the pass's Events.
Only the leader acts (`leader.LeaseElector.is_leader`). `next_pass` (when the next pass runs and
what it reads) is pure and unit-tested.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from rtj_operator import actions, leader, metrics, reconcile
from rtj_operator.config import OperatorSettings
from rtj_operator.errors import InvalidJobError

LOG = logging.getLogger("rtj_operator")

EVENT_PASS_GAP_SECONDS = 0.5
"""Least time between the end of a pass and a pass woken by a pod change (or a longer pass's
own duration): a burst of pod events costs a pass or two a second, not one pass per event."""
DEADLINE_MARGIN_SECONDS = 0.05
"""A pod due at a heartbeat deadline is read this long after it (the verdict needs the
deadline passed)."""
INTERVAL_JITTER = 0.1
"""The interval's pass runs after the interval x (1 ± this), so that jobs started together do
not read their pods all at the same moments."""
LONGEST_SLEEP_SECONDS = 1.0
"""The loop looks at its stop flag at least this often."""
FINISHED = ("Succeeded", "Failed")

JobKey = tuple[str, str]
"""(namespace, job name)."""


@dataclass(frozen=True)
class NextPass:
    """When the next pass runs (monotonic clock) and what it reads."""

    at: float
    reads: reconcile.Reads
    trigger: str
    """`start` (first pass, spec change), `interval`, `pods` (a pod changed), `deadline`."""

    @property
    def may_list(self) -> bool:
        """Whether the pass may list the job's children when the watch cache lags (the
        interval's pass does; one woken by a pod change waits for the cache instead)."""
        return self.trigger in ("start", "interval")


def next_pass(*, now: float, wall_now: float, full_due: float, full_requested: bool,
              woken: bool, last_end: float, last_seconds: float, last_start_wall: float,
              recheck: Mapping[int, float]) -> NextPass:
    """The next pass of a job: a full one at once when requested, else the earliest of the
    interval's pass (`full_due`), a pass after a pod change (`woken`, coalesced: not before
    `last_end` + max(EVENT_PASS_GAP_SECONDS, `last_seconds`)) and the first heartbeat deadline
    (`recheck`, Unix times, not yet handled by a pass that started after it). A pass that is
    not the interval's reads the pods whose deadlines have passed by then; one that would run
    less than a gap before the interval's pass is the interval's pass. `now`, `full_due` and
    `last_end` are monotonic; `wall_now` and `last_start_wall` Unix time."""
    if full_requested:
        return NextPass(now, reconcile.READ_EVERY_POD, "start")
    gap = max(EVENT_PASS_GAP_SECONDS, last_seconds)
    pending = {index: at for index, at in recheck.items()
               if at + DEADLINE_MARGIN_SECONDS > last_start_wall}
    candidates = [NextPass(full_due, reconcile.READ_EVERY_POD, "interval")]
    if pending:
        first = min(pending.values()) + DEADLINE_MARGIN_SECONDS
        candidates.append(NextPass(max(now, now + (first - wall_now)), reconcile.READ_NONE,
                                   "deadline"))
    if woken:
        candidates.append(NextPass(max(now, last_end + gap), reconcile.READ_NONE, "pods"))
    chosen = min(candidates, key=lambda c: c.at)
    if chosen.trigger != "interval" and full_due - chosen.at < gap:
        chosen = NextPass(chosen.at, reconcile.READ_EVERY_POD, "interval")
    if chosen.trigger == "interval":
        return chosen
    when_wall = wall_now + (chosen.at - now) + 1e-3  # (float rounding)
    due = frozenset(index for index, at in pending.items()
                    if at + DEADLINE_MARGIN_SECONDS <= when_wall)
    return NextPass(chosen.at, reconcile.Reads(pods=due) if due else reconcile.READ_NONE,
                    "deadline" if due and chosen.trigger == "deadline" else chosen.trigger)


class JobLoop:
    """What wakes one job's loop, and when its passes ran."""

    def __init__(self) -> None:
        self.woken = asyncio.Event()
        self.full_requested = True
        self.full_due = 0.0
        self.last_end = -math.inf
        self.last_seconds = 0.0
        self.last_start_wall = -math.inf

    def wake(self, *, full: bool = False) -> None:
        """Run a pass soon: one that reads every pod when `full` (a spec change), else one
        that reuses the last reads (a pod changed)."""
        if full:
            self.full_requested = True
        self.woken.set()

    async def sleep(self, seconds: float) -> None:
        """Sleep, waking early for a `wake` (unless one is already waiting for its turn)."""
        seconds = min(seconds, LONGEST_SLEEP_SECONDS)
        if self.woken.is_set():
            await asyncio.sleep(seconds)
            return
        try:
            await asyncio.wait_for(self.woken.wait(), seconds)
        except TimeoutError:
            pass


def pod_changed(loops: Mapping[JobKey, JobLoop], pod_memo: kopf.Memo, *, key: JobKey,
                view: Mapping[str, Any] | None) -> None:
    """A watch event of one of a job's pods: wake the job's loop when what the decisions read
    of the pod (`view`, its slim form; None when it is gone) changed since the pod's last
    event."""
    if pod_memo.get("seen_view") == view and view is not None:
        return
    pod_memo["seen_view"] = view
    loop = loops.get(key)
    if loop is not None:
        loop.wake()


def finished_and_idle(state: str | None, pods: int, ttl: object) -> bool:
    """A finished job with no pod left and no TTL: nothing for a pass to do (C13)."""
    return state in FINISHED and pods == 0 and ttl is None


def _interval(settings: OperatorSettings) -> float:
    return settings.reconcile_interval_seconds * random.uniform(
        1 - INTERVAL_JITTER, 1 + INTERVAL_JITTER)


async def run(*, key: JobKey, body: kopf.Body, memo: kopf.Memo, job: reconcile.JobMemo,
              loop: JobLoop, stopped: kopf.DaemonStopped, children: Any,
              settings: OperatorSettings) -> None:
    """The job's loop, until kopf stops it (the job is deleted, or the operator exits).
    `children` returns the job's pods, Services and claims from the watch caches."""
    loops: dict[JobKey, JobLoop] = memo["loops"]
    loops[key] = loop
    try:
        while not stopped:
            now = time.monotonic()
            plan = next_pass(now=now, wall_now=time.time(), full_due=loop.full_due,
                             full_requested=loop.full_requested, woken=loop.woken.is_set(),
                             last_end=loop.last_end, last_seconds=loop.last_seconds,
                             last_start_wall=loop.last_start_wall, recheck=job.recheck)
            if plan.at > now:
                await loop.sleep(plan.at - now)
                continue
            loop.woken.clear()
            if plan.reads.every_pod:
                loop.full_requested = False
            loop.last_start_wall = time.time()
            retry: float | None = None
            try:
                await run_pass(body=body, memo=memo, job=job, plan=plan, children=children(),
                               settings=settings)
            except kopf.TemporaryError as error:
                metrics.RECONCILE_PASSES.labels(outcome="retry").inc()
                LOG.warning("%s/%s: pass failed, retried in %g s: %s", *key, error.delay, error)
                retry = error.delay or settings.reconcile_interval_seconds
            except Exception:
                metrics.RECONCILE_PASSES.labels(outcome="error").inc()
                LOG.exception("%s/%s: pass failed", *key)
                retry = settings.reconcile_interval_seconds
            end = time.monotonic()
            loop.last_end, loop.last_seconds = end, end - now
            if plan.reads.every_pod:
                loop.full_due = end + _interval(settings)
            if retry is not None:
                loop.full_due = min(loop.full_due, end + retry)
    finally:
        if loops.get(key) is loop:
            del loops[key]


async def run_pass(*, body: kopf.Body, memo: kopf.Memo, job: reconcile.JobMemo,
                   plan: NextPass, children: Any, settings: OperatorSettings) -> None:
    """One pass (observe, decide, act), then its status write and Events: nothing when this
    replica is not the leader any more, or the job is finished and idle."""
    elector: leader.LeaseElector | None = memo.get("elector")
    namespace, name = body.metadata.namespace or "", body.metadata.name or ""
    if elector is not None and not elector.is_leader():
        # Frozen past the renew deadline: the renewal thread is about to stop the process, and
        # another replica may lead already. Act on nothing, write nothing.
        LOG.warning("%s/%s: skipping the pass: the Lease was not renewed in time",
                    namespace, name)
        return
    remembered = job.memory.status
    state = remembered.state if remembered is not None else (body.get("status") or {}).get(
        "state")
    if finished_and_idle(state, len(list(children[0])),
                         (body.get("spec") or {}).get("ttlSecondsAfterFinished")):
        return
    in_flight: dict[str, float] = memo["health"]["in_flight"]
    flight_key = f"{namespace}/{name}"
    async with job.lock:
        in_flight[flight_key] = time.monotonic()
        try:
            try:
                result = await reconcile.run_pass(
                    body=body, memo=job, api=memo["api"], settings=settings,
                    scraper=memo["scraper"], node_cache=memo["nodes"], children=children,
                    reads=plan.reads, may_list=plan.may_list)
            except InvalidJobError as error:  # permanent: write why, never act
                metrics.RECONCILE_PASSES.labels(outcome="invalid").inc()
                if error.status:
                    await _write_status(memo, job, namespace, name, error.status, settings)
                    kopf.event(body, type="Warning", reason="InvalidSpec", message=str(error))
                return
            except reconcile.CacheLagging:
                metrics.RECONCILE_PASSES.labels(outcome="waiting_for_cache").inc()
                return
            if result.status_patch:
                await _write_status(memo, job, namespace, name, result.status_patch, settings)
        finally:
            in_flight.pop(flight_key, None)
    metrics.RECONCILE_PASSES.labels(outcome="ok").inc()
    memo["health"]["last_pass_monotonic"] = time.monotonic()
    for event in result.events:
        LOG.info("%s/%s %s: %s", namespace, name, event.reason, event.message)
        kopf.event(body, type=event.type, reason=event.reason, message=event.message[:1024])


async def _write_status(memo: kopf.Memo, job: reconcile.JobMemo, namespace: str, name: str,
                        patch: dict[str, Any], settings: OperatorSettings) -> None:
    await actions.patch_status(memo["api"], namespace=namespace, name=name, status=patch,
                               timeout=settings.api_request_timeout_seconds)
    reconcile.remember_written(job, patch)
