"""The pods of a job that ended on purpose, remembered past their removal (`StopMemory`).

A trainer pod asked to stop (a suspend, a preemption, an eviction, the job's deletion) says in its
termination message that it committed a checkpoint of its current step, and a pod the eviction
API ends carries a `DisruptionTarget` condition that says why. The kubelet removes the pod right
after its container ended, so a pass every few seconds would often miss both: `StopMemory` keeps
them from the first pod event that carries them (a watch handler in handlers.py; the deletion
event carries the pod's last state too), in memory only, and each pass puts a job's into
`Observed.stops` (`observe.observe`). An operator restarted in that window misses them: the stop
goes unrecorded (the resumed trainers still report the checkpoint through their metrics) and an
evicted pod it never saw is a vanished one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from datetime import datetime
from typing import Any

from rtj_operator import naming
from rtj_operator.observed import StopSeen
from rtj_operator.views import pod_view


def _controller_uid(meta: Mapping[str, Any]) -> str:
    for owner in meta.get("ownerReferences") or []:
        if owner.get("controller"):
            return str(owner.get("uid") or "")
    return ""


STOPS_KEPT_SECONDS = 3600.0
"""How long `StopMemory` keeps a stop (passes read it within seconds)."""
STOPS_KEPT_PER_JOB = 64
"""How many stopped pods `StopMemory` keeps per job (the newest)."""


class StopMemory:
    """The job pods that were ending on purpose, by job, shared by every job's passes (see the
    module docstring): trainer pods whose termination message says `Stopped`, and trainer or
    rendezvous pods a voluntary disruption ends (an eviction, a preemption). One entry per pod
    UID, updated when a later event says more; an entry is forgotten after `max_age_seconds`,
    and a job keeps its newest `max_per_job`."""

    def __init__(self, *, max_age_seconds: float = STOPS_KEPT_SECONDS,
                 max_per_job: int = STOPS_KEPT_PER_JOB) -> None:
        self.max_age_seconds = max_age_seconds
        self.max_per_job = max_per_job
        self._jobs: dict[tuple[str, str], dict[str, StopSeen]] = {}

    def record(self, pod: Mapping[str, Any], now: datetime) -> StopSeen | None:
        """Remember `pod` (a JSON dict) if it is a trainer pod whose termination message says
        `Stopped` or a job pod a voluntary disruption ends; returns the entry when it is new or
        says more than before (first the eviction, then the stop)."""
        meta = pod.get("metadata") or {}
        labels = meta.get("labels") or {}
        job = labels.get(naming.JOB_LABEL)
        if not job or labels.get(naming.ROLE_LABEL) not in (naming.ROLE_TRAINER,
                                                            naming.ROLE_RENDEZVOUS):
            return None
        view = pod_view(pod)
        stopped = view.outcome is not None and view.outcome.stopped
        if not stopped and not view.voluntarily_disrupted:
            return None
        seen = self._jobs.setdefault((meta.get("namespace") or "", job), {})
        before = seen.get(view.uid)
        if before is not None and (before.pod.outcome is not None or not stopped) and (
                before.pod.disruption is not None or view.disruption is None):
            return None
        if before is not None and view.disruption is None:
            view = dataclasses.replace(view, disruption=before.pod.disruption)
        stop = StopSeen(pod=view, job_uid=_controller_uid(meta),
                        seen_at=before.seen_at if before is not None else now)
        seen[view.uid] = stop
        if len(seen) > self.max_per_job:
            oldest = sorted(seen.values(), key=lambda s: s.seen_at)[: len(seen) - self.max_per_job]
            for gone in oldest:
                seen.pop(gone.pod.uid, None)
        return stop

    def seen(self, namespace: str, job_name: str, now: datetime) -> list[StopSeen]:
        """The stops remembered for a job (every UID of that name), oldest first; older ones are
        forgotten."""
        key = (namespace, job_name)
        kept = {uid: stop for uid, stop in self._jobs.get(key, {}).items()
                if (now - stop.seen_at).total_seconds() <= self.max_age_seconds}
        if kept:
            self._jobs[key] = kept
        else:
            self._jobs.pop(key, None)
        return sorted(kept.values(), key=lambda stop: stop.seen_at)
