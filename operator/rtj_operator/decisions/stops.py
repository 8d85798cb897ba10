"""Checkpoint now, then stop: what the operator records when trainers were asked to stop.

A suspend (or a preemption that suspends the job), an eviction of a pod (a node drain) and the
job's deletion end trainer pods with their grace period; the trainers first commit a checkpoint
of the step they are at and say so in their termination messages (outcome `Stopped`,
rtj_trainer.stop). `record_stop` turns the newest such message into `status.lastStop` (why, the
step, the checkpoint's directory, when) with one `CheckpointedBeforeStop` Event, and moves
`status.lastCheckpoint` up to that step. The messages come from the pods the pass sees and from
the pod watch (`Observed.stops`), since the kubelet removes a pod right after it ended.

Why the trainers stopped is read from the job and the pods: `spec.suspend` (`Suspended`, or
`Preempted` when the `training.resilient.dev/stop-reason` annotation says so: the hook for a
queueing system), a pod's `DisruptionTarget` condition (`Evicted`; `Preempted` for the
scheduler's preemption), or an eviction of the rendezvous pod under way (`Evicted`). A stop the
operator caused itself to recover from a fault, or a pod someone deleted by hand, is not recorded
(the checkpoint still is, and the job resumes from it). The job's deletion is recorded by the
delete handler (`deleted_stop`), as no pass runs then.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rtj_operator import naming
from rtj_operator.api.status import LastCheckpoint, LastStop, ResilientTrainingJobStatus
from rtj_operator.api.vocabulary import IncidentCause, RecoveryAction, StopReason
from rtj_operator.decisions.state import Pass, from_unix, whole_second
from rtj_operator.observed import StopSeen

SUSPEND_REASONS = {StopReason.SUSPENDED.value: StopReason.SUSPENDED,
                   StopReason.PREEMPTED.value: StopReason.PREEMPTED}
"""The values the stop-reason annotation may take."""
CHECKPOINTED_BEFORE_STOP = "CheckpointedBeforeStop"
"""The Event reason of a recorded stop."""


def suspend_reason(annotations: dict[str, str]) -> tuple[StopReason, str | None]:
    """Why a suspended job was suspended: `Preempted` when the stop-reason annotation says so,
    else `Suspended`; with a complaint when the annotation holds anything else."""
    value = annotations.get(naming.STOP_REASON_ANNOTATION)
    if value is None:
        return StopReason.SUSPENDED, None
    reason = SUSPEND_REASONS.get(value.strip())
    if reason is not None:
        return reason, None
    return StopReason.SUSPENDED, (
        f"annotation {naming.STOP_REASON_ANNOTATION} is {value[:64]!r}, not one of "
        f"{', '.join(SUSPEND_REASONS)}: recorded as {StopReason.SUSPENDED}")


def stopped_pods(p: Pass) -> list[StopSeen]:
    """Every stop this pass knows of: the pod watch's and the pods' own messages, once per pod."""
    known = {seen.pod.uid: seen for seen in p.observed.stops if seen.stopped}
    for pod in p.observed.trainer_pods.values():
        if pod.uid not in known and pod.outcome is not None and pod.outcome.stopped \
                and pod.outcome.committed_step is not None:
            known[pod.uid] = StopSeen(pod=pod, job_uid=p.job.metadata.uid or "", seen_at=p.now)
    return sorted(known.values(), key=lambda seen: seen.seen_at)


def _rendezvous_evicted(p: Pass) -> bool:
    """An eviction of the rendezvous pod is being recovered from (every pod is replaced)."""
    return any(i.cause == IncidentCause.POD_EVICTED and i.node_index is None
               and i.action == RecoveryAction.RESCHEDULE and i.recovered_time is None
               for i in p.incidents)


def why_stopped(p: Pass, seen: StopSeen) -> tuple[StopReason | None, str | None]:
    """Why the trainers of this pod were asked to stop (None: the operator's own recovery or a
    pod deleted by hand, which are not recorded), and a complaint about the annotation."""
    if p.spec.suspend:
        return suspend_reason(p.job.metadata.annotations)
    if seen.pod.disruption == "PreemptionByScheduler":
        return StopReason.PREEMPTED, None
    if seen.pod.voluntarily_disrupted or _rendezvous_evicted(p):
        return StopReason.EVICTED, None
    return None, None


def _what(reason: StopReason, seen: StopSeen) -> str:
    pod = seen.pod
    where = f" from node {pod.node_name}" if pod.node_name else ""
    if reason == StopReason.EVICTED and pod.voluntarily_disrupted:
        return f"pod {pod.name} was evicted{where} ({pod.disruption})"
    if reason == StopReason.EVICTED:
        return "the rendezvous pod was evicted"
    if reason == StopReason.PREEMPTED and not pod.voluntarily_disrupted:
        return "the job was preempted (suspended)"
    if reason == StopReason.PREEMPTED:
        return f"pod {pod.name} was preempted{where}"
    if reason == StopReason.DELETED:
        return "the job was deleted"
    return "the job was suspended"


def last_stop(reason: StopReason, seen: StopSeen, complaint: str | None = None) -> LastStop:
    """The status record of a stop (pure; the delete handler uses it too)."""
    outcome = seen.pod.outcome
    assert outcome is not None and outcome.committed_step is not None
    message = (f"{_what(reason, seen)}; the trainers committed a checkpoint of step "
               f"{outcome.committed_step} before they stopped")
    if complaint:
        message = f"{message} ({complaint})"
    return LastStop(
        reason=reason,
        step=outcome.committed_step,
        checkpoint=outcome.checkpoint,
        time=(whole_second(from_unix(outcome.committed_time))
              if outcome.committed_time is not None else None),
        message=message[:1024],
    )


def deleted_stop(stops: Iterable[StopSeen]) -> LastStop | None:
    """The record of a deleted job's stop: the newest step its trainers committed (None when
    none said so)."""
    said = [seen for seen in stops if seen.stopped]
    if not said:
        return None
    newest = max(said, key=lambda seen: (seen.committed_step or 0, seen.seen_at))
    return last_stop(StopReason.DELETED, newest)


def record_stop(p: Pass, written: ResilientTrainingJobStatus) -> ResilientTrainingJobStatus:
    """`written` with the newest stop this pass knows of as `lastStop` (when it is newer than the
    recorded one and has a reason to record), `lastCheckpoint` moved up to it, and one
    `CheckpointedBeforeStop` Event."""
    update: dict[str, Any] = {}
    known = written.last_stop or p.prev.last_stop
    if known is not None:
        update["last_stop"] = known
    candidates = [seen for seen in stopped_pods(p)
                  if known is None or (seen.committed_step or 0) > known.step]
    for seen in sorted(candidates, key=lambda s: (s.committed_step or 0, s.seen_at),
                       reverse=True):
        reason, complaint = why_stopped(p, seen)
        if reason is None:
            continue
        record = last_stop(reason, seen, complaint)
        update["last_stop"] = record
        where = f" ({record.checkpoint})" if record.checkpoint else ""
        p.event("Normal", CHECKPOINTED_BEFORE_STOP,
                f"{reason}: checkpointed step {record.step} before stopping{where}: "
                f"{record.message}")
        if complaint:
            p.event("Warning", "InvalidStopReason", complaint)
        checkpoint = written.last_checkpoint
        if checkpoint is None or checkpoint.step < record.step:
            update["last_checkpoint"] = LastCheckpoint(step=record.step, time=record.time)
        break
    return written.model_copy(update=update) if update else written
