"""Recovery from the faults of rule 7, and failing the job (rules 4, 5 and 7).

An eviction (`PodEvicted`: a drain, a preemption by the scheduler) is no fault and spends no
budget: the evicted pod's trainers, and through their stop agreement every other rank, committed
a checkpoint of the current step; the pod is created again once its name is free
(`Reschedule`), and the other launchers restart their workers into the next round with it. When
no trainer pod would be left to open that round (every one was evicted), or the rendezvous pod
itself was evicted, every pod is replaced, each trainer pod with its own grace period.

Warm spares first, at no budget: a lost pod whose ranks a warm spare can take over
(`SpareTakeover`) gets a replacement that waits as a spare, and a lost spare is replaced
(`SpareReplace`). Then the cheapest fix that the budgets allow: `RankRestart` replaces only
the faulty pods (spending `rankRestartBudget`); when that budget is spent, when every pod is
at fault, when the fault concerns the whole job (the rendezvous is lost) or with
`restartStrategy: FullRestart`, every pod is restarted (spending `fullRestartBudget`); when
that is spent the job fails (RestartBudgetExceeded). Budgets count the operator's own
restarts of their kind within the budget's window, from `status.restartRecords` (kept apart from
the incident list, the newest `max` per kind).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from rtj_operator.api.status import Incident
from rtj_operator.api.vocabulary import (
    ConditionType,
    IncidentCause,
    JobState,
    RankState,
    Reason,
    RecoveryAction,
)
from rtj_operator.decisions import status
from rtj_operator.decisions.state import Decision, DetectedFault, Pass

RECOVERY_GRACE_SECONDS = 3
"""The grace period of a pod deleted to recover from a fault. On SIGTERM the trainers commit a
checkpoint of their current step before they exit (rtj_trainer.stop), for as long as the pod's
terminationGracePeriodSeconds allows; a job that needs recovering cannot (a rank is hung, gone or
failed, and every rank must join the save), and the job resumes from its newest commit anyway. A
short grace keeps recovery as quick as when SIGTERM ended the workers at once."""

FULL_RESTART_BACKOFF_SECONDS = 10
"""The wait before starting the pods again after the second full restart in a row with no
recovery in between; it doubles with each further one, up to FULL_RESTART_BACKOFF_MAX_SECONDS."""
FULL_RESTART_BACKOFF_MAX_SECONDS = 300
"""The longest wait between full restarts (kubelet's CrashLoopBackOff has the same cap)."""

LOST = (IncidentCause.POD_FAILED, IncidentCause.POD_VANISHED, IncidentCause.POD_DELETED,
        IncidentCause.NODE_LOST)
"""Faults whose processes are gone, which a warm spare can take over."""


def _spares_first(p: Pass, faults: list[DetectedFault]) -> list[DetectedFault]:
    """Answer what spares can answer, at no budget; return the faults left for the ladder.

    A lost spare (or waiting replacement) is replaced. A lost active pod whose ranks a warm spare
    can take over (NVRx in-process restart moves the spare's ranks into the lost ones while every
    other pod keeps its processes) gets a replacement that waits as a spare."""
    left = []
    for fault in faults:
        index = fault.node_index
        was = p.prev_ranks.get(index) if index is not None else None
        if index is not None and (index in p.standby or (
                was is not None and was.state == RankState.STANDBY)):
            replace_spare(p, fault)
        else:
            left.append(fault)
    if any(f.cause == IncidentCause.SPEC_CHANGED for f in left):
        restart_for_new_spec(p, next(f for f in left if f.cause == IncidentCause.SPEC_CHANGED))
        return []
    left = _evictions_first(p, left)
    if (not left or p.spec.fault_tolerance.restart_strategy == "FullRestart"
            or any(f.whole_job or f.cause not in LOST or f.node_index is None for f in left)
            or len(left) > len(p.warm_spares())):
        return left
    for fault, spare in zip(left, p.warm_spares(), strict=False):
        spare_takeover(p, fault, spare)
    return []


def _evictions_first(p: Pass, faults: list[DetectedFault]) -> list[DetectedFault]:
    """Reschedule what was evicted, at no budget; return the faults left for the ladder."""
    evicted = [f for f in faults if f.cause == IncidentCause.POD_EVICTED]
    if not evicted:
        return faults
    if any(f.node_index is None for f in evicted):
        reschedule_everything(p, next(f for f in evicted if f.node_index is None))
        return []  # every pod starts again: nothing else to do for the others
    gone = {f.node_index for f in evicted}
    survivors = [i for i in p.active() if i not in gone and (pod := p.observed.trainer_pods.get(i))
                 is not None and not pod.deleting and not pod.terminated]
    for fault in evicted:
        reschedule(p, fault)
    if not survivors and p.observed.rendezvous_pod is not None:
        # No launcher is left to open the next round for the new pods: start the rendezvous
        # afresh too (it is created again once no trainer pod is terminating).
        p.delete_pod(p.observed.rendezvous_pod,
                     "every trainer pod was evicted: the rendezvous starts again with the new "
                     "pods")
    return [f for f in faults if f.cause != IncidentCause.POD_EVICTED]


def reschedule(p: Pass, fault: DetectedFault) -> None:
    """An evicted trainer pod is created again once its name is free (rule 8), elsewhere: the
    drained node is cordoned. No budget; the pod is already going (the eviction deleted it)."""
    assert fault.node_index is not None
    index = fault.node_index
    p.add_incident(fault, RecoveryAction.RESCHEDULE)
    p.rank(index, state=RankState.RESTARTING)
    p.event("Normal", RecoveryAction.RESCHEDULE,
            f"Rescheduling the pod of node {index} (no budget spent): {fault.message}")


def reschedule_everything(p: Pass, fault: DetectedFault) -> None:
    """The rendezvous pod was evicted: every launcher lost the store and stops its workers with a
    checkpoint of the current step (rtj_trainer.launcher). Delete every trainer pod with its own
    grace period (the stop checkpoint must finish) and start everything again once they are
    gone, like a full restart but without spending a budget."""
    p.add_incident(fault, RecoveryAction.RESCHEDULE)
    p.event("Normal", RecoveryAction.RESCHEDULE,
            f"Restarting every pod (no budget spent): {fault.message}")
    p.waiting.clear()  # every launcher starts again and joins the first round
    for index in range(p.pods):
        p.rank(index, state=RankState.RESTARTING)
        pod = p.observed.trainer_pods.get(index)
        if pod is not None:
            p.delete_pod(pod, "the rendezvous pod was evicted: every pod starts again")
    if p.observed.rendezvous_pod is not None:
        p.delete_pod(p.observed.rendezvous_pod, "it was evicted")


def restart_for_new_spec(p: Pass, fault: DetectedFault) -> None:
    """Running pods were built from another spec: stop every pod with its own grace period
    (its trainers commit a checkpoint of their current step, as for a suspend) and start them
    all again from the new spec once they are gone. No budget: nothing failed."""
    p.add_incident(fault, RecoveryAction.RESCHEDULE)
    p.event("Warning", IncidentCause.SPEC_CHANGED, fault.message)
    p.waiting.clear()
    for index in range(p.pods):
        p.rank(index, state=RankState.RESTARTING)
        pod = p.observed.trainer_pods.get(index)
        if pod is not None and not pod.deleting:
            p.delete_pod(pod, "it runs an older spec")
    rendezvous = p.observed.rendezvous_pod
    if rendezvous is not None and not rendezvous.deleting:
        p.delete_pod(rendezvous, "it runs an older spec")


def recover(p: Pass, faults: list[DetectedFault], start_time: datetime) -> Decision | None:
    """Exclude the nodes the faults accuse, then spend the cheapest budget that can fix the
    faults, or fail the job."""
    for fault in faults:
        p.exclude_node(fault)
    faults = _spares_first(p, faults)
    if not faults:
        return None
    ft = p.spec.fault_tolerance
    nodes_at_fault = {f.node_index for f in faults if f.node_index is not None}
    whole_job = (
        ft.restart_strategy == "FullRestart"
        or any(f.whole_job for f in faults)
        or len(nodes_at_fault) >= p.spec.nodes
    )
    if not whole_job:
        budget = ft.rank_restart_budget
        window_start = p.now - timedelta(seconds=budget.window_seconds)
        spent = p.restarts_within(RecoveryAction.RANK_RESTART, window_start)
        if spent + len(faults) <= budget.max:
            for fault in faults:
                restart_rank(p, fault)
            return None
        p.event("Warning", "RankRestartBudgetSpent",
                f"rankRestartBudget ({budget.max} per {budget.window_seconds} s) is spent: "
                "restarting every pod")
    budget_full = ft.full_restart_budget
    window_start = p.now - timedelta(seconds=budget_full.window_seconds)
    spent_full = p.restarts_within(RecoveryAction.FULL_RESTART, window_start)
    first = faults[0]
    summary = "; ".join(f.message for f in faults[:3]) + (
        f"; and {len(faults) - 3} more faults" if len(faults) > 3 else "")
    if spent_full >= budget_full.max:
        p.add_incident(first, RecoveryAction.FAIL, summary)
        return fail(
            p, Reason.BUDGET,
            f"fullRestartBudget ({budget_full.max} per {budget_full.window_seconds} s) is spent; "
            f"last fault: {summary}",
            start_time,
        )
    restart_everything(p, first, summary)
    return None


def _restarts_of(p: Pass, index: int) -> int:
    previous = p.ranks.get(index) or p.prev_ranks.get(index)
    return (previous.restarts or 0) if previous else 0


def restart_rank(p: Pass, fault: DetectedFault) -> None:
    """Replace the pod of one node index (RankRestart)."""
    assert fault.node_index is not None
    index = fault.node_index
    pod = p.observed.trainer_pods.get(index)
    p.add_incident(fault, RecoveryAction.RANK_RESTART)
    p.record_restart(RecoveryAction.RANK_RESTART, p.spec.fault_tolerance.rank_restart_budget.max)
    p.restarts.rank += 1
    p.rank(index, state=RankState.RESTARTING, restarts=_restarts_of(p, index) + 1)
    p.event("Warning", RecoveryAction.RANK_RESTART,
            f"Replacing the pod of node {index} ({fault.cause}): {fault.message}")
    if pod is not None:
        p.replace_ended_pod(pod, f"{fault.cause}: replacing it",
                            grace_seconds=RECOVERY_GRACE_SECONDS)


def spare_takeover(p: Pass, fault: DetectedFault, spare: int) -> None:
    """A warm spare's ranks take over the lost pod's ranks in place (the trainers do it: NVRx
    in-process restart with FillGaps); the lost index gets a new pod that waits as a spare."""
    assert fault.node_index is not None
    index = fault.node_index
    p.add_incident(fault, RecoveryAction.SPARE_TAKEOVER,
                   f"{fault.message}; spare pod {spare} takes over its ranks")
    p.restarts.spare = (p.restarts.spare or 0) + 1
    p.standby.discard(spare)
    _replace_as_spare(p, index, f"{fault.cause}: a spare took over its ranks")
    p.event("Warning", RecoveryAction.SPARE_TAKEOVER,
            f"Node {index} lost ({fault.cause}): the ranks of spare pod {spare} take over in "
            f"place; a new pod for node {index} waits as a spare. {fault.message}")


def replace_spare(p: Pass, fault: DetectedFault) -> None:
    """A standby pod (a warm spare or a waiting replacement) was lost: replace it."""
    assert fault.node_index is not None
    p.add_incident(fault, RecoveryAction.SPARE_REPLACE)
    _replace_as_spare(p, fault.node_index, f"{fault.cause}: replacing the spare")
    p.event("Warning", RecoveryAction.SPARE_REPLACE,
            f"Replacing spare pod {fault.node_index} ({fault.cause}): {fault.message}")


def _replace_as_spare(p: Pass, index: int, why: str) -> None:
    pod = p.observed.trainer_pods.get(index)
    p.standby.add(index)
    p.waiting.add(index)
    p.rank(index, state=RankState.RESTARTING, restarts=_restarts_of(p, index) + 1)
    if pod is not None:
        p.replace_ended_pod(pod, why, grace_seconds=RECOVERY_GRACE_SECONDS)


def full_restart_backoff(incidents: list[Incident]) -> tuple[int, datetime | None]:
    """Full restarts in a row with no recovery in between (every rank running again closes an
    incident: status.recover_incidents), counted back from the newest incident; and, from the
    second one on, when the newest of them may start the pods again: its time plus
    FULL_RESTART_BACKOFF_SECONDS, doubled for each further one, at most
    FULL_RESTART_BACKOFF_MAX_SECONDS. A job that cannot start (a rendezvous pod that dies at
    every start, a bad image) then spends its full-restart budget over many minutes, not in two,
    and a cause that passes (a port still held, a node coming back) has time to pass; the first
    full restart after a recovery waits for nothing."""
    streak, newest = 0, None
    for incident in reversed(incidents):
        if incident.recovered_time is not None:
            break
        if incident.action == RecoveryAction.FULL_RESTART:
            streak += 1
            if newest is None:
                newest = incident.acted_time or incident.detected_time
    if streak < 2 or newest is None:
        return streak, None
    wait = min(FULL_RESTART_BACKOFF_SECONDS * 2 ** (streak - 2), FULL_RESTART_BACKOFF_MAX_SECONDS)
    return streak, newest + timedelta(seconds=wait)


def restart_everything(p: Pass, fault: DetectedFault, summary: str) -> None:
    """Delete every trainer pod and the rendezvous pod (FullRestart); rule 8 starts them again
    once every one is gone, and after the back-off (`full_restart_backoff`)."""
    p.add_incident(fault, RecoveryAction.FULL_RESTART, summary)
    p.record_restart(RecoveryAction.FULL_RESTART, p.spec.fault_tolerance.full_restart_budget.max)
    p.restarts.full += 1
    p.event("Warning", RecoveryAction.FULL_RESTART,
            f"Restarting every pod ({fault.cause}): {summary}")
    streak, not_before = full_restart_backoff(p.incidents)
    if not_before is not None:
        p.event("Warning", "FullRestartBackOff",
                f"{streak} full restarts in a row without a recovery: the pods start again "
                f"in {int((not_before - p.now).total_seconds())} s, not at once")
    p.waiting.clear()  # every launcher starts again and joins the first round
    for index in range(p.pods):
        p.rank(index, state=RankState.RESTARTING, restarts=_restarts_of(p, index) + 1)
        pod = p.observed.trainer_pods.get(index)
        if pod is not None:
            p.delete_pod(pod, f"full restart ({fault.cause})",
                         grace_seconds=RECOVERY_GRACE_SECONDS)
    if p.observed.rendezvous_pod is not None:
        p.delete_pod(p.observed.rendezvous_pod, f"full restart ({fault.cause})")


def fail(
    p: Pass, reason: Reason, message: str, start_time: datetime,
    failed_index: int | None = None,
) -> Decision:
    """The job failed: stop every pod, keep the record."""
    for index, pod in p.observed.trainer_pods.items():
        if not pod.terminated:
            p.delete_pod(pod, "the job failed")
        p.rank(index, pod=pod.name, node=pod.node_name, attempt=pod.attempt,
               state=RankState.FAILED if index == failed_index or pod.phase == "Failed" else
               (RankState.SUCCEEDED if pod.phase == "Succeeded" else RankState.FAILED))
    if p.observed.rendezvous_pod is not None:
        p.delete_pod(p.observed.rendezvous_pod, "the job failed")
    p.event("Warning", reason, f"Failed: {message}")
    written = status.build(
        p, state=JobState.FAILED, reason=reason, message=f"The job failed: {message}",
        conditions={ConditionType.FAILED: True}, start_time=start_time, ready_nodes=0,
        completion_time=p.now,
    )
    return status.decision(p, written)
