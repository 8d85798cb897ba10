"""The operator's brain: one pure function from what it sees to what it does.

`decide(job, plan, observed, liveness, now, memory, settings)` returns the actions of one reconcile
pass (create or delete children, post Events, delete a finished job) and the job's complete new
status. It reads no clock, no cluster and no network, so every rule below is pinned by the
table-driven tests in tests/unit/test_decisions_*.py (built with tests/unit/decisions_builders.py).

The rules, in the order a pass applies them:

0. A job queued through Kueue (label `kueue.x-k8s.io/queue-name`, its Workload observed in
   `queue`) is held, treated as suspended, until Kueue admits its Workload; the Workload is
   created, kept in step with the job, cleared after an eviction and marked Finished with the
   job (`queueing.py`, before and after the rules below).
1. A finished job (Succeeded/Failed) only cleans up: running pods and the rendezvous pod go;
   after `ttlSecondsAfterFinished` the job itself is deleted.
2. The headless Service, the rendezvous Service and the dynamic claim exist (even while
   suspended: the claim keeps the checkpoints). The claim is owned by the job unless
   `claimDeletePolicy: Retain`.
3. `suspend: true` deletes every pod; `false` starts them again (the trainer resumes from the
   newest committed checkpoint).
4. `activeDeadlineSeconds` since `status.startTime` passed -> Failed (DeadlineExceeded).
5. A trainer pod that exited with 93 (NVRx "do not restart") or a code of
   `faultTolerance.nonRetryableExitCodes` -> Failed (NonRetryableExitCode).
6. Every trainer pod exited 0 -> Succeeded (the rendezvous pod is deleted). Once one pod has
   succeeded no pod is restarted: the training loop has ended everywhere. Once training is done
   on every rank (a trainer's `Succeeded` termination message, or a pod's `"finished"` mark),
   a pod that fails, vanishes or is lost afterwards ends the job Succeeded too, the pods still
   running deleted: it lost nothing, and no fault is looked for any more.
7. Faults: a trainer pod that failed, vanished or was deleted by someone else; a pod on a lost
   node (NotReady/unreachable) whose heartbeats stopped (`NodeLost`: force-deleted, unless the
   job's other pods completed steps since its last one: then it still trains with them and only
   the operator cannot reach it, review-2 F6; not in jobs with spares); a pod still
   Pending `podStartTimeoutSeconds` after its creation (`PodStartTimeout`; why it does not start
   shows at once in the `PodsNotStarting` condition); a rank without a heartbeat for
   `heartbeatTimeoutSeconds + initialHeartbeatTimeoutSeconds`, counted per pod (ft_launcher had
   its chance to restart the workers inside the pod first); a job whose slowest step did not
   advance for `progressTimeoutSeconds`; the rendezvous pod lost. The node of a pod that missed
   its heartbeats (except the silent pod of a single-pod job: weak evidence), was lost with its
   node or never started there is excluded: trainer pods
   created afterwards prefer other nodes (`status.excludedNodes`). `RankRestart` replaces only
   the faulty pod (spending `rankRestartBudget`); when that budget is spent, when every pod is
   faulty, when the rendezvous is lost, or with `restartStrategy: FullRestart`, every pod is
   restarted (spending `fullRestartBudget`); when that is spent -> Failed (RestartBudgetExceeded).
8. Missing pods are created. The rendezvous pod is created only when no trainer pod is still
   terminating, and trainer pods only when the rendezvous pod is up or being created: a full
   restart therefore tears everything down before it starts again, with no extra state.

What the function must remember between passes lives in the status it returns (ranks, restart
counters, incidents with their times) and in `Memory` (the status it wrote last, which is fresher
than the object kopf hands the next pass, and when the job's step last advanced).

Each rule has its own module; `decide` below is the one place that states their order:

- `queueing.py`: rule 0, Kueue;
- `lifecycle.py`: rules 1-6 and 8 (finished, Services and claim, suspend, deadline, exit codes,
  completion, create);
- `podfaults.py`: rule 7, finding the faults of the pods (failed, vanished, deleted, evicted,
  on a lost node, not starting; the rendezvous pod lost), then the hangs;
- `clocks.py`: what the hang rules and the pod faults share: a pod's scraped readings and the
  clocks its timeouts count from;
- `hangs.py`: rule 7, the ranks from the pods and the scrapes, and the hangs in them (heartbeat
  and progress timeouts, degraded observation);
- `recovery.py`: rule 7, recovering (budgets, rank restart, full restart) and failing the job;
- `stops.py`: `status.lastStop`, what the trainers asked to stop committed before they stopped;
- `status.py`: the status every rule ends with (conditions, incidents, progress, goodput);
- `state.py`: what a decision is made from (`Inputs`), the working state of a pass (`Pass`),
  `Memory`, `Decision`, `DetectedFault`.

Not a rule of `decide`: `podloss.py` decides, from one pod's watch event, which other trainer
pods to tell at once that the pod is lost (`handlers.announce_pod_loss`).

The decision returns the status as a `ResilientTrainingJobStatus`, its actions (`intents`) and
its Events apart; `reconcile` applies the actions, writes the status and posts the Events.
"""

from __future__ import annotations

import dataclasses
from datetime import datetime

from rtj_operator.api.models import ResilientTrainingJob
from rtj_operator.api.status import ResilientTrainingJobStatus
from rtj_operator.api.vocabulary import JobState
from rtj_operator.config import OperatorSettings
from rtj_operator.decisions import lifecycle, queueing, recovery, status
from rtj_operator.decisions.hangs import (
    heartbeat_deadlines,
    mark_unresponsive,
    observe_ranks,
    renewed_deadline,
)
from rtj_operator.decisions.podfaults import find_faults, lost_pods
from rtj_operator.decisions.state import Decision, DetectedFault, Inputs, Memory, Pass
from rtj_operator.decisions.status import OPERATOR_ACTIONS, invalid_spec, with_refusals
from rtj_operator.observed import Observed, QueueView, RankLiveness
from rtj_operator.podplan import PodPlan

__all__ = ["OPERATOR_ACTIONS", "Decision", "DetectedFault", "Memory", "decide", "invalid_spec",
           "renewed_deadline", "with_refusals"]


def decide(
    *,
    job: ResilientTrainingJob,
    plan: PodPlan,
    observed: Observed,
    liveness: RankLiveness,
    now: datetime,
    memory: Memory,
    settings: OperatorSettings,
    queue: QueueView | None = None,
) -> Decision:
    """The actions of one reconcile pass and the job's new status (see the module docstring);
    `queue` is the Kueue view of a job queued through Kueue (None for any other job)."""
    inputs = Inputs(job=job, plan=plan, observed=observed, liveness=liveness, now=now,
                    memory=memory, settings=settings)
    if queue is None:
        return queueing.unqueued(_decide(inputs))
    prev = memory.status or job.status or ResilientTrainingJobStatus()
    step = queueing.admit(job=job, queue=queue, observed=observed, prev=prev,
                          settings=settings, now=now)  # rule 0
    held = queueing.holding(job) if step.hold and not job.spec.suspend else job
    decided = _decide(dataclasses.replace(inputs, job=held))
    return queueing.report(decided, step, job=job, now=now)


def _decide(inputs: Inputs) -> Decision:
    """Rules 1-8."""
    p = Pass(inputs)
    lost_pods(p)  # pods on lost nodes are force-deleted by whichever rule deletes them
    if p.prev.state in (JobState.SUCCEEDED, JobState.FAILED):
        return lifecycle.finished(p)  # rule 1
    lifecycle.ensure_services_and_claim(p)  # rule 2
    if p.spec.suspend:
        return lifecycle.suspended(p)  # rule 3
    start_time = p.prev.start_time or p.now
    for ends_the_job in (
        lifecycle.past_deadline,  # rule 4
        lifecycle.non_retryable_exit,  # rule 5
        lifecycle.completion,  # rule 6
    ):
        ended = ends_the_job(p, start_time)
        if ended is not None:
            return ended
    observe_ranks(p)  # rule 7
    mark_unresponsive(p)
    faults = find_faults(p)
    if faults:
        failed = recovery.recover(p, faults, start_time)
        if failed is not None:
            return failed
    lifecycle.create_missing(p)  # rule 8
    p.recheck = heartbeat_deadlines(p)
    return status.running(p, start_time)
