"""When each job's reconcile pass runs: one loop per job (the kopf daemon `reconcile` in
handlers.py), woken by what changed rather than by a fixed timer alone.

A pass runs
- at once when the loop starts (a new job, or the operator (re)started) and when the spec
  changes (`JobLoop.wake(full=True)`), reading the liveness of every running trainer pod first;
- every RTJ_OPERATOR_RECONCILE_INTERVAL_SECONDS (±10 %, so that many jobs spread out): the
  level-based pass. The loop reads every running trainer pod in the background (with a
  thousand pods that takes a while) and runs the pass once the reads are in, so that nothing
  waits for the read;
- soon after one of the job's pods changed (the pod watch calls `JobLoop.wake()`): a pod that
  failed, vanished or is being deleted is acted on at once, not at the next interval. Such a
  pass reads no liveness (the pods' last reads are reused; the decisions measure a heartbeat's
  age at its read) and lists nothing: while the watch cache lags behind the operator's own
  writes it waits for the cache (`reconcile.CacheLagging`). Bursts (a thousand pods starting)
  are coalesced: such passes start at least max(EVENT_PASS_GAP_SECONDS, the last one's
  duration) apart;
- just after a pod's heartbeat deadline (the decision's `recheck`, `JobMemo.recheck`): it reads
  only the pods due, so that a stale heartbeat is published a moment after it goes stale, and a
  hang acted on a moment after its threshold, whatever the interval and the job's size. A pod
  whose deadline is only its heartbeat going stale (`Decision.renewable`: most pods, most of the
  time) is read by the loop itself (`renew_quietly`); a newer, fresh heartbeat and nothing else
  new moves its deadline with no pass at all, and only a read that may change a verdict wakes
  a pass.

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
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import kopf
import urllib3

from rtj_operator import (
    actions,
    kueueapi,
    leader,
    metrics,
    observe,
    reconcile,
    scraping,
    views,
)
from rtj_operator.config import OperatorSettings
from rtj_operator.deadlines import DEADLINE_MARGIN_SECONDS, quiet_due, renew_quietly
from rtj_operator.errors import InvalidJobError
from rtj_operator.observed import NodeLiveness, PodView

LOG = logging.getLogger("rtj_operator")

EVENT_PASS_GAP_SECONDS = 0.5
"""Least time between the starts of two passes woken by pod changes (or the last such pass's
duration, when longer): a burst of pod events costs a pass or two a second, not one per
event."""
PASS_SPACING_FACTOR = 3.0
"""A pass woken by a pod change or a heartbeat deadline starts at least this many times the last
such pass's own work (`PassResult.busy_seconds`: viewing, deciding; not its waits) after that
one began: however large the job, those passes take at most a
third of the operator's core (a 5,000-pod job's deadlines, spread over its heartbeat timeout,
had its passes run back to back), and the pods due meanwhile are read in one pass. A small
job's passes take milliseconds: the spacing is nothing there."""
INTERVAL_JITTER = 0.1
"""The interval's pass runs after the interval x (1 ± this), so that jobs started together do
not read their pods all at the same moments."""
LONGEST_SLEEP_SECONDS = 1.0
"""The loop looks at its stop flag at least this often."""
FINISHED = ("Succeeded", "Failed")

JobKey = tuple[str, str]
"""(namespace, job name)."""
Children = Callable[[], observe.Children]
"""The job's pods, Services and claims, from the watch caches, now."""


@dataclass(frozen=True)
class NextPass:
    """When the next pass runs (monotonic clock) and what it reads."""

    at: float
    reads: reconcile.Reads
    trigger: str
    """`start` (first pass, spec change: reads every pod itself), `read` (time to read every
    pod in the background), `interval` (decide on the background read just finished), `pods`
    (a pod changed), `deadline` (a pod's heartbeat deadline came)."""

    @property
    def may_list(self) -> bool:
        """Whether the pass may list the job's children when the watch cache lags (the start
        and the interval's pass do; one woken by a pod or a deadline waits for the cache)."""
        return self.trigger in ("start", "interval")


def next_pass(*, now: float, wall_now: float, full_due: float, full_requested: bool,
              reading: bool, read_done: bool, pods_changed: bool, last_pods_start: float,
              last_pods_seconds: float, last_start_wall: float,
              recheck: Mapping[int, float], last_quick_start: float = -math.inf,
              last_quick_seconds: float = 0.0) -> NextPass:
    """The next thing a job's loop does: a full pass at once when requested; the interval's
    pass at once when a background read of every pod just finished (`read_done`); else the
    earliest of starting that read (at `full_due`, unless one is `reading`), a pass after a pod
    change (`pods_changed`, coalesced: not before `last_pods_start` + max(EVENT_PASS_GAP_SECONDS,
    `last_pods_seconds`)) and the first heartbeat deadline (`recheck`, Unix times) not yet
    handled by a pass that started after it; neither of those two before `last_quick_start` +
    PASS_SPACING_FACTOR x `last_quick_seconds` (the last pass woken by either). Those two read
    the pods whose deadlines have passed by then. `now`, `full_due`, `last_pods_start` and
    `last_quick_start` are monotonic; `wall_now` and `last_start_wall` Unix time."""
    if full_requested:
        return NextPass(now, reconcile.READ_EVERY_POD, "start")
    pending = {index: at for index, at in recheck.items()
               if at + DEADLINE_MARGIN_SECONDS > last_start_wall}
    if read_done:
        # The background read began before now: a pod whose deadline has passed is read again
        # in this pass, or the pass, starting after the deadline, would count as handling it
        # on a read from before it (a hang then waited a whole sweep, 12 s at 5,000 pods).
        passed = frozenset(index for index, at in pending.items()
                           if at + DEADLINE_MARGIN_SECONDS <= wall_now)
        return NextPass(now, reconcile.Reads(pods=passed) if passed else reconcile.READ_NONE,
                        "interval")
    candidates = [] if reading else [NextPass(full_due, reconcile.READ_EVERY_POD, "read")]
    spaced = last_quick_start + PASS_SPACING_FACTOR * last_quick_seconds
    if pending:
        first = min(pending.values()) + DEADLINE_MARGIN_SECONDS
        candidates.append(NextPass(max(now, now + (first - wall_now), spaced),
                                   reconcile.READ_NONE, "deadline"))
    if pods_changed:
        gap = max(EVENT_PASS_GAP_SECONDS, last_pods_seconds)
        candidates.append(NextPass(max(now, last_pods_start + gap, spaced), reconcile.READ_NONE,
                                   "pods"))
    if not candidates:
        return NextPass(math.inf, reconcile.READ_NONE, "read")  # wait for the read to finish
    chosen = min(candidates, key=lambda c: c.at)
    if chosen.trigger == "read":
        return chosen
    when_wall = wall_now + (chosen.at - now) + 1e-3  # (float rounding)
    due = frozenset(index for index, at in pending.items()
                    if at + DEADLINE_MARGIN_SECONDS <= when_wall)
    return NextPass(chosen.at, reconcile.Reads(pods=due) if due else reconcile.READ_NONE,
                    chosen.trigger)


@dataclass(frozen=True)
class EveryPodRead:
    """A background read of every running trainer pod: when it began (Unix time), the pods it
    read (node indexes) and those that answered."""

    began: float
    read: tuple[int, ...]
    answers: Mapping[int, NodeLiveness]
    readable: int = 0
    """The job's pods that have a liveness endpoint, those the sweep skipped included: what the
    sweep budget counts (`sweep_interval`)."""


class JobLoop:
    """What wakes one job's loop, and when its passes ran."""

    def __init__(self) -> None:
        self.nudge = asyncio.Event()
        """Set by anything that may change the plan: a wake, a background read finishing."""
        self.full_requested = True
        self.pods_changed = False
        self.full_due = 0.0
        self.last_pods_start = -math.inf
        self.last_pods_seconds = 0.0
        self.last_quick_start = -math.inf
        """When (monotonic) the last pass woken by a pod change or a deadline began."""
        self.last_quick_seconds = 0.0
        self.eventful: set[int] = set()
        """Pods whose quiet read at their deadline needed a pass (`renew_quietly`), until the
        next pass starts."""
        self.last_sweep_ended: float | None = None
        """When (Unix time) the last read of every pod was taken in: the next one skips the
        pods read since (`sweep_targets`)."""
        self.last_start_wall = -math.inf
        self.reading: asyncio.Task[EveryPodRead] | None = None

    def wake(self, *, full: bool = False) -> None:
        """Run a pass soon: one that reads every pod when `full` (a spec change), else one that
        reuses the last reads (a pod changed)."""
        if full:
            self.full_requested = True
        else:
            self.pods_changed = True
        self.nudge.set()

    async def sleep(self, seconds: float) -> None:
        """Sleep, waking early when nudged."""
        try:
            await asyncio.wait_for(self.nudge.wait(), min(seconds, LONGEST_SLEEP_SECONDS))
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


def finished_and_idle(state: str | None, pods: int, ttl: object,
                      workload_pending: bool = False) -> bool:
    """A finished job with no running pod left (`pods`: `running_pods`) and no TTL: nothing for
    a pass to do (C13), unless it is queued through Kueue and its Workload was not seen Finished
    yet (`workload_pending`)."""
    return state in FINISHED and pods == 0 and ttl is None and not workload_pending


def running_pods(pods: Iterable[Mapping[str, Any]]) -> int:
    """The pods that have not ended. A finished job keeps its ended trainer pods for their logs
    (decisions.lifecycle), and they need no pass: counted as running, they cost a full pass
    every interval for ever (review-2 F9). A pod being deleted still counts until it is gone."""
    return sum(1 for pod in pods
               if (pod.get("status") or {}).get("phase") not in ("Succeeded", "Failed")
               or (pod.get("metadata") or {}).get("deletionTimestamp"))


def sweep_interval(settings: OperatorSettings, watched_pods: int) -> float:
    """Seconds between two sweeps of one job (a read of every pod): the reconcile interval, or
    longer while the operator watches more pods than `sweep_reads_per_second` allows in it
    (every job's sweep is one read per pod; the reads past their heartbeat deadlines come on
    top, as they must)."""
    return max(settings.reconcile_interval_seconds,
               watched_pods / settings.sweep_reads_per_second)


def _interval(settings: OperatorSettings, memo: kopf.Memo) -> float:
    watched: dict[JobKey, int] = memo.get("watched_pods") or {}
    return sweep_interval(settings, sum(watched.values())) * random.uniform(
        1 - INTERVAL_JITTER, 1 + INTERVAL_JITTER)


def sweep_targets(pods: Iterable[PodView], liveness: Mapping[int, NodeLiveness],
                  since: float | None) -> list[PodView]:
    """The pods a sweep reads: every pod with a liveness endpoint but those read since `since`
    (Unix time; the previous sweep's reads were in by then) by a read that answered, at a
    heartbeat deadline. So each pod is still read at least once a sweep interval, and a large
    job, whose
    every pod is read at its own deadline about once a heartbeat timeout, is not read a second
    time by its sweeps (at 5,000 pods, 500 reads a second of each kind)."""
    targets = [pod for pod in pods if scraping.readable(pod)]
    if since is None:
        return targets
    return [pod for pod in targets
            if not ((node := liveness.get(pod.node_index or 0)) is not None
                    and node.pod_uid == pod.uid and (node.read_time or 0.0) >= since)]


async def _read_every_pod(scraper: scraping.Scraper, job_name: str, children: Children, *,
                          base_port: int, procs: int, liveness: Mapping[int, NodeLiveness],
                          since: float | None,
                          cache: views.PodViewCache | None = None) -> EveryPodRead:
    began = time.time()
    pods = reconcile.trainer_views(job_name, children()[0], cache)
    targets = sweep_targets(pods.values(), liveness, since)
    answers = await scraper.scrape(targets, base_port=base_port, procs=procs)
    metrics.LIVENESS_READ_SECONDS.observe(time.time() - began)
    return EveryPodRead(began, tuple(p.node_index for p in targets if p.node_index is not None),
                        answers, readable=sum(1 for p in pods.values() if scraping.readable(p)))


async def run(*, key: JobKey, body: kopf.Body, memo: kopf.Memo, job: reconcile.JobMemo,
              loop: JobLoop, stopped: kopf.DaemonStopped, children: Children,
              settings: OperatorSettings) -> None:
    """The job's loop, until kopf stops it (the job is deleted, or the operator exits)."""
    loops: dict[JobKey, JobLoop] = memo["loops"]
    loops[key] = loop
    watched: dict[JobKey, int] = memo.setdefault("watched_pods", {})
    try:
        while not stopped:
            loop.nudge.clear()
            now, wall_now = time.monotonic(), time.time()
            quiet, quiet_at = quiet_due(
                job.recheck, job.renewable if job.procs_per_node is not None else {},
                loop.eventful, wall_now=wall_now,
                read_times={index: node.read_time for index, node in job.liveness.items()
                            if node.read_time is not None})
            if quiet:
                await renew_quietly(quiet, job_name=key[1], scraper=memo["scraper"], job=job,
                                    eventful=loop.eventful, children=children,
                                    settings=settings)
                continue
            reading = loop.reading is not None and not loop.reading.done()
            plan = next_pass(
                now=now, wall_now=wall_now, full_due=loop.full_due,
                full_requested=loop.full_requested, reading=reading,
                read_done=loop.reading is not None and loop.reading.done(),
                pods_changed=loop.pods_changed, last_pods_start=loop.last_pods_start,
                last_pods_seconds=loop.last_pods_seconds, last_start_wall=loop.last_start_wall,
                recheck={index: at for index, at in job.recheck.items()
                         if index not in job.renewable or index in loop.eventful},
                last_quick_start=loop.last_quick_start,
                last_quick_seconds=loop.last_quick_seconds)
            if plan.at > now:
                await loop.sleep(min(plan.at, now + (quiet_at - wall_now)) - now)
                continue
            if plan.trigger == "read" and job.procs_per_node is None:
                plan = NextPass(now, reconcile.READ_EVERY_POD, "start")  # size not known yet
            if plan.trigger == "read" and job.procs_per_node is not None:
                loop.reading = asyncio.create_task(_read_every_pod(
                    memo["scraper"], key[1], children,
                    base_port=job.metrics_port or settings.trainer_metrics_port,
                    procs=job.procs_per_node, liveness=job.liveness,
                    since=loop.last_sweep_ended, cache=job.pod_views))
                loop.reading.add_done_callback(lambda _task: loop.nudge.set())
                continue
            if plan.trigger == "interval" and loop.reading is not None:
                taken = _take_read(loop.reading, job, key, children)
                if taken is None:
                    loop.reading = None
                    loop.full_due = now + settings.reconcile_interval_seconds
                    continue
                watched[key] = taken.readable
                loop.last_sweep_ended = time.time()
                loop.reading = None
            await _pass_and_schedule(plan, key=key, body=body, memo=memo, job=job, loop=loop,
                                     children=children, settings=settings)
    finally:
        if loop.reading is not None:
            loop.reading.cancel()
        if loops.get(key) is loop:
            del loops[key]
            watched.pop(key, None)


def unreachable_reason(error: BaseException) -> str:
    """The short cause of a failed request: urllib3's `MaxRetryError` wraps it in its `reason`
    with the whole URL around it."""
    reason = getattr(error, "reason", None) or error
    text = str(reason)
    if isinstance(reason, urllib3.exceptions.NewConnectionError | ConnectionError):
        text = text.rsplit(": ", 1)[-1].rstrip(")\"'")
    return f"{type(reason).__name__}: {text}" if text else type(reason).__name__


def _take_read(task: asyncio.Task[EveryPodRead], job: reconcile.JobMemo, key: JobKey,
               children: Children) -> EveryPodRead | None:
    """Merge a finished background read into the job's last reads (a pod read again since it
    began keeps its newer read) and return it; None when the read failed."""
    try:
        done = task.result()
    except Exception:
        LOG.exception("%s/%s: reading the pods' liveness failed", *key)
        return None
    pods = reconcile.trainer_views(key[1], children()[0], job.pod_views)
    job.liveness = reconcile.merged_reads(job.liveness, done.answers, done.read, pods,
                                          since=done.began)
    return done


async def _pass_and_schedule(plan: NextPass, *, key: JobKey, body: kopf.Body, memo: kopf.Memo,
                             job: reconcile.JobMemo, loop: JobLoop, children: Children,
                             settings: OperatorSettings) -> None:
    """Run the planned pass (a full read inline when the job's size is not known yet, as for
    the first pass) and schedule what follows from it."""
    started = time.monotonic()
    loop.pods_changed = False
    loop.eventful.clear()
    if plan.reads.every_pod:
        loop.full_requested = False
    loop.last_start_wall = time.time()
    retry: float | None = None
    busy = 0.0
    try:
        busy = await run_pass(body=body, memo=memo, job=job, plan=plan, children=children(),
                              settings=settings)
    except kopf.TemporaryError as error:
        metrics.RECONCILE_PASSES.labels(outcome="retry").inc()
        LOG.warning("%s/%s: pass failed, retried in %g s: %s", *key, error.delay, error)
        retry = error.delay or settings.reconcile_interval_seconds
    except (urllib3.exceptions.HTTPError, OSError) as error:
        # The API server did not answer (stopped, restarting, the connection reset): expected
        # in an outage, so one line, not a traceback per job and pass.
        metrics.RECONCILE_PASSES.labels(outcome="retry").inc()
        job.unanswered = True
        retry = settings.reconcile_interval_seconds
        LOG.warning("%s/%s: pass failed, the API server did not answer (%s); retried in %g s",
                    *key, unreachable_reason(error), retry)
    except Exception:
        metrics.RECONCILE_PASSES.labels(outcome="error").inc()
        LOG.exception("%s/%s: pass failed", *key)
        retry = settings.reconcile_interval_seconds
    end = time.monotonic()
    if plan.trigger == "pods":
        loop.last_pods_start, loop.last_pods_seconds = started, end - started
    if plan.trigger in ("pods", "deadline"):
        loop.last_quick_start, loop.last_quick_seconds = started, busy
    if plan.reads.every_pod or plan.trigger == "interval":
        loop.full_due = end + _interval(settings, memo)
    if retry is not None:
        loop.full_due = min(loop.full_due, end + retry)


async def run_pass(*, body: kopf.Body, memo: kopf.Memo, job: reconcile.JobMemo,
                   plan: NextPass, children: observe.Children,
                   settings: OperatorSettings) -> float:
    """One pass (observe, decide, act), then its status write and Events: nothing when this
    replica is not the leader any more, or the job is finished and idle. Returns the pass's own
    work in seconds (`PassResult.busy_seconds`; 0 when it did nothing)."""
    elector: leader.LeaseElector | None = memo.get("elector")
    namespace, name = body.metadata.namespace or "", body.metadata.name or ""
    if elector is not None and not elector.is_leader():
        # Frozen past the renew deadline: the renewal thread is about to stop the process, and
        # another replica may lead already. Act on nothing, write nothing.
        LOG.warning("%s/%s: skipping the pass: the Lease was not renewed in time",
                    namespace, name)
        return 0.0
    remembered = job.memory.status
    state = remembered.state if remembered is not None else (body.get("status") or {}).get(
        "state")
    queued = kueueapi.queue_name(body.metadata.labels) is not None
    if finished_and_idle(state, running_pods(children[0]),
                         (body.get("spec") or {}).get("ttlSecondsAfterFinished"),
                         workload_pending=queued and not job.workload_settled):
        return 0.0
    in_flight: dict[str, float] = memo["health"]["in_flight"]
    flight_key = f"{namespace}/{name}"
    async with job.lock:
        in_flight[flight_key] = observed_at = time.monotonic()
        try:
            try:
                result = await reconcile.run_pass(
                    body=body, memo=job, api=memo["api"], settings=settings,
                    scraper=memo["scraper"], node_cache=memo["nodes"], children=children,
                    reads=plan.reads, may_list=plan.may_list, trigger=plan.trigger,
                    stop_memory=memo.get("stops"))
            except InvalidJobError as error:  # permanent: write why, never act
                metrics.RECONCILE_PASSES.labels(outcome="invalid").inc()
                if error.status:
                    await _write_status(memo, job, namespace, name, error.status, settings,
                                        observed_at=observed_at)
                    kopf.event(body, type="Warning", reason="InvalidSpec", message=str(error))
                return 0.0
            except reconcile.CacheLagging:
                metrics.RECONCILE_PASSES.labels(outcome="waiting_for_cache").inc()
                return 0.0
            if result.status_patch:
                await _write_status(memo, job, namespace, name, result.status_patch, settings,
                                    observed_at=observed_at)
        finally:
            in_flight.pop(flight_key, None)
    metrics.RECONCILE_PASSES.labels(outcome="ok").inc()
    memo["health"]["last_pass_monotonic"] = time.monotonic()
    for event in result.events:
        LOG.info("%s/%s %s: %s", namespace, name, event.reason, event.message)
        kopf.event(body, type=event.type, reason=event.reason, message=event.message[:1024])
    return result.busy_seconds


async def _write_status(memo: kopf.Memo, job: reconcile.JobMemo, namespace: str, name: str,
                        patch: dict[str, Any], settings: OperatorSettings, *,
                        observed_at: float) -> None:
    """Write the pass's status patch; only a patch the API server took counts as written (a
    failed one raises, and the next pass computes and tries it again), as of `observed_at`
    (monotonic), when the pass began observing: a pass or a write held through an outage
    carries the step of before it. A write held over `reconcile.HELD_WRITE_SECONDS`, and the
    first write after passes the API server did not answer, are followed by a fresh one
    (`reconcile.remember_written`)."""
    sent_at = time.monotonic()
    try:
        written = await actions.patch_status(memo["api"], namespace=namespace, name=name,
                                             status=patch,
                                             timeout=settings.api_request_timeout_seconds)
    except (urllib3.exceptions.HTTPError, OSError):
        job.unanswered = True
        raise
    if written:
        reconcile.remember_written(job, patch, computed_at=observed_at, sent_at=sent_at,
                                   stale=job.unanswered)
        job.unanswered = False
