"""The status a pass writes: conditions, incidents (opened, closed, bounded), the ranks'
restarts inside the pods, training progress and goodput, all as a `ResilientTrainingJobStatus`.

The status is also the decision's memory: ranks, restart counters and incidents with their times
are what the next pass starts from (see `state.Memory`).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from datetime import datetime
from typing import Any

from rtj_operator.api.status import (
    MAX_INCIDENTS,
    Condition,
    Incident,
    LastCheckpoint,
    ProgressClock,
    ResilientTrainingJobStatus,
    RestartRecords,
    SpareStatus,
)
from rtj_operator.api.vocabulary import (
    ConditionStatus,
    ConditionType,
    IncidentCause,
    JobState,
    RankState,
    Reason,
    RecoveryAction,
)
from rtj_operator.decisions import stops
from rtj_operator.decisions.fallback import fallen_back
from rtj_operator.decisions.hangs import degraded_observation, not_reporting
from rtj_operator.decisions.podfaults import training_finished
from rtj_operator.decisions.state import (
    Decision,
    DetectedFault,
    Memory,
    Pass,
    from_unix,
    iso,
    some,
    whole_second,
)
from rtj_operator.intents import CreateObject, CreateRefused, PostEvent

OPERATOR_ACTIONS = (RecoveryAction.RANK_RESTART, RecoveryAction.FULL_RESTART,
                    RecoveryAction.SPARE_TAKEOVER, RecoveryAction.SPARE_REPLACE,
                    RecoveryAction.RESCHEDULE)
"""Recoveries the operator runs itself; it times them from detection to recovery. Restarts
inside the pods (ft_launcher, in-process) are only seen afterwards, in the trainers' counters."""


# --- incidents ----------------------------------------------------------------------------------


def is_open(incident: Incident) -> bool:
    return incident.recovered_time is None and incident.action in OPERATOR_ACTIONS


def recover_incidents(p: Pass) -> None:
    """Close the incidents that are still open: every pod runs again (the trainers' resume after
    that is not waited for; a warm spare's takeover can close in the pass that acted: 0 s)."""
    for n, incident in enumerate(p.incidents):
        if is_open(incident):
            seconds = max(0.0, (p.now - incident.detected_time).total_seconds())
            p.incidents[n] = incident.model_copy(
                update={"recovered_time": p.now, "seconds": round(seconds, 1)}
            )


def _worker_restart_incidents(p: Pass) -> None:
    """Restarts that happened inside the pods (ft_launcher, NVRx in-process), seen through the
    trainers' `rtj_trainer_restarts_total{kind}` counters."""
    seen: dict[str, int] = {}
    for node in p.liveness.values():
        for sample in node.samples:
            for kind, count in sample.restarts.items():
                seen[kind] = max(seen.get(kind, 0), int(count))
    for kind, action, attribute in (
        ("launcher", RecoveryAction.LAUNCHER_RESTART, "launcher"),
        ("inprocess", RecoveryAction.IN_PROCESS_RESTART, "in_process"),
    ):
        before = getattr(p.restarts, attribute)
        after = seen.get(kind, before)
        if after > before:
            setattr(p.restarts, attribute, after)
            fault = DetectedFault(IncidentCause.WORKER_RESTART, None, p.now,
                                  f"{after - before} {kind} restart(s) of the workers inside "
                                  "the pods")
            p.add_incident(fault, action)
            p.event("Normal", action, f"The trainers report {fault.message}")


def _bounded(incidents: list[Incident]) -> list[Incident]:
    """The newest MAX_INCIDENTS incidents, dropping restarts inside the pods first: the
    operator's own restarts are what the restart budgets count."""
    kept = list(incidents)
    while len(kept) > MAX_INCIDENTS:
        in_pod = next((n for n, i in enumerate(kept) if i.action not in OPERATOR_ACTIONS), None)
        kept.pop(in_pod if in_pod is not None else 0)
    return kept


# --- a job that runs ----------------------------------------------------------------------------


def running(p: Pass, start_time: datetime) -> Decision:
    """The status of a job that is starting, running or recovering (nothing ended it)."""
    _worker_restart_incidents(p)
    ready = sum(1 for i in p.active() if p.ranks[i].state == RankState.RUNNING)
    all_ready = ready >= p.spec.nodes
    recovering = any(is_open(i) for i in p.incidents)
    if all_ready:
        recover_incidents(p)
        recovering = False
    reason: Reason | RecoveryAction
    if all_ready and any(not_reporting(p, i) for i in p.active()):
        state, reason, message = JobState.RUNNING, Reason.RUNNING, (
            "Every pod runs (some pods' workers report no heartbeats: see HangDetection).")
    elif all_ready:
        state, reason, message = JobState.RUNNING, Reason.RUNNING, "Every rank sends heartbeats."
    elif recovering:
        open_incident = next(i for i in reversed(p.incidents) if is_open(i))
        state, reason = JobState.RECOVERING, open_incident.action or RecoveryAction.RANK_RESTART
        message = f"Recovering from {open_incident.cause}: {open_incident.message}"
        if p.backoff_until is not None:
            message = (f"{message} (full restarts in a row: the pods start again at "
                       f"{iso(p.backoff_until)})")
    elif all(p.ranks[i].state in (RankState.STARTING, RankState.RUNNING,
                                  RankState.UNRESPONSIVE)
             for i in p.active()):
        state, reason = JobState.PENDING, Reason.STARTING
        message = "Waiting for every rank's heartbeat."
    elif finished := [i for i in p.active() if training_finished(p, i)]:
        # Rule 6 ends the job once every pod exited (exit barriers, the rendezvous closing).
        state, reason = JobState.RUNNING, Reason.RUNNING
        message = (f"Training finished on {len(finished)} of {len(p.active())} pods; waiting for "
                   "the others to exit.")
    else:
        state, reason = JobState.PENDING, Reason.CREATING
        message = "Creating and starting the pods."
    if state != p.prev.state:
        p.event("Normal", state, message)
    degraded = degraded_observation(p)
    was_degraded = any(c.type == ConditionType.OBSERVATION_DEGRADED and c.status == "True"
                       for c in p.prev.conditions)
    details = _not_starting_detail(p)
    hang_detection = _hang_detection(p)
    if hang_detection is not None:
        details[ConditionType.HANG_DETECTION] = hang_detection[1]
    if degraded is not None:
        details[ConditionType.OBSERVATION_DEGRADED] = (Reason.OBSERVATION_DEGRADED, degraded)
        if not was_degraded:
            p.event("Warning", Reason.OBSERVATION_DEGRADED, f"Observation degraded: {degraded}")
    written = build(
        p, state=state, reason=reason, message=message,
        conditions={ConditionType.RUNNING: all_ready, ConditionType.READY: all_ready,
                    ConditionType.RECOVERING: recovering,
                    ConditionType.PODS_NOT_STARTING: bool(p.not_starting),
                    ConditionType.OBSERVATION_DEGRADED: degraded is not None,
                    **({ConditionType.HANG_DETECTION: hang_detection[0]}
                       if hang_detection is not None else {})},
        start_time=start_time, ready_nodes=ready, details=details,
    )
    return decision(p, written)


def _not_starting_detail(p: Pass) -> dict[ConditionType, tuple[str, str]]:
    """The PodsNotStarting condition's own reason (the scheduler's or kubelet's, of the first
    pod) and message (every pod that does not start, and why)."""
    if not p.not_starting:
        return {}
    word = re.sub(r"[^A-Za-z0-9_]", "", p.not_starting[0][1]) or "PodNotStarting"
    shown = 5
    message = "; ".join(f"pod {pod}: {reason}: {why}"
                        for pod, reason, why in p.not_starting[:shown])
    if len(p.not_starting) > shown:
        message += f"; and {len(p.not_starting) - shown} more pods"
    timeout = p.spec.fault_tolerance.pod_start_timeout_seconds
    return {ConditionType.PODS_NOT_STARTING: (
        word if word[0].isalpha() else f"P{word}",
        f"{message} (replaced after podStartTimeoutSeconds={timeout})")}


# --- the status ---------------------------------------------------------------------------------


def _training_progress(p: Pass) -> dict[str, Any]:
    """step, last_checkpoint and goodput from the scraped metrics (kept when nothing answered);
    a field nothing is known about is left out. last_checkpoint only moves up, except to follow
    ranks that resumed from an older checkpoint (`fallback.fallen_back`)."""
    result: dict[str, Any] = {}
    steps = [p.ranks[i].step for i in p.active() if i in p.ranks]
    if steps and all(s is not None for s in steps):
        result["step"] = min(s for s in steps if s is not None)
    elif p.prev.step is not None:
        result["step"] = p.prev.step
    best = fallen_back(p, p.prev.last_checkpoint) or p.prev.last_checkpoint
    best_step = best.step if best is not None else -1
    best_time = best.time if best is not None else None
    goodput: float | None = None
    for index, node in sorted(p.liveness.items()):
        for sample in node.samples:
            if sample.committed_step is not None and sample.committed_step > best_step:
                best_step = sample.committed_step
                best_time = (from_unix(sample.committed_time)
                             if sample.committed_time else None)
            if sample.goodput_ratio is not None and (
                sample.rank == 0 or (index == 0 and sample.local_rank == 0)
            ):
                goodput = sample.goodput_ratio
    if best_step >= 0 and result.get("step", best_step) < best_step:
        # Restarted workers report step 0 until they have loaded the checkpoint; training
        # never resumes from before the newest committed checkpoint.
        result["step"] = best_step
    if best_step >= 0:
        result["last_checkpoint"] = LastCheckpoint(
            step=best_step, time=whole_second(best_time) if best_time is not None else None
        )
    if goodput is not None:
        result["goodput"] = f"{min(100.0, max(0.0, goodput * 100)):.1f}%"
    elif p.prev.goodput is not None:
        result["goodput"] = p.prev.goodput
    return result


def checkpoint_staleness(
    p: Pass, state: JobState, progress: dict[str, Any]
) -> tuple[bool, str]:
    """Whether the job's step is more than `staleAfterIntervals` checkpoint intervals past the
    newest committed checkpoint (only while the job is starting, running or recovering), and
    why."""
    step = progress.get("step")
    if step is None or state not in (JobState.PENDING, JobState.RUNNING, JobState.RECOVERING):
        return False, ""
    checkpoint = progress.get("last_checkpoint")
    committed = checkpoint.step if checkpoint is not None else 0
    checkpoint_spec = p.spec.checkpoint
    limit = checkpoint_spec.stale_after_intervals * checkpoint_spec.interval_steps
    lag = step - committed
    newest = f"step {committed}" if checkpoint is not None else "none yet"
    return lag > limit, (
        f"step {step} is {lag} steps past the newest committed checkpoint ({newest}), more than "
        f"staleAfterIntervals x intervalSteps = {checkpoint_spec.stale_after_intervals} x "
        f"{checkpoint_spec.interval_steps}"
    )


_SAY_WHY_FALSE = frozenset({ConditionType.HANG_DETECTION})
"""Conditions whose message says why they are False (the others say why they are True)."""


def _hang_detection(p: Pass) -> tuple[bool, tuple[str, str]] | None:
    """HangDetection once some pod runs: False while a running pod's workers report nothing
    (`hangs.not_reporting`), naming them; None before any pod runs."""
    running_pods = [i for i in p.active() if (pod := p.observed.trainer_pods.get(i)) is not None
                    and pod.phase == "Running"]
    if not running_pods:
        return None
    silent = [p.observed.trainer_pods[i].name for i in running_pods if not_reporting(p, i)]
    timeout = p.spec.fault_tolerance.heartbeat_timeout_seconds
    if not silent:
        return True, (Reason.HEARTBEATS_WATCHED,
                      f"hung workers are detected from their heartbeats "
                      f"(heartbeatTimeoutSeconds={timeout})")
    shown = some(silent)
    return False, (Reason.NO_HEARTBEATS,
                   f"hang detection is off for pod(s) {shown}: their workers send no NVRx "
                   "heartbeats and serve no trainer metrics, so a hung worker there is not "
                   "detected; exits, lost pods and nodes still are. Send heartbeats with NVRx's "
                   "RankMonitorClient or the trainer's library (docs/byo.md)")


def _conditions(
    p: Pass, truths: dict[ConditionType, bool], reason: str, message: str,
    details: dict[ConditionType, tuple[str, str]] | None = None,
) -> list[Condition]:
    """Every condition type; lastTransitionTime moves only when a status flips. A condition in
    `details` has its own reason and message instead of the job's."""
    previous = {c.type: c for c in p.prev.conditions}
    result = []
    for kind in ConditionType:
        if kind == ConditionType.ADMISSION_REFUSED:
            # What the API server answered, not a decision: `with_refusals` sets it after the
            # actions ran; until then it keeps its value.
            result.append(previous.get(kind) or Condition(
                type=kind, status="False", observed_generation=p.job.metadata.generation,
                last_transition_time=p.now, reason=Reason.ADMITTED))
            continue
        if kind == ConditionType.QUEUED or (kind == ConditionType.HANG_DETECTION
                                             and kind not in truths):
            # Queued: only a job queued through Kueue has it; rule 0 writes it
            # (`queueing.report`). HangDetection: written while the job runs (`running`).
            if kind in previous:
                result.append(previous[kind])
            continue
        status: ConditionStatus = "True" if truths.get(kind, False) else "False"
        before = previous.get(kind)
        moved = before is None or before.status != status
        own_reason, own_message = (details or {}).get(kind, (reason, message))
        result.append(Condition(
            type=kind,
            status=status,
            observed_generation=p.job.metadata.generation,
            last_transition_time=p.now if moved or before is None else before.last_transition_time,
            reason=own_reason[:1024],
            message=(own_message[:MESSAGE_LIMIT]
                     if status == "True" or kind in _SAY_WHY_FALSE else ""),
        ))
    return result


def build(
    p: Pass,
    *,
    state: JobState,
    reason: Reason | RecoveryAction,
    message: str,
    conditions: dict[ConditionType, bool],
    start_time: datetime | None,
    ready_nodes: int,
    completion_time: datetime | None = None,
    details: dict[ConditionType, tuple[str, str]] | None = None,
) -> ResilientTrainingJobStatus:
    """The complete status of this pass. Only the fields it knows are set: one left out keeps
    its value on the object (the status is written as a merge patch)."""
    for index in range(p.pods):
        rank = p.rank(index)  # make sure every node index has an entry
        if rank.state != RankState.UNRESPONSIVE and rank.unresponsive_since is not None:
            p.rank(index, unresponsive_since=None)  # left the state in this pass
    restarts = p.restarts.model_copy(update={
        "total": p.restarts.rank + p.restarts.full + p.restarts.launcher + p.restarts.in_process
    })
    progress = _training_progress(p)
    stale, why = checkpoint_staleness(p, state, progress)
    was_stale = any(c.type == ConditionType.CHECKPOINT_STALE and c.status == "True"
                    for c in p.prev.conditions)
    if stale and not was_stale:
        p.event("Warning", Reason.CHECKPOINT_STALE, f"Checkpoints are stale: {why}")
    elif was_stale and not stale and state not in (JobState.SUSPENDED, JobState.QUEUED):
        p.event("Normal", Reason.CHECKPOINT_CURRENT, "A committed checkpoint caught up")
    own = {ConditionType.CHECKPOINT_STALE: (
        Reason.CHECKPOINT_STALE if stale else Reason.CHECKPOINT_CURRENT, why)}
    fields: dict[str, Any] = {
        "observed_generation": p.job.metadata.generation,
        "conditions": _conditions(p, {**conditions, ConditionType.CHECKPOINT_STALE: stale},
                                  reason, message, {**(details or {}), **own}),
        "state": state,
        "reason": reason,
        "message": message[:MESSAGE_LIMIT],
        "nodes_ready": ready_nodes,
        "nodes_desired": p.spec.nodes,
        "nodes": f"{ready_nodes}/{p.spec.nodes}",
        "restarts": restarts,
        "ranks": [p.ranks[i] for i in range(p.pods)],
        "rank_counts": _rank_counts(p),
        "incidents": _bounded(p.incidents),
        **progress,
    }
    if p.progress_step is not None and p.progress_since is not None:
        fields["progress_clock"] = ProgressClock(step=p.progress_step,
                                                 since=whole_second(p.progress_since))
    elif p.prev.progress_clock is not None:
        fields["progress_clock"] = None  # removed from the object (merge patch null)
    if any(p.records.values()) or p.prev.restart_records is not None:
        fields["restart_records"] = RestartRecords(
            rank=[whole_second(t) for t in p.records[RecoveryAction.RANK_RESTART]],
            full=[whole_second(t) for t in p.records[RecoveryAction.FULL_RESTART]],
        )
    if p.spec.fault_tolerance.spares or p.waiting:
        fields["spares"] = SpareStatus(
            desired=p.spec.fault_tolerance.spares,
            ready=len(p.warm_spares()) if state in (JobState.RUNNING, JobState.RECOVERING,
                                                     JobState.PENDING) else 0,
            waiting=sorted(p.waiting),
        )
    if p.excluded or p.prev.excluded_nodes is not None:
        fields["excluded_nodes"] = p.excluded
    if p.prev.last_stop is not None:
        fields["last_stop"] = p.prev.last_stop  # `stops.record_stop` moves it on
    if start_time is not None:
        fields["start_time"] = whole_second(start_time)
    completion = completion_time or p.prev.completion_time
    if completion is not None:
        fields["completion_time"] = whole_second(completion)
    return ResilientTrainingJobStatus(**fields)


def _rank_counts(p: Pass) -> dict[str, int]:
    """How many trainer pods are in each rank state (a pod without a state yet: `Unknown`)."""
    counts: dict[str, int] = {}
    for index in range(p.pods):
        state = p.ranks[index].state
        key = str(state) if state is not None else "Unknown"
        counts[key] = counts.get(key, 0) + 1
    return counts


def decision(p: Pass, status: ResilientTrainingJobStatus) -> Decision:
    """The pass's decision with its final status: every rule ends here, so a stop the trainers
    committed is recorded whichever rule decided (`stops.record_stop`)."""
    status = stops.record_stop(p, status)
    memory = Memory(status=status, progress_step=p.progress_step,
                    progress_since=p.progress_since, unobserved_since=dict(p.unobserved_since))
    return Decision(actions=p.actions, events=p.events, status=status, incidents=p.opened,
                    memory=memory, unresponsive=p.unresponsive, recheck=p.recheck,
                    renewable=p.renewable)


MESSAGE_LIMIT = 4096
"""Longest message the operator writes in a condition or `status.message` (the schema allows
32,768): twelve condition types at the schema's limit alone would be 384 KiB, and an
8,192-node job's status must stay far below etcd's 1.5 MiB (docs/scale.md)."""


REFUSAL_MESSAGE_LIMIT = 4096
"""Characters of each refusal kept in the condition's message and the Event."""


def refusal_condition(refused: Sequence[CreateRefused]) -> tuple[str, str]:
    """The AdmissionRefused condition's reason and message for this pass's refused creates:
    `PodSecurity` when Pod Security admission refused one (its message names the level and the
    violations), `NameTaken` when another object holds a name the job needs (a 409 for an object
    that is not the job's), else `Forbidden`."""
    reason = (Reason.POD_SECURITY if any("violates PodSecurity" in r.message for r in refused)
              else Reason.NAME_TAKEN if any(r.name_taken for r in refused)
              else Reason.FORBIDDEN)
    message = "; ".join(f"{r.kind} {r.name}: {r.message[:REFUSAL_MESSAGE_LIMIT]}"
                        for r in refused[:3])
    if len(refused) > 3:
        message += f"; and {len(refused) - 3} more ({some([r.name for r in refused[3:]])})"
    return reason, message


def with_refusals(
    decided: Decision, refused: Sequence[CreateRefused], now: datetime
) -> Decision:
    """The pass's decision once its actions ran: the `AdmissionRefused` condition set from the
    creates the API server refused (True, with a Warning Event when it appears or its message
    changes), or cleared (False, a Normal Event) when creates went through or the job no longer
    wants pods. The rest of the status is the decision's: a refused pod stays Pending and is
    created again by the next pass (liveness does not count it as vanished)."""
    conditions = list(decided.status.conditions)
    index = next((i for i, c in enumerate(conditions)
                  if c.type == ConditionType.ADMISSION_REFUSED), None)
    if index is None:
        return decided
    current = conditions[index]
    events = list(decided.events)
    wants_pods = decided.status.state in (JobState.PENDING, JobState.RUNNING,
                                          JobState.RECOVERING)
    created = any(isinstance(a, CreateObject) for a in decided.actions)
    if refused:
        reason, message = refusal_condition(refused)
        if current.status == "True" and current.message == message:
            return decided
        conditions[index] = current.model_copy(update={
            "status": "True", "reason": reason, "message": message[:MESSAGE_LIMIT],
            "observed_generation": decided.status.observed_generation,
            "last_transition_time": (current.last_transition_time if current.status == "True"
                                     else whole_second(now)),
        })
        events.append(PostEvent("Warning", "AdmissionRefused",
                                f"The API server refused to create {message}"))
    elif current.status == "True" and (created or not wants_pods):
        conditions[index] = current.model_copy(update={
            "status": "False", "reason": Reason.ADMITTED, "message": "",
            "observed_generation": decided.status.observed_generation,
            "last_transition_time": whole_second(now),
        })
        if created:
            events.append(PostEvent("Normal", Reason.ADMITTED,
                                    "The API server accepted the job's children again"))
    else:
        return decided
    status = decided.status.model_copy(update={"conditions": conditions})
    return replace(decided, status=status, events=events,
                   memory=replace(decided.memory, status=status))


def invalid_spec(generation: int | None, message: str, now: datetime) -> ResilientTrainingJobStatus:
    """Status of a job whose spec the operator cannot parse (the CRD normally prevents it)."""
    condition = Condition(
        type=ConditionType.FAILED, status="True", observed_generation=generation,
        last_transition_time=now, reason=Reason.INVALID, message=message[:MESSAGE_LIMIT],
    )
    return ResilientTrainingJobStatus(
        observed_generation=generation,
        state=JobState.FAILED,
        reason=Reason.INVALID,
        message=message[:MESSAGE_LIMIT],
        conditions=[condition],
    )
