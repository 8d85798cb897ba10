"""Rule 0: a job queued through Kueue (label `kueue.x-k8s.io/queue-name`) runs only while Kueue
admits its Workload. The operator does for it what Kueue's jobframework reconciler does for
Kueue's own kinds (pkg/controller/jobframework/reconciler.go in v0.17; docs/kueue.md):

- no Workload yet: create it (`workloads.workload`) and hold the job (suspend it; no pod is
  created, as Kueue's webhook suspends a queued Job when it is created);
- Workload pending: hold the job; while no quota is reserved, keep the Workload's pod sets equal
  to the job's (a job changed while queued gets its Workload updated);
- Workload admitted: start the job in one update (its placement merged with the admitted
  flavors', `suspend: false`), then leave it running;
- Workload evicted (preempted, deactivated, ...): suspend the job (its trainers checkpoint
  before they stop); once no pod is left, give the job its own placement back and clear the
  Workload's admission (`QuotaReserved` False, `Requeued`) so that Kueue queues it again;
- job finished: mark the Workload `Finished` (Succeeded or Failed), so Kueue releases its quota,
  in the first pass whose job already shows that state in its status (never before).

`admit` runs before the other rules and says whether this pass must treat the job as suspended
(`QueueStep.hold`); `report` runs after them: the `Queued` condition, the `Queued` state of a
held job without pods, and the `Finished` mark. Both are pure; the Workload and its flavors come
from `kueueobserve.observe_queue`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any

from rtj_operator import kueueapi, naming, workloads
from rtj_operator.api.models import ResilientTrainingJob
from rtj_operator.api.status import Condition, ResilientTrainingJobStatus
from rtj_operator.api.vocabulary import ConditionStatus, ConditionType, JobState, Reason
from rtj_operator.config import OperatorSettings
from rtj_operator.decisions.state import Decision, iso
from rtj_operator.intents import Action, CreateObject, Manifest, PatchJob, PatchWorkload, PostEvent
from rtj_operator.observed import Observed, QueueView, WorkloadView

CONDITION_MESSAGE_LIMIT = 32768
"""metav1.Condition's message limit (Kueue's webhook validates the Workload's conditions)."""
FINISHED_STATES = (JobState.SUCCEEDED, JobState.FAILED)


@dataclass(frozen=True)
class QueueStep:
    """What rule 0 decided before the other rules ran."""

    hold: bool
    """Treat the job as suspended in this pass (delete its pods, create none)."""
    actions: tuple[Action, ...] = ()
    events: tuple[PostEvent, ...] = ()
    queued: tuple[bool, Reason, str] | None = None
    """The `Queued` condition (True/False, reason, message); None leaves it as it is."""
    pods_left: bool = False
    """The job still has pods (a held job without any is `Queued`, one with some `Suspended`)."""
    workload: WorkloadView | None = None


def _pods_left(observed: Observed) -> bool:
    return bool(observed.trainer_pods) or observed.rendezvous_pod is not None


def _suspend(job: ResilientTrainingJob) -> list[Action]:
    return [] if job.spec.suspend else [PatchJob(workloads.SUSPEND_PATCH)]


def _set_condition(conditions: list[dict[str, Any]], *, kind: str, status: str, reason: str,
                   message: str, now: datetime, generation: int | None) -> None:
    """apimeta.SetStatusCondition on a Workload's conditions: lastTransitionTime moves only
    when the status does."""
    condition: dict[str, Any] = {"type": kind, "status": status, "reason": reason,
                                 "message": message[:CONDITION_MESSAGE_LIMIT],
                                 "lastTransitionTime": iso(now)}
    if generation is not None:
        condition["observedGeneration"] = generation
    for index, existing in enumerate(conditions):
        if existing.get("type") == kind:
            if existing.get("status") == status:
                condition["lastTransitionTime"] = existing.get("lastTransitionTime",
                                                               condition["lastTransitionTime"])
            conditions[index] = condition
            return
    conditions.append(condition)


def requeue_status(workload: WorkloadView, now: datetime) -> Manifest:
    """The status patch that gives an evicted Workload's quota back and queues it again, as
    jobframework does once the evicted job has no pod left: admission removed, QuotaReserved
    False (reason Pending), Admitted False, Requeued (True after a preemption or node failures,
    False otherwise) with the eviction's reason and message."""
    evicted = workload.conditions[kueueapi.EVICTED]
    conditions = [dict(c) for c in workload.raw_conditions]
    generation = workload.generation
    _set_condition(conditions, kind=kueueapi.REQUEUED,
                   status="True" if evicted.reason in (kueueapi.EVICTED_BY_PREEMPTION,
                                                       kueueapi.EVICTED_DUE_TO_NODE_FAILURES)
                   else "False",
                   reason=evicted.reason, message=evicted.message, now=now, generation=generation)
    _set_condition(conditions, kind=kueueapi.QUOTA_RESERVED, status="False",
                   reason=kueueapi.PENDING_REASON, message=evicted.message, now=now,
                   generation=generation)
    if workload.true(kueueapi.ADMITTED):
        _set_condition(conditions, kind=kueueapi.ADMITTED, status="False",
                       reason="NoReservation", message="The workload has no reservation",
                       now=now, generation=generation)
    return {"status": {"admission": None, "conditions": conditions}}


def finish_status(workload: WorkloadView, state: JobState, message: str,
                  now: datetime) -> Manifest:
    """The status patch that marks the Workload Finished: Kueue releases its quota."""
    conditions = [dict(c) for c in workload.raw_conditions]
    _set_condition(conditions, kind=kueueapi.FINISHED, status="True",
                   reason=(kueueapi.FINISHED_SUCCEEDED if state == JobState.SUCCEEDED
                           else kueueapi.FINISHED_FAILED),
                   message=message or f"The job {state}", now=now,
                   generation=workload.generation)
    return {"status": {"conditions": conditions}}


def _pending_message(workload: WorkloadView) -> str:
    """Why Kueue has not admitted the Workload, in Kueue's words when it gave them."""
    if not workload.active:
        return "the Workload is deactivated (spec.active: false)"
    reserved = workload.conditions.get(kueueapi.QUOTA_RESERVED)
    if reserved is not None and reserved.status == "True":
        admitted = workload.conditions.get(kueueapi.ADMITTED)
        why = admitted.message if admitted is not None and admitted.message else ""
        return (f"quota is reserved in ClusterQueue {workload.cluster_queue}; waiting for its "
                f"admission checks{': ' + why if why else ''}")
    if reserved is not None and reserved.message:
        return reserved.message
    return "Kueue has not looked at it yet"


def admit(*, job: ResilientTrainingJob, queue: QueueView, observed: Observed,
          prev: ResilientTrainingJobStatus, settings: OperatorSettings,
          now: datetime) -> QueueStep:
    """Rule 0 before the others (see the module docstring)."""
    pods_left = _pods_left(observed)
    workload = queue.workload
    if prev.state in FINISHED_STATES:
        return QueueStep(hold=False, pods_left=pods_left, workload=workload)
    label = f"{kueueapi.QUEUE_NAME_LABEL}={queue.queue_name}"
    if queue.unavailable is not None:
        return QueueStep(
            hold=True, actions=tuple(_suspend(job)), pods_left=pods_left,
            queued=(True, Reason.KUEUE_UNAVAILABLE,
                    f"The job has label {label}, but {queue.unavailable}. It stays suspended "
                    "until Kueue can admit it (or the label is removed and the job resumed)."))
    if workload is None:
        manifest = workloads.workload(job, queue_name=queue.queue_name, settings=settings)
        name = manifest["metadata"]["name"]
        return QueueStep(
            hold=True, pods_left=pods_left,
            actions=(CreateObject(manifest), *_suspend(job)),
            events=(PostEvent("Normal", "WorkloadCreated",
                              f"Created Workload {name} in LocalQueue {queue.queue_name}: the "
                              "job waits for Kueue to admit it"),),
            queued=(True, Reason.WAITING_FOR_ADMISSION,
                    f"Workload {name} was created in LocalQueue {queue.queue_name}; waiting for "
                    "Kueue to admit it."))
    name = workload.name
    if workload.true(kueueapi.FINISHED):
        finished = workload.conditions[kueueapi.FINISHED]
        return QueueStep(
            hold=True, actions=tuple(_suspend(job)), pods_left=pods_left, workload=workload,
            queued=(True, Reason.WORKLOAD_FINISHED,
                    f"Workload {name} is Finished ({finished.reason}: {finished.message}) "
                    "although the job did not finish; it stays suspended (delete the Workload "
                    "to queue the job again)."))
    if workload.true(kueueapi.EVICTED) and (
            workload.true(kueueapi.QUOTA_RESERVED) or not job.spec.suspend or pods_left):
        return _evicted(job, workload, pods_left=pods_left, now=now)
    # An eviction already handled (no pod, no quota) waits like any pending Workload: Kueue
    # keeps `Evicted` until it admits the Workload again.
    if workload.true(kueueapi.ADMITTED):
        return _admitted(job, queue, workload, pods_left=pods_left)
    return _pending(job, queue, workload, pods_left=pods_left, settings=settings)


def _evicted(job: ResilientTrainingJob, workload: WorkloadView, *, pods_left: bool,
             now: datetime) -> QueueStep:
    evicted = workload.conditions[kueueapi.EVICTED]
    said = f"Kueue evicted Workload {workload.name} ({evicted.reason}: {evicted.message})"
    actions: list[Action] = []
    events: list[PostEvent] = []
    if not job.spec.suspend:
        actions.append(PatchJob(workloads.eviction_patch(evicted.reason)))
        events.append(PostEvent("Warning", Reason.EVICTED,
                                f"{said}: suspending the job; its trainers checkpoint before "
                                "they stop"))
    elif not pods_left:
        if naming.PLACEMENT_ANNOTATION in job.metadata.annotations:
            actions.append(PatchJob(workloads.restore_patch(
                job, own=workloads.own_placement(job))))
        if workload.true(kueueapi.QUOTA_RESERVED):
            actions.append(PatchWorkload(workload.name, workload.resource_version,
                                         requeue_status(workload, now), status=True))
            events.append(PostEvent("Normal", "Requeued",
                                    f"Every pod is gone: Workload {workload.name} gives its "
                                    "quota back and is queued again"))
    then = ("the job is queued again" if not pods_left and job.spec.suspend
            else "the job is being suspended; its trainers checkpoint before they stop")
    return QueueStep(hold=True, actions=tuple(actions), events=tuple(events),
                     pods_left=pods_left, workload=workload,
                     queued=(True, Reason.EVICTED, f"{said}; {then}."))


def _admitted(job: ResilientTrainingJob, queue: QueueView, workload: WorkloadView, *,
              pods_left: bool) -> QueueStep:
    own = workloads.own_placement(job)
    placement = workloads.admitted_placement(own, workload, queue.flavors)
    where = f"ClusterQueue {workload.cluster_queue}"
    if isinstance(placement, str):
        return QueueStep(
            hold=True, actions=tuple(_suspend(job)), pods_left=pods_left, workload=workload,
            queued=(True, Reason.PLACEMENT_CONFLICT,
                    f"Kueue admitted Workload {workload.name} in {where}, but {placement}; the "
                    "job stays suspended."))
    flavors = sorted({f for names in workload.flavors.values() for f in names})
    admitted = (f"Workload {workload.name} is admitted in {where} "
                f"(flavors: {', '.join(flavors) or 'none'}).")
    started = naming.PLACEMENT_ANNOTATION in job.metadata.annotations
    if not job.spec.suspend and started and workloads.placement_of(job) == placement:
        return QueueStep(hold=False, pods_left=pods_left, workload=workload,
                         queued=(False, Reason.ADMITTED, admitted))
    if job.spec.suspend:
        selector = ", ".join(f"{k}={v}" for k, v in sorted(placement.node_selector.items()))
        return QueueStep(
            hold=True, pods_left=pods_left, workload=workload,
            actions=(PatchJob(workloads.start_patch(job, own=own, admitted=placement)),),
            events=(PostEvent("Normal", Reason.ADMITTED,
                              f"Kueue admitted Workload {workload.name} in {where}: starting "
                              f"the job on nodes with {selector or 'any labels'}"),),
            queued=(False, Reason.ADMITTED, f"{admitted} Starting the job."))
    # Running, but not started by this admission (a job that was running when it was
    # labelled, or a watch cache behind the operator's own suspend): stop it first.
    return QueueStep(
        hold=True, actions=(PatchJob(workloads.SUSPEND_PATCH),), pods_left=pods_left,
        workload=workload,
        queued=(False, Reason.ADMITTED,
                f"{admitted} Suspending the job first, to start it with the admitted placement."))


def _pending(job: ResilientTrainingJob, queue: QueueView, workload: WorkloadView, *,
             pods_left: bool, settings: OperatorSettings) -> QueueStep:
    actions: list[Action] = list(_suspend(job))
    events: list[PostEvent] = []
    started = naming.PLACEMENT_ANNOTATION in job.metadata.annotations
    if job.spec.suspend and not pods_left and started:
        # The admission ended without an eviction (cleared by hand): take the placement back.
        actions.append(PatchJob(workloads.restore_patch(job, own=workloads.own_placement(job))))
    if job.spec.suspend and not workload.true(kueueapi.QUOTA_RESERVED):
        desired = workloads.pod_sets(job, settings=settings)
        if (not workloads.pod_sets_match(desired, workload.pod_sets)
                or workload.queue_name != queue.queue_name):
            actions.append(PatchWorkload(workload.name, workload.resource_version, {
                "spec": {"queueName": queue.queue_name, "podSets": desired}}))
            events.append(PostEvent("Normal", "WorkloadUpdated",
                                    f"Updated Workload {workload.name} to the job's current "
                                    "spec"))
    return QueueStep(
        hold=True, actions=tuple(actions), events=tuple(events), pods_left=pods_left,
        workload=workload,
        queued=(True, Reason.WAITING_FOR_ADMISSION,
                f"Workload {workload.name} waits in LocalQueue {queue.queue_name}: "
                f"{_pending_message(workload)}"))


# --- after the other rules --------------------------------------------------------------------


def _with_condition(conditions: Sequence[Condition], kind: ConditionType, *, status: bool,
                    reason: str, message: str, now: datetime,
                    generation: int | None) -> list[Condition]:
    word: ConditionStatus = "True" if status else "False"
    result = [c for c in conditions if c.type != kind]
    before = next((c for c in conditions if c.type == kind), None)
    moved = before is None or before.status != word
    result.append(Condition(
        type=kind, status=word, observed_generation=generation,
        last_transition_time=now if moved or before is None else before.last_transition_time,
        reason=reason[:1024], message=message[:CONDITION_MESSAGE_LIMIT],
    ))
    order = list(ConditionType)
    return sorted(result, key=lambda c: order.index(c.type))


def report(decided: Decision, step: QueueStep, *, job: ResilientTrainingJob,
           now: datetime) -> Decision:
    """The decision of the other rules with rule 0 folded in (see the module docstring)."""
    status = decided.status
    actions: list[Action] = [*step.actions, *decided.actions]
    events: list[PostEvent] = [*step.events, *decided.events]
    workload = step.workload
    state = status.state
    # The Workload is marked Finished only once the job's status already says so (a pass after
    # the one that decided it): Kueue releases the quota, and may start the next queued job, only
    # after anyone reading this job sees it Succeeded or Failed, never before.
    shown = job.status.state if job.status is not None else None
    if state in FINISHED_STATES and shown == state and workload is not None \
            and not workload.true(kueueapi.FINISHED):
        assert state is not None
        actions.append(PatchWorkload(workload.name, workload.resource_version,
                                     finish_status(workload, state, status.message or "", now),
                                     status=True))
        events.append(PostEvent("Normal", "WorkloadFinished",
                                f"Workload {workload.name} is Finished ({state}): Kueue "
                                "releases its quota"))
    update: dict[str, Any] = {}
    conditions = list(status.conditions)
    generation = job.metadata.generation
    if step.queued is not None:
        queued, reason, message = step.queued
        conditions = _with_condition(conditions, ConditionType.QUEUED, status=queued,
                                     reason=reason, message=message, now=now,
                                     generation=generation)
        if step.hold and not step.pods_left and state == JobState.SUSPENDED:
            # Held by Kueue, not suspended by its user: say so instead of `Suspended`.
            update.update(state=JobState.QUEUED, reason=reason, message=message)
            conditions = _with_condition(conditions, ConditionType.SUSPENDED, status=True,
                                         reason=reason, message=message, now=now,
                                         generation=generation)
            events = [e for e in events if e.reason != Reason.SUSPENDED]
        update["conditions"] = conditions
    if not update:
        return replace(decided, actions=actions, events=events)
    written = status.model_copy(update=update)
    return replace(decided, actions=actions, events=events, status=written,
                   memory=replace(decided.memory, status=written))


def unqueued(decided: Decision) -> Decision:
    """The decision for a job that is not (or no longer) queued through Kueue: no `Queued`
    condition."""
    if not any(c.type == ConditionType.QUEUED for c in decided.status.conditions):
        return decided
    written = decided.status.model_copy(update={"conditions": [
        c for c in decided.status.conditions if c.type != ConditionType.QUEUED]})
    return replace(decided, status=written, memory=replace(decided.memory, status=written))


def holding(job: ResilientTrainingJob) -> ResilientTrainingJob:
    """`job` as the other rules must see it while Kueue holds it: suspended."""
    return job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})})
