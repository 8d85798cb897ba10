"""A job's heartbeat deadlines that need no pass: the renewable ones (`Decision.renewable`, a
Running pod's heartbeat going stale) are read by the job's loop itself (`quiet_due`,
`renew_quietly`), and a read that changes no verdict moves the deadline; only a read that may
change one goes to a pass (jobloop.next_pass)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping

from rtj_operator import decisions, metrics, observe, reconcile, scraping
from rtj_operator.config import OperatorSettings

DEADLINE_MARGIN_SECONDS = 0.05
"""A pod due at a heartbeat deadline is read this long after it (the verdict needs the
deadline passed)."""


def quiet_due(recheck: Mapping[int, float], renewable: Mapping[int, float],
              eventful: Iterable[int], *, wall_now: float,
              read_times: Mapping[int, float]) -> tuple[frozenset[int], float]:
    """The renewable pods (`Decision.renewable`) whose heartbeat deadline has passed and that
    were not read since (`read_times`: each pod's last read that answered, Unix time), which the
    loop reads itself (`renew_quietly`), and the next such deadline (Unix time, +inf for none).
    Pods whose quiet read needed a pass (`eventful`) are left to `jobloop.next_pass`; a pod
    read since its deadline (by a sweep) waits for the pass that follows it."""
    skip = set(eventful)
    due: set[int] = set()
    upcoming = math.inf
    for index, at in recheck.items():
        if index not in renewable or index in skip:
            continue
        moment = at + DEADLINE_MARGIN_SECONDS
        if moment > wall_now:
            upcoming = min(upcoming, moment)
        elif read_times.get(index, -math.inf) < at:
            due.add(index)
    return frozenset(due), upcoming


async def renew_quietly(due: frozenset[int], *, job_name: str, scraper: scraping.Scraper,
                        job: reconcile.JobMemo, eventful: set[int],
                        children: Callable[[], observe.Children],
                        settings: OperatorSettings) -> None:
    """Read the renewable pods whose heartbeat deadline came (`quiet_due`), without a pass:
    each read is kept (`JobMemo.liveness`), and a pod that answered with a newer, fresh
    heartbeat and nothing else new gets its next deadline at once (`renewed_deadline`); any
    other goes to a pass (`eventful`, then `jobloop.next_pass`). A 5,000-pod job's healthy pods
    come due about 500 a second: one pass over every pod for each batch of them kept its
    detection seconds behind its deadlines, while one stale heartbeat among them is all a pass
    is needed for."""
    pods = reconcile.trainer_views(job_name, children()[0], job.pod_views)
    targets = [pods[index] for index in sorted(due)
               if index in pods and scraping.readable(pods[index])]
    read = {pod.node_index for pod in targets if pod.node_index is not None}
    eventful.update(due - read)
    if not targets or job.procs_per_node is None:
        return
    answers = await scraper.scrape(targets, base_port=job.metrics_port
                                   or settings.trainer_metrics_port,
                                   procs=job.procs_per_node, urgent=True)
    before = job.liveness
    job.liveness = reconcile.merged_reads(before, answers, read, pods)
    timeout = job.heartbeat_timeout_seconds
    for index in sorted(read):
        basis = job.renewable.get(index)
        if basis is None or index not in job.recheck:
            continue  # a pass meanwhile decided anew
        deadline = decisions.renewed_deadline(before.get(index), answers.get(index), basis=basis,
                                              timeout_seconds=timeout,
                                              builtin_trainer=job.builtin_trainer)
        if deadline is None:
            eventful.add(index)
            metrics.DEADLINE_READS.labels(outcome="pass").inc()
        else:
            job.recheck[index] = deadline
            job.renewable[index] = deadline - timeout
            metrics.DEADLINE_READS.labels(outcome="renewed").inc()
