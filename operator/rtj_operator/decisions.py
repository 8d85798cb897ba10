"""The operator's brain: one pure function from what it sees to what it does.

`decide(job, plan, observed, liveness, now, memory, settings)` returns the actions of one
reconcile pass (create or delete children, post Events, delete a finished job) and the job's
complete new status. It reads no clock, no cluster and no network, so every rule below is
pinned by the table-driven tests in tests/unit/test_operator_decisions.py.

The rules, in the order a pass applies them:

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
   succeeded no pod is restarted: the training loop has ended everywhere.
7. Faults: a trainer pod that failed, vanished or was deleted by someone else; a rank without a
   heartbeat for `heartbeatTimeoutSeconds + initialHeartbeatTimeoutSeconds` (ft_launcher had its
   chance to restart the workers inside the pod first); a job whose slowest step did not advance
   for `progressTimeoutSeconds`; the rendezvous pod lost. `RankRestart` replaces only the faulty
   pod (spending `rankRestartBudget`); when that budget is spent, when every pod is faulty, when
   the rendezvous is lost, or with `restartStrategy: FullRestart`, every pod is restarted
   (spending `fullRestartBudget`); when that is spent -> Failed (RestartBudgetExceeded).
8. Missing pods are created. The rendezvous pod is created only when no trainer pod is still
   terminating, and trainer pods only when the rendezvous pod is up or being created: a full
   restart therefore tears everything down before it starts again, with no extra state.

What the function must remember between passes lives in the status it returns (ranks, restart
counters, incidents with their times) and in `Memory` (the status it wrote last, which is fresher
than the object kopf hands the next pass, and when the job's step last advanced).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from rtj_operator import builders, naming
from rtj_operator.api.models import (
    MAX_INCIDENTS,
    Condition,
    Incident,
    RankStatus,
    ResilientTrainingJob,
    ResilientTrainingJobStatus,
    RestartCounts,
    parse_status,
)
from rtj_operator.config import OperatorSettings
from rtj_operator.podplan import PodPlan
from rtj_operator.views import NodeLiveness, Observed, PodView, RankLiveness

Manifest = dict[str, Any]

NO_RESTART_EXIT_CODE = 93
"""ft_launcher's `--ft-no-restart-exit-code`: NVRx decided the job must not be restarted."""

CONDITION_TYPES = ("Ready", "Running", "Recovering", "Suspended", "Succeeded", "Failed")

# Rank states shown in status.ranks[].state.
RANK_PENDING = "Pending"
RANK_STARTING = "Starting"
RANK_RUNNING = "Running"
RANK_RESTARTING = "Restarting"
RANK_SUCCEEDED = "Succeeded"
RANK_FAILED = "Failed"
RANK_SUSPENDED = "Suspended"

# Incident causes.
CAUSE_POD_FAILED = "PodFailed"
CAUSE_POD_VANISHED = "PodVanished"
CAUSE_POD_DELETED = "PodDeleted"
CAUSE_HEARTBEAT_TIMEOUT = "HeartbeatTimeout"
CAUSE_PROGRESS_TIMEOUT = "ProgressTimeout"
CAUSE_RENDEZVOUS_LOST = "RendezvousLost"
CAUSE_WORKER_RESTART = "WorkerRestart"

# Recovery actions (incidents[].action).
ACTION_RANK_RESTART = "RankRestart"
ACTION_FULL_RESTART = "FullRestart"
ACTION_LAUNCHER_RESTART = "LauncherRestart"
ACTION_IN_PROCESS_RESTART = "InProcessRestart"
ACTION_FAIL = "Fail"

# Reasons of the state (status.reason and the conditions).
REASON_CREATING = "CreatingPods"
REASON_STARTING = "WaitingForHeartbeats"
REASON_RUNNING = "AllRanksHeartbeating"
REASON_SUSPENDED = "Suspended"
REASON_COMPLETED = "Completed"
REASON_DEADLINE = "DeadlineExceeded"
REASON_NON_RETRYABLE = "NonRetryableExitCode"
REASON_BUDGET = "RestartBudgetExceeded"
REASON_PARTIAL = "PartialCompletion"
REASON_INVALID = "InvalidSpec"


# --- actions ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CreateObject:
    """Create a child object (Pod, Service, PersistentVolumeClaim); an existing one is kept."""

    manifest: Manifest

    @property
    def kind(self) -> str:
        return str(self.manifest["kind"])

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


@dataclass(frozen=True)
class DeletePod:
    """Delete a pod, but only the incarnation with this UID (never its replacement)."""

    name: str
    uid: str


@dataclass(frozen=True)
class SetClaimOwner:
    """Make the job own the claim (`owner` set) or release it (`owner` None, Retain)."""

    name: str
    owner: Manifest | None


@dataclass(frozen=True)
class DeleteJob:
    """Delete the job itself (ttlSecondsAfterFinished)."""


@dataclass(frozen=True)
class PostEvent:
    """A Kubernetes Event on the job: one for every decision."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str


Action = CreateObject | DeletePod | SetClaimOwner | DeleteJob | PostEvent


@dataclass(frozen=True)
class Memory:
    """What a pass hands to the next one besides the status on the object."""

    status: dict[str, Any] | None = None
    """The status the previous pass decided (the object's may lag behind by a watch event)."""
    progress_step: int | None = None
    """The job's step (slowest rank) when last seen advancing."""
    progress_since: datetime | None = None
    """When the job's step last advanced."""


@dataclass(frozen=True)
class Decision:
    """What one pass does and the status it writes."""

    actions: list[Action]
    status: dict[str, Any]
    memory: Memory

    def of_type(self, kind: type) -> list[Any]:
        """The actions of one type, in order (handy for tests and metrics)."""
        return [a for a in self.actions if isinstance(a, kind)]


@dataclass(frozen=True)
class Fault:
    """One fault found in this pass."""

    cause: str
    node_index: int | None
    detected: datetime
    message: str
    whole_job: bool = False
    """Only a restart of every pod can fix it (the rendezvous is lost, every pod failed)."""


# --- helpers ----------------------------------------------------------------------------------


def _iso(moment: datetime) -> str:
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _from_unix(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def _permanent_exit_codes(job: ResilientTrainingJob) -> set[int]:
    return {NO_RESTART_EXIT_CODE, *job.spec.fault_tolerance.non_retryable_exit_codes}


def _restarts_within(incidents: Sequence[Incident], action: str, since: datetime) -> int:
    """How many restarts of a kind the job spent since `since` (the budget window)."""
    return sum(
        1 for i in incidents
        if i.action == action and i.acted_time is not None and i.acted_time >= since
    )


class _Pass:
    """The working state of one call to `decide`: what it has seen and decided so far."""

    def __init__(
        self,
        *,
        job: ResilientTrainingJob,
        plan: PodPlan,
        observed: Observed,
        liveness: RankLiveness,
        now: datetime,
        memory: Memory,
        settings: OperatorSettings,
    ) -> None:
        self.job = job
        self.spec = job.spec
        self.plan = plan
        self.observed = observed
        self.liveness = liveness
        self.now = now
        self.memory = memory
        self.settings = settings
        previous = memory.status if memory.status is not None else {}
        if memory.status is None and job.status is not None:
            self.prev = job.status
        else:
            self.prev = parse_status(previous)
        self.actions: list[Action] = []
        self.events: list[PostEvent] = []
        self.incidents: list[Incident] = list(self.prev.incidents)
        self.prev_ranks = {r.node_index: r for r in self.prev.ranks}
        self.ranks: dict[int, RankStatus] = {}
        prev_restarts = self.prev.restarts or RestartCounts()
        self.restarts = prev_restarts.model_copy()
        self.rendezvous_being_created = False
        self.progress_step = memory.progress_step
        self.progress_since = memory.progress_since

    # -- recording ---------------------------------------------------------------------------

    def event(self, kind: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.events.append(PostEvent(kind, reason, message))

    def create(self, manifest: Manifest, why: str) -> None:
        self.actions.append(CreateObject(manifest))
        self.event(
            "Normal", "Created",
            f"Created {manifest['kind']} {manifest['metadata']['name']}: {why}",
        )

    def delete_pod(self, pod: PodView, why: str) -> None:
        if pod.deleting:
            return
        self.actions.append(DeletePod(pod.name, pod.uid))
        self.event("Normal", "DeletedPod", f"Deleted pod {pod.name}: {why}")

    def add_incident(self, fault: Fault, action: str, message: str | None = None) -> None:
        self.incidents.append(
            Incident(
                cause=fault.cause,
                node_index=fault.node_index,
                detected_time=fault.detected,
                acted_time=self.now,
                action=action,
                message=(message or fault.message)[:1024],
            )
        )

    # -- ranks -------------------------------------------------------------------------------

    def rank(self, index: int, **changes: Any) -> RankStatus:
        """Set fields of ranks[index] (starting from what the previous pass wrote)."""
        current = self.ranks.get(index) or self.prev_ranks.get(index) or RankStatus(
            node_index=index, restarts=0
        )
        updated = current.model_copy(update=changes)
        self.ranks[index] = updated
        return updated

    def rank_state(self, index: int) -> str | None:
        current = self.ranks.get(index) or self.prev_ranks.get(index)
        return current.state if current is not None else None

    def next_attempt(self, index: int) -> int:
        current = self.ranks.get(index) or self.prev_ranks.get(index)
        if current is None or current.attempt is None:
            return 0
        return current.attempt + 1


# --- the decision -----------------------------------------------------------------------------


def decide(
    *,
    job: ResilientTrainingJob,
    plan: PodPlan,
    observed: Observed,
    liveness: RankLiveness,
    now: datetime,
    memory: Memory,
    settings: OperatorSettings,
) -> Decision:
    """The actions of one reconcile pass and the job's new status (see the module docstring)."""
    p = _Pass(job=job, plan=plan, observed=observed, liveness=liveness, now=now, memory=memory,
              settings=settings)
    if p.prev.state in ("Succeeded", "Failed"):
        return _finished(p)
    _ensure_services_and_claim(p)
    if p.spec.suspend:
        return _suspended(p)
    start_time = p.prev.start_time or now

    deadline = p.spec.active_deadline_seconds
    if deadline is not None and now >= start_time + timedelta(seconds=deadline):
        return _fail(p, REASON_DEADLINE,
                     f"the job ran longer than activeDeadlineSeconds={deadline}", start_time)

    permanent = _permanent_exit_codes(job)
    for index, pod in sorted(observed.trainer_pods.items()):
        if pod.phase == "Failed" and pod.exit_code in permanent:
            return _fail(
                p, REASON_NON_RETRYABLE,
                f"pod {pod.name} exited with code {pod.exit_code}, which is not retryable",
                start_time, failed_index=index,
            )

    finished = _completion(p, start_time)
    if finished is not None:
        return finished

    _observe_ranks(p)
    faults = _find_faults(p)
    if faults:
        outcome = _recover(p, faults, start_time)
        if outcome is not None:
            return outcome
    _create_missing(p)
    return _running_status(p, start_time)


# --- rule 1: finished ---------------------------------------------------------------------------


def _finished(p: _Pass) -> Decision:
    """A finished job: stop whatever still runs, keep the record, honour the TTL."""
    for pod in p.observed.trainer_pods.values():
        if not pod.terminated:
            p.delete_pod(pod, f"the job is {p.prev.state}")
    if p.observed.rendezvous_pod is not None:
        p.delete_pod(p.observed.rendezvous_pod, f"the job is {p.prev.state}")
    ttl = p.spec.ttl_seconds_after_finished
    completion = p.prev.completion_time
    if ttl is not None and completion is not None and p.now >= completion + timedelta(seconds=ttl):
        p.actions.append(DeleteJob())
        p.event("Normal", "Deleted",
                f"Deleting the job: ttlSecondsAfterFinished={ttl} passed since it finished")
    return _decision(p, p.prev.model_dump(by_alias=True, exclude_none=True, mode="json"))


# --- rule 2: services and claim -----------------------------------------------------------------


def _ensure_services_and_claim(p: _Pass) -> None:
    if not p.observed.headless_service:
        p.create(builders.headless_service(p.job, settings=p.settings),
                 "DNS names for the trainer pods")
    if not p.observed.rendezvous_service:
        p.create(builders.rendezvous_service(p.job, settings=p.settings),
                 "the rendezvous endpoint of ft_launcher")
    checkpoint = p.spec.checkpoint
    if not checkpoint.is_dynamic:
        return
    claim = p.observed.claim
    if claim is None:
        p.create(builders.checkpoint_claim(p.job),
                 f"ReadWriteMany checkpoint volume of StorageClass {checkpoint.storage_class_name}")
        return
    should_own = checkpoint.effective_claim_delete_policy == "Delete"
    if claim.owned_by_job != should_own:
        p.actions.append(
            SetClaimOwner(claim.name, builders.owner_reference(p.job) if should_own else None)
        )
        p.event("Normal", "ClaimDeletePolicy",
                f"Claim {claim.name} is {'owned by' if should_own else 'released from'} the job "
                f"(claimDeletePolicy {checkpoint.effective_claim_delete_policy})")


# --- rule 3: suspend ----------------------------------------------------------------------------


def _suspended(p: _Pass) -> Decision:
    pods = [*p.observed.trainer_pods.values()]
    if p.observed.rendezvous_pod is not None:
        pods.append(p.observed.rendezvous_pod)
    for pod in pods:
        p.delete_pod(pod, "the job is suspended")
    for index in range(p.spec.nodes):
        trainer = p.observed.trainer_pods.get(index)
        p.rank(index, state=RANK_SUSPENDED, pod=trainer.name if trainer else None,
               node=trainer.node_name if trainer else None)
    gone = not pods
    message = ("every pod is deleted; the checkpoints are kept" if gone
               else "deleting the pods; the checkpoints are kept")
    if p.prev.state != "Suspended":
        p.event("Normal", "Suspended", f"Suspended: {message}")
    status = _status(
        p, state="Suspended", reason=REASON_SUSPENDED, message=f"The job is suspended: {message}",
        conditions={"Suspended": True}, start_time=None, ready_nodes=0,
    )
    # Like a Job, the deadline clock stops while suspended: startTime is set again on resume.
    status["startTime"] = None
    return _decision(p, status)


# --- rules 4 and 5: fail ------------------------------------------------------------------------


def _fail(
    p: _Pass, reason: str, message: str, start_time: datetime, failed_index: int | None = None
) -> Decision:
    for index, pod in p.observed.trainer_pods.items():
        if not pod.terminated:
            p.delete_pod(pod, "the job failed")
        p.rank(index, pod=pod.name, node=pod.node_name, attempt=pod.attempt,
               state=RANK_FAILED if index == failed_index or pod.phase == "Failed" else
               (RANK_SUCCEEDED if pod.phase == "Succeeded" else RANK_FAILED))
    if p.observed.rendezvous_pod is not None:
        p.delete_pod(p.observed.rendezvous_pod, "the job failed")
    p.event("Warning", reason, f"Failed: {message}")
    status = _status(
        p, state="Failed", reason=reason, message=f"The job failed: {message}",
        conditions={"Failed": True}, start_time=start_time, ready_nodes=0,
    )
    status["completionTime"] = _iso(p.now)
    return _decision(p, status)


# --- rule 6: completion -------------------------------------------------------------------------


def _completion(p: _Pass, start_time: datetime) -> Decision | None:
    """Succeeded when every trainer pod exited 0; no restarts once one has."""
    pods = p.observed.trainer_pods
    succeeded = [i for i, pod in pods.items() if pod.phase == "Succeeded"]
    if not succeeded:
        return None
    if len(succeeded) == p.spec.nodes:
        for index, pod in pods.items():
            p.rank(index, pod=pod.name, node=pod.node_name, attempt=pod.attempt,
                   state=RANK_SUCCEEDED)
        if p.observed.rendezvous_pod is not None:
            p.delete_pod(p.observed.rendezvous_pod, "training finished")
        p.event("Normal", REASON_COMPLETED, "Succeeded: every trainer pod exited 0")
        _recover_incidents(p)
        status = _status(
            p, state="Succeeded", reason=REASON_COMPLETED,
            message="Every trainer pod exited 0.",
            conditions={"Succeeded": True, "Ready": True}, start_time=start_time,
            ready_nodes=p.spec.nodes,
        )
        status["completionTime"] = _iso(p.now)
        # The trainers are gone, so the last scrape may predate the final steps; the final
        # checkpoint (written at the last step) is the best evidence of where training ended.
        checkpoint_step = (status.get("lastCheckpoint") or {}).get("step")
        if checkpoint_step is not None and checkpoint_step > status.get("step", -1):
            status["step"] = checkpoint_step
        return _decision(p, status)
    still_running = [pod for pod in pods.values() if not pod.terminated]
    if len(pods) < p.spec.nodes:
        return _fail(p, REASON_PARTIAL,
                     "some trainer pods succeeded but another one is gone", start_time)
    if not still_running:
        failed = sorted(pod.name for pod in pods.values() if pod.phase == "Failed")
        return _fail(
            p, REASON_PARTIAL,
            f"some trainer pods succeeded but {', '.join(failed)} failed", start_time,
        )
    return None


# --- rule 7: faults -----------------------------------------------------------------------------


def _node_heartbeat(p: _Pass, index: int) -> datetime | None:
    """The node's newest known heartbeat: scraped now, else what status remembers."""
    node = p.liveness.get(index)
    pod = p.observed.trainer_pods.get(index)
    if node is not None and pod is not None and node.pod_uid == pod.uid:
        beat = node.heartbeat
        if beat is not None:
            return _from_unix(beat)
    previous = p.prev_ranks.get(index)
    if previous is not None and pod is not None and previous.attempt == pod.attempt:
        return previous.last_heartbeat_time
    return None


def _node_liveness(p: _Pass, index: int) -> NodeLiveness | None:
    node = p.liveness.get(index)
    pod = p.observed.trainer_pods.get(index)
    if node is None or pod is None or node.pod_uid != pod.uid:
        return None
    return node


def _clock_start(p: _Pass) -> datetime | None:
    """When every trainer pod was last (re)started or the last recovery began: the reference
    from which heartbeat and progress timeouts count. None while some pod is not running."""
    pods = p.observed.trainer_pods
    if len(pods) < p.spec.nodes or any(
        pod.phase != "Running" or pod.deleting for pod in pods.values()
    ):
        return None
    rendezvous = p.observed.rendezvous_pod
    if rendezvous is None or rendezvous.phase != "Running" or rendezvous.deleting:
        return None
    starts = [pod.started_at for pod in pods.values() if pod.started_at is not None]
    acted = [i.acted_time for i in p.incidents if i.acted_time is not None]
    moments = starts + acted
    return max(moments) if moments else None


def _observe_ranks(p: _Pass) -> None:
    """Fill ranks[] from the pods and the scraped metrics."""
    for index in range(p.spec.nodes):
        pod = p.observed.trainer_pods.get(index)
        if pod is None:
            p.rank(index, pod=None, node=None)
            continue
        node = _node_liveness(p, index)
        beat = _node_heartbeat(p, index)
        step = node.step if node is not None else None
        previous = p.prev_ranks.get(index)
        if step is None and previous is not None and previous.attempt == pod.attempt:
            step = previous.step
        state = {"Pending": RANK_PENDING, "Succeeded": RANK_SUCCEEDED,
                 "Failed": RANK_FAILED}.get(pod.phase, RANK_STARTING)
        if pod.deleting:
            state = RANK_RESTARTING
        p.rank(index, pod=pod.name, node=pod.node_name, attempt=pod.attempt,
               last_heartbeat_time=beat, step=step, state=state)
    clock = _clock_start(p)
    if clock is None:
        return
    for index in range(p.spec.nodes):
        beat = p.ranks[index].last_heartbeat_time
        if beat is not None and beat >= clock and _fresh(p, beat):
            p.rank(index, state=RANK_RUNNING)


def _fresh(p: _Pass, beat: datetime) -> bool:
    return p.now - beat <= timedelta(seconds=p.spec.fault_tolerance.heartbeat_timeout_seconds)


def _find_faults(p: _Pass) -> list[Fault]:
    faults: list[Fault] = []
    pods = p.observed.trainer_pods
    for index in range(p.spec.nodes):
        pod = pods.get(index)
        state = (p.prev_ranks.get(index).state  # type: ignore[union-attr]
                 if index in p.prev_ranks else None)
        if pod is None:
            if state in (RANK_STARTING, RANK_RUNNING, RANK_PENDING):
                faults.append(Fault(CAUSE_POD_VANISHED, index, p.now,
                                    f"pod {naming.trainer_pod_name(p.job.name, index)} is gone"))
            continue
        if pod.deleting:
            if state not in (RANK_RESTARTING, RANK_SUSPENDED, None):
                faults.append(Fault(CAUSE_POD_DELETED, index, p.now,
                                    f"pod {pod.name} was deleted by someone else"))
            continue
        if pod.phase == "Failed":
            why = f"exit code {pod.exit_code}" if pod.exit_code is not None else (
                pod.reason or "unknown reason")
            faults.append(Fault(CAUSE_POD_FAILED, index, pod.finished_at or p.now,
                                f"pod {pod.name} failed ({why})"))
    rendezvous = p.observed.rendezvous_pod
    live_trainers = [pod for pod in pods.values() if not pod.deleting]
    if live_trainers and (
        rendezvous is None or rendezvous.deleting or rendezvous.terminated
    ):
        # The store and the rounds are gone: every launcher fails; restart everything.
        detail = "is gone" if rendezvous is None else (
            "is being deleted" if rendezvous.deleting else f"ended ({rendezvous.phase})")
        faults.append(Fault(CAUSE_RENDEZVOUS_LOST, None, p.now,
                            f"rendezvous pod {naming.rendezvous_name(p.job.name)} {detail}",
                            whole_job=True))
    if not faults:
        faults.extend(_liveness_faults(p))
    return faults


def _liveness_faults(p: _Pass) -> list[Fault]:
    """Hangs: no heartbeat, or no progress although every rank sends heartbeats."""
    clock = _clock_start(p)
    if clock is None:
        p.progress_step, p.progress_since = None, None
        return []
    ft = p.spec.fault_tolerance
    hang_after = timedelta(
        seconds=ft.heartbeat_timeout_seconds + ft.initial_heartbeat_timeout_seconds
    )
    faults: list[Fault] = []
    for index in range(p.spec.nodes):
        beat = p.ranks[index].last_heartbeat_time
        evidence = beat if beat is not None and beat >= clock else clock
        if p.now - evidence > hang_after:
            seen = f"since {_iso(beat)}" if beat is not None and beat >= clock else (
                f"since the pods started at {_iso(clock)}")
            faults.append(Fault(
                CAUSE_HEARTBEAT_TIMEOUT, index, p.now,
                f"no heartbeat from pod {naming.trainer_pod_name(p.job.name, index)} {seen} "
                f"(heartbeatTimeoutSeconds + initialHeartbeatTimeoutSeconds = "
                f"{int(hang_after.total_seconds())} s)",
            ))
    if faults:
        return faults

    steps = {i: p.ranks[i].step for i in range(p.spec.nodes)}
    nodes = [_node_liveness(p, i) for i in range(p.spec.nodes)]
    if any(n is None or n.step is None for n in nodes):
        return []
    job_step = min(s for s in steps.values() if s is not None)
    if p.progress_step is None or job_step > p.progress_step or p.progress_since is None:
        p.progress_step, p.progress_since = job_step, p.now
        return []
    all_beating = all(
        (b := p.ranks[i].last_heartbeat_time) is not None and b >= clock and _fresh(p, b)
        for i in range(p.spec.nodes)
    )
    stalled_since = max(p.progress_since, clock)
    if not all_beating or p.now - stalled_since <= timedelta(seconds=ft.progress_timeout_seconds):
        return []
    slowest = min(steps, key=lambda i: steps[i] or 0)
    laggard = (steps[slowest] or 0) < max(s or 0 for s in steps.values())
    message = (f"step {job_step} has not advanced since {_iso(p.progress_since)} "
               f"(progressTimeoutSeconds={ft.progress_timeout_seconds})")
    p.progress_step, p.progress_since = None, None
    if laggard:
        return [Fault(CAUSE_PROGRESS_TIMEOUT, slowest, p.now, message)]
    return [Fault(CAUSE_PROGRESS_TIMEOUT, None, p.now, message, whole_job=True)]


def _recover(p: _Pass, faults: list[Fault], start_time: datetime) -> Decision | None:
    """Spend the cheapest budget that can fix the faults, or fail the job."""
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
        spent = _restarts_within(p.incidents, ACTION_RANK_RESTART, window_start)
        if spent + len(faults) <= budget.max:
            for fault in faults:
                _restart_rank(p, fault)
            return None
        p.event("Warning", "RankRestartBudgetSpent",
                f"rankRestartBudget ({budget.max} per {budget.window_seconds} s) is spent: "
                "restarting every pod")
    budget_full = ft.full_restart_budget
    window_start = p.now - timedelta(seconds=budget_full.window_seconds)
    spent_full = _restarts_within(p.incidents, ACTION_FULL_RESTART, window_start)
    first = faults[0]
    summary = "; ".join(f.message for f in faults)
    if spent_full >= budget_full.max:
        p.add_incident(first, ACTION_FAIL, summary)
        return _fail(
            p, REASON_BUDGET,
            f"fullRestartBudget ({budget_full.max} per {budget_full.window_seconds} s) is spent; "
            f"last fault: {summary}",
            start_time,
        )
    _restart_everything(p, first, summary)
    return None


def _restart_rank(p: _Pass, fault: Fault) -> None:
    assert fault.node_index is not None
    index = fault.node_index
    pod = p.observed.trainer_pods.get(index)
    p.add_incident(fault, ACTION_RANK_RESTART)
    p.restarts.rank += 1
    previous = p.ranks.get(index) or p.prev_ranks.get(index)
    p.rank(index, state=RANK_RESTARTING, restarts=((previous.restarts or 0) if previous else 0) + 1)
    p.event("Warning", ACTION_RANK_RESTART,
            f"Replacing the pod of node {index} ({fault.cause}): {fault.message}")
    if pod is not None:
        p.delete_pod(pod, f"{fault.cause}: replacing it")


def _restart_everything(p: _Pass, fault: Fault, summary: str) -> None:
    p.add_incident(fault, ACTION_FULL_RESTART, summary)
    p.restarts.full += 1
    p.event("Warning", ACTION_FULL_RESTART, f"Restarting every pod ({fault.cause}): {summary}")
    for index in range(p.spec.nodes):
        previous = p.ranks.get(index) or p.prev_ranks.get(index)
        p.rank(index, state=RANK_RESTARTING,
               restarts=((previous.restarts or 0) if previous else 0) + 1)
        pod = p.observed.trainer_pods.get(index)
        if pod is not None:
            p.delete_pod(pod, f"full restart ({fault.cause})")
    if p.observed.rendezvous_pod is not None:
        p.delete_pod(p.observed.rendezvous_pod, f"full restart ({fault.cause})")


# --- rule 8: create -----------------------------------------------------------------------------


def _create_missing(p: _Pass) -> None:
    pods = p.observed.trainer_pods
    rendezvous = p.observed.rendezvous_pod
    restarting_all = any(isinstance(a, DeletePod) and a.name == naming.rendezvous_name(p.job.name)
                         for a in p.actions)
    terminating = any(pod.deleting for pod in pods.values()) or any(
        isinstance(a, DeletePod) for a in p.actions
    )
    if rendezvous is None and not terminating:
        p.create(builders.rendezvous_pod(p.job, plan=p.plan, settings=p.settings),
                 "nvrx-control hosts the rendezvous store")
        p.rendezvous_being_created = True
    rendezvous_up = p.rendezvous_being_created or (
        rendezvous is not None and not rendezvous.deleting and not rendezvous.terminated
        and not restarting_all
    )
    if not rendezvous_up:
        return
    for index in range(p.spec.nodes):
        if index in pods:
            continue
        attempt = p.next_attempt(index)
        p.create(
            builders.trainer_pod(p.job, plan=p.plan, node_index=index, attempt=attempt,
                                 settings=p.settings),
            f"trainer for node {index}, attempt {attempt}",
        )
        p.rank(index, state=RANK_PENDING, attempt=attempt,
               pod=naming.trainer_pod_name(p.job.name, index), node=None, step=None,
               last_heartbeat_time=None)


# --- status -------------------------------------------------------------------------------------


OPERATOR_ACTIONS = (ACTION_RANK_RESTART, ACTION_FULL_RESTART)
"""Recoveries the operator runs itself; it times them from detection to recovery. Restarts
inside the pods (ft_launcher, in-process) are only seen afterwards, in the trainers' counters."""


def _is_open(incident: Incident) -> bool:
    return incident.recovered_time is None and incident.action in OPERATOR_ACTIONS


def _recover_incidents(p: _Pass) -> None:
    """Close the incidents that are still open: training makes progress again."""
    for n, incident in enumerate(p.incidents):
        if _is_open(incident):
            seconds = max(0.0, (p.now - incident.detected_time).total_seconds())
            p.incidents[n] = incident.model_copy(
                update={"recovered_time": p.now, "seconds": round(seconds, 1)}
            )


def _worker_restart_incidents(p: _Pass) -> None:
    """Restarts that happened inside the pods (ft_launcher, NVRx in-process), seen through the
    trainers' `rtj_trainer_restarts_total{kind}` counters."""
    seen: dict[str, int] = {}
    for node in p.liveness.values():
        for sample in node.samples:
            for kind, count in sample.restarts.items():
                seen[kind] = max(seen.get(kind, 0), int(count))
    for kind, action, attribute in (
        ("launcher", ACTION_LAUNCHER_RESTART, "launcher"),
        ("inprocess", ACTION_IN_PROCESS_RESTART, "in_process"),
    ):
        before = getattr(p.restarts, attribute)
        after = seen.get(kind, before)
        if after > before:
            setattr(p.restarts, attribute, after)
            fault = Fault(CAUSE_WORKER_RESTART, None, p.now,
                          f"{after - before} {kind} restart(s) of the workers inside the pods")
            p.add_incident(fault, action)
            p.event("Normal", action, f"The trainers report {fault.message}")


def _running_status(p: _Pass, start_time: datetime) -> Decision:
    _worker_restart_incidents(p)
    ready = sum(1 for i in range(p.spec.nodes) if p.ranks[i].state == RANK_RUNNING)
    all_ready = ready == p.spec.nodes
    recovering = any(_is_open(i) for i in p.incidents)
    if all_ready:
        _recover_incidents(p)
        recovering = False
    if all_ready:
        state, reason, message = "Running", REASON_RUNNING, "Every rank sends heartbeats."
    elif recovering:
        open_incident = next(i for i in reversed(p.incidents) if _is_open(i))
        state, reason = "Recovering", open_incident.action or ACTION_RANK_RESTART
        message = f"Recovering from {open_incident.cause}: {open_incident.message}"
    elif all(p.ranks[i].state in (RANK_STARTING, RANK_RUNNING) for i in range(p.spec.nodes)):
        state, reason, message = "Pending", REASON_STARTING, "Waiting for every rank's heartbeat."
    else:
        state, reason, message = "Pending", REASON_CREATING, "Creating and starting the pods."
    if state != p.prev.state:
        p.event("Normal", state, message)
    status = _status(
        p, state=state, reason=reason, message=message,
        conditions={"Running": all_ready, "Ready": all_ready, "Recovering": recovering},
        start_time=start_time, ready_nodes=ready,
    )
    return _decision(p, status)


def _bounded(incidents: list[Incident]) -> list[Incident]:
    """The newest MAX_INCIDENTS incidents, dropping restarts inside the pods first: the
    operator's own restarts are what the restart budgets count."""
    kept = list(incidents)
    while len(kept) > MAX_INCIDENTS:
        in_pod = next((n for n, i in enumerate(kept) if i.action not in OPERATOR_ACTIONS), None)
        kept.pop(in_pod if in_pod is not None else 0)
    return kept


def _training_progress(p: _Pass) -> dict[str, Any]:
    """step, lastCheckpoint and goodput from the scraped metrics (kept when nothing answered)."""
    result: dict[str, Any] = {}
    steps = [p.ranks[i].step for i in range(p.spec.nodes) if i in p.ranks]
    if steps and all(s is not None for s in steps):
        result["step"] = min(s for s in steps if s is not None)
    elif p.prev.step is not None:
        result["step"] = p.prev.step
    best = p.prev.last_checkpoint
    best_step = best.step if best is not None else -1
    best_time = best.time if best is not None else None
    goodput: float | None = None
    for index, node in sorted(p.liveness.items()):
        for sample in node.samples:
            if sample.committed_step is not None and sample.committed_step > best_step:
                best_step = sample.committed_step
                best_time = (_from_unix(sample.committed_time)
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
        result["lastCheckpoint"] = {"step": best_step, **(
            {"time": _iso(best_time)} if best_time is not None else {})}
    if goodput is not None:
        result["goodput"] = f"{min(100.0, max(0.0, goodput * 100)):.1f}%"
    elif p.prev.goodput is not None:
        result["goodput"] = p.prev.goodput
    return result


def _conditions(
    p: _Pass, truths: dict[str, bool], reason: str, message: str
) -> list[dict[str, Any]]:
    """All six condition types; lastTransitionTime moves only when a status flips."""
    previous: dict[str, Condition] = {c.type: c for c in p.prev.conditions}
    result = []
    for kind in CONDITION_TYPES:
        status = "True" if truths.get(kind, False) else "False"
        before = previous.get(kind)
        moved = before is None or before.status != status
        condition = Condition(
            type=kind,  # type: ignore[arg-type]
            status=status,  # type: ignore[arg-type]
            observed_generation=p.job.metadata.generation,
            last_transition_time=p.now if moved or before is None else before.last_transition_time,
            reason=reason,
            message=message if status == "True" else "",
        )
        result.append(condition.to_api())
    return result


def _status(
    p: _Pass,
    *,
    state: str,
    reason: str,
    message: str,
    conditions: dict[str, bool],
    start_time: datetime | None,
    ready_nodes: int,
) -> dict[str, Any]:
    """The complete status of this pass (camelCase, as written to the API)."""
    for index in range(p.spec.nodes):
        p.rank(index)  # make sure every node index has an entry
    ranks = [p.ranks[i].to_api() for i in range(p.spec.nodes)]
    restarts = p.restarts.model_copy(update={
        "total": p.restarts.rank + p.restarts.full + p.restarts.launcher + p.restarts.in_process
    })
    status: dict[str, Any] = {
        "observedGeneration": p.job.metadata.generation,
        "conditions": _conditions(p, conditions, reason, message),
        "state": state,
        "reason": reason,
        "message": message[:32768],
        "nodesReady": ready_nodes,
        "nodesDesired": p.spec.nodes,
        "nodes": f"{ready_nodes}/{p.spec.nodes}",
        "restarts": restarts.to_api(),
        "ranks": ranks,
        "incidents": [i.to_api() for i in _bounded(p.incidents)],
        **_training_progress(p),
    }
    if start_time is not None:
        status["startTime"] = _iso(start_time)
    if p.prev.completion_time is not None:
        status["completionTime"] = _iso(p.prev.completion_time)
    return status


def _decision(p: _Pass, status: dict[str, Any]) -> Decision:
    memory = Memory(
        status={k: v for k, v in status.items() if v is not None},
        progress_step=p.progress_step,
        progress_since=p.progress_since,
    )
    return Decision(actions=[*p.actions, *p.events], status=status, memory=memory)


def invalid_spec_status(generation: int | None, message: str, now: datetime) -> dict[str, Any]:
    """Status of a job whose spec the operator cannot parse (the CRD normally prevents it)."""
    condition = Condition(
        type="Failed", status="True", observed_generation=generation,
        last_transition_time=now, reason=REASON_INVALID, message=message[:32768],
    )
    return {
        "observedGeneration": generation,
        "state": "Failed",
        "reason": REASON_INVALID,
        "message": message[:32768],
        "conditions": [condition.to_api()],
    }


def status_model(status: dict[str, Any]) -> ResilientTrainingJobStatus:
    """Parse a status this module wrote (used by tests to check it is valid for the API)."""
    return parse_status({k: v for k, v in status.items() if v is not None})
