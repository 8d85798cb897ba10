"""The working state of one decision: what it is made from (`Inputs`), what a pass has seen and
decided so far (`Pass`), what it hands to the next pass (`Memory`), what it returns (`Decision`)
and the faults it found.

Every rule module takes the one `Pass` of the call (`p`) and records into it; only `decide`
(in `__init__.py`) creates one.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

from rtj_operator.api.models import ResilientTrainingJob
from rtj_operator.api.status import (
    MAX_EXCLUDED_NODES,
    ExcludedNode,
    Incident,
    RankStatus,
    ResilientTrainingJobStatus,
    RestartCounts,
)
from rtj_operator.api.vocabulary import IncidentCause, RecoveryAction
from rtj_operator.config import OperatorSettings
from rtj_operator.intents import Action, CreateObject, DeletePod, Manifest, PostEvent
from rtj_operator.observed import Observed, PodView, RankLiveness
from rtj_operator.podplan import PodPlan


@dataclass(frozen=True)
class Memory:
    """What a pass hands to the next one besides the status on the object."""

    status: ResilientTrainingJobStatus | None = None
    """The status the previous pass decided (the object's may lag behind by a watch event)."""
    progress_step: int | None = None
    """The job's step (slowest rank) when last seen advancing."""
    progress_since: datetime | None = None
    """When the job's step last advanced."""
    unobserved_since: Mapping[str, datetime] = field(default_factory=dict)
    """Running trainer pods (by UID) whose liveness could not be read, since when (the
    `ObservationDegraded` condition)."""


@dataclass(frozen=True)
class Decision:
    """What one pass does, the Events that explain it and the status it writes."""

    actions: list[Action]
    """Changes to the cluster, in the order they are applied."""
    events: list[PostEvent]
    """One Event per decision, posted after the status is written."""
    status: ResilientTrainingJobStatus
    """The job's complete new status. A field set to None on purpose (startTime while
    suspended) is removed from the object; see `reconcile.api_status`."""
    incidents: list[Incident]
    """The incidents this pass opened (also in `status`): what the restart metric counts."""
    memory: Memory
    unresponsive: list[RankStatus] = field(default_factory=list)
    """The ranks that turned `Unresponsive` in this pass (a new `HeartbeatStale` episode)."""
    recheck: Mapping[int, datetime] = field(default_factory=dict)
    """Per node index, the next moment the pod's heartbeat verdict changes if its heartbeat
    stays where it is (turns Unresponsive, or hung): a read of that pod just after it decides
    (`hangs.heartbeat_deadlines`). Empty when no pod's heartbeat is being timed."""
    renewable: Mapping[int, float] = field(default_factory=dict)
    """The pods whose `recheck` deadline is only their heartbeat going stale (Running, timed
    from that heartbeat), with that heartbeat (Unix time): a read at the deadline that shows a
    newer, fresh heartbeat and nothing else new changes no verdict, and moves the deadline
    without a pass (`hangs.renewed_deadline`)."""

    def of_type(self, kind: type) -> list[Any]:
        """The actions of one type, in order (handy for tests)."""
        return [a for a in self.actions if isinstance(a, kind)]


@dataclass(frozen=True)
class DetectedFault:
    """One fault the operator found in this pass (not a fault injected into a trainer)."""

    cause: IncidentCause
    node_index: int | None
    detected: datetime
    message: str
    whole_job: bool = False
    """Only a restart of every pod can fix it (the rendezvous is lost, every pod failed)."""
    node: str | None = None
    """The Kubernetes node of the faulty pod, set only when the fault is evidence against the
    node (heartbeats stopped, node lost, never started there): new trainer pods avoid it."""


def iso(moment: datetime) -> str:
    """A time as status and messages show it: UTC, whole seconds."""
    return moment.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def whole_second(moment: datetime) -> datetime:
    """A time as status stores it (UTC, whole seconds: what `iso` shows)."""
    return moment.astimezone(UTC).replace(microsecond=0)


def from_unix(seconds: float) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


BUDGETED = (RecoveryAction.RANK_RESTART, RecoveryAction.FULL_RESTART)
"""The operator's restarts that budgets count (status.restartRecords)."""


def _records(status: ResilientTrainingJobStatus) -> dict[RecoveryAction, list[datetime]]:
    """The restart records of the previous status; a status written before records existed
    falls back to the restarts its incident list still holds."""
    if status.restart_records is not None:
        return {RecoveryAction.RANK_RESTART: list(status.restart_records.rank),
                RecoveryAction.FULL_RESTART: list(status.restart_records.full)}
    return {action: sorted(i.acted_time for i in status.incidents
                           if i.action == action and i.acted_time is not None)
            for action in BUDGETED}


@dataclass(frozen=True)
class Inputs:
    """What one decision is made from: `decide`'s arguments but the Kueue view (the job is the
    one the rules see: a job Kueue holds is seen suspended)."""

    job: ResilientTrainingJob
    plan: PodPlan
    observed: Observed
    liveness: RankLiveness
    now: datetime
    memory: Memory
    settings: OperatorSettings


class Pass:
    """The working state of one call to `decide`: what it has seen and decided so far."""

    def __init__(self, inputs: Inputs) -> None:
        job, plan, memory = inputs.job, inputs.plan, inputs.memory
        self.job = job
        self.spec = job.spec
        self.builtin_trainer = job.spec.runs_builtin_trainer
        """`spec.runs_builtin_trainer`, read once: the clocks ask it for every pod, several
        times a pass (a regular expression each: a fifth of a 5,000-pod pass)."""
        self.plan = plan
        self.observed = inputs.observed
        self.liveness = inputs.liveness
        self.now = inputs.now
        self.memory = memory
        self.settings = inputs.settings
        if memory.status is not None:
            self.prev = memory.status
        else:
            self.prev = job.status or ResilientTrainingJobStatus()
        self.actions: list[Action] = []
        self._deleted: set[str] = set()
        """The pods this pass deletes (`delete_pod`), by UID."""
        self.events: list[PostEvent] = []
        self.incidents: list[Incident] = list(self.prev.incidents)
        self.opened: list[Incident] = []
        self.prev_ranks = {r.node_index: r for r in self.prev.ranks}
        self.ranks: dict[int, RankStatus] = {}
        prev_restarts = self.prev.restarts or RestartCounts()
        self.restarts = prev_restarts.model_copy()
        self.rendezvous_being_created = False
        self.backoff_until: datetime | None = None
        """The pods of a full restart start again only then (recovery.full_restart_backoff)."""
        self.progress_step = memory.progress_step
        self.progress_since = memory.progress_since
        clock = self.prev.progress_clock
        if self.progress_since is None and clock is not None:  # the operator restarted
            self.progress_step, self.progress_since = clock.step, clock.since
        self.pods = plan.pods
        """Trainer pods: node indexes 0..pods-1 (`spec.nodes` plus the warm spares)."""
        self.waiting: set[int] = set(self.prev.spares.waiting) if self.prev.spares else set()
        """Replacement pods created after a takeover, waiting for the next launcher round."""
        self.records = _records(self.prev)
        """When the operator's budgeted restarts happened, per kind (status.restartRecords)."""
        self.standby: set[int] = set()
        """Pods whose ranks train nothing now: warm spares and `waiting` (hangs.py)."""
        self.lost: dict[str, str] = {}
        """Pods (by UID) on a lost node whose heartbeats stopped, with the node's name: their
        deletion is a force delete (podfaults.lost_pods)."""
        self.excluded: list[ExcludedNode] = list(self.prev.excluded_nodes or [])
        """Nodes new trainer pods avoid (status.excludedNodes)."""
        self.unobserved_since: dict[str, datetime] = {}
        """Running pods (by UID) that should send heartbeats but could not be observed, since
        when (hangs.observe_ranks); never evidence of a hang."""
        self.not_starting: list[tuple[str, str, str]] = []
        """Pods that do not start: (pod, reason, message), for the PodsNotStarting condition."""
        self.unresponsive: list[RankStatus] = []
        """Ranks that turned `Unresponsive` in this pass (hangs.mark_unresponsive)."""
        self.recheck: dict[int, datetime] = {}
        self.renewable: dict[int, float] = {}
        """`Decision.renewable` (hangs.heartbeat_deadlines)."""
        """When each pod's heartbeat verdict next changes (hangs.heartbeat_deadlines)."""
        self.beats_version = 0
        """How many times a rank's heartbeat was set in this pass (`rank`): part of
        `clock_key`."""
        self.shared_clock: tuple[Hashable, datetime | None] | None = None
        """`clocks.shared_clock` of this pass, with the `clock_key` it was computed for."""
        self.silence_memo: tuple[Hashable, Any] | None = None
        """`hangs.silence` of this pass, with the `clock_key` it was computed for."""

    def clock_key(self) -> Hashable:
        """What the clocks and the silence of a pass depend on that changes while it runs: the
        standby pods, the incidents (their acted times) and the ranks' heartbeats. Everything
        else they read (the pods, the reads, the spec) is fixed for the pass."""
        return frozenset(self.standby), len(self.incidents), self.beats_version

    def restarts_within(self, action: RecoveryAction, since: datetime) -> int:
        """How many restarts of a kind the job spent since `since` (the budget window)."""
        return sum(1 for at in self.records[action] if at >= since)

    def record_restart(self, action: RecoveryAction, keep: int) -> None:
        """Remember a budgeted restart; a budget of `keep` per window needs no more than the
        newest `keep` records."""
        self.records[action] = [*self.records[action], self.now][-max(keep, 1):]

    def active(self) -> list[int]:
        """The node indexes that train (every pod but the standby ones)."""
        return [i for i in range(self.pods) if i not in self.standby]

    def warm_spares(self) -> list[int]:
        """Standby pods whose ranks are up, waiting to take over (not the waiting ones)."""
        return sorted(i for i in self.standby if i not in self.waiting)

    # -- recording ---------------------------------------------------------------------------

    def event(self, kind: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.events.append(PostEvent(kind, reason, message))

    def create(self, manifest: Manifest, why: str) -> None:
        self.actions.append(CreateObject(manifest))
        self.event(
            "Normal", "Created",
            f"Created {manifest['kind']} {manifest['metadata']['name']}: {why}",
        )

    def delete_pod(self, pod: PodView, why: str, *, grace_seconds: int | None = None) -> None:
        """Delete a pod (once: one already deleting is left to finish), or force-delete it when
        its node is lost, deleting or not: its kubelet would never confirm the delete.
        `grace_seconds` overrides the pod's grace period (fault recovery)."""
        if pod.uid in self._deleted:
            return  # already decided in this pass
        self._deleted.add(pod.uid)
        node = self.lost.get(pod.uid)
        if node is not None:
            self.actions.append(DeletePod(pod.name, pod.uid, force=True))
            self.event("Warning", "ForceDeletedPod",
                       f"Force-deleted pod {pod.name} (its node {node} is lost): {why}")
            return
        if pod.deleting:
            return
        self.actions.append(DeletePod(pod.name, pod.uid, grace_seconds=grace_seconds))
        self.event("Normal", "DeletedPod", f"Deleted pod {pod.name}: {why}")

    def replace_ended_pod(self, pod: PodView, why: str, *, grace_seconds: int) -> None:
        """Delete a pod to replace it. One whose containers have all ended (`Failed`: nothing of
        it runs any more) goes at once (gracePeriodSeconds 0) instead of after a grace period;
        any other pod gets `grace_seconds`. The replacement is created by the next pass (the
        pod's deletion wakes the job's loop), never in this one: this pass's status write, with
        the incident and the budget record, comes first, so an operator killed in between
        finds the pod missing and records the fault again instead of a replacement whose cause
        is lost."""
        if pod.phase != "Failed" or pod.deleting or pod.node_index is None \
                or pod.uid in self.lost:
            self.delete_pod(pod, why, grace_seconds=grace_seconds)
            return
        if pod.uid in self._deleted:
            return
        self._deleted.add(pod.uid)
        self.actions.append(DeletePod(pod.name, pod.uid, force=True))
        self.event("Normal", "DeletedPod",
                   f"Deleted pod {pod.name} at once (its containers have ended): {why}")

    def exclude_node(self, fault: DetectedFault) -> None:
        """New trainer pods avoid the node of this fault (status.excludedNodes); a node already
        excluded moves to the end with the new evidence."""
        if fault.node is None:
            return
        kept = [n for n in self.excluded if n.node != fault.node]
        entry = ExcludedNode(node=fault.node, reason=fault.cause, since=whole_second(self.now),
                             node_index=fault.node_index, message=fault.message[:1024])
        self.excluded = [*kept, entry][-MAX_EXCLUDED_NODES:]
        self.event("Warning", "NodeExcluded",
                   f"New trainer pods avoid node {fault.node} ({fault.cause}): {fault.message}")

    def add_incident(
        self, fault: DetectedFault, action: RecoveryAction, message: str | None = None
    ) -> None:
        incident = Incident(
            cause=fault.cause,
            node_index=fault.node_index,
            detected_time=fault.detected,
            acted_time=self.now,
            action=action,
            message=(message or fault.message)[:1024],
        )
        self.incidents.append(incident)
        self.opened.append(incident)

    # -- ranks -------------------------------------------------------------------------------

    def rank(self, index: int, **changes: Any) -> RankStatus:
        """Set fields of ranks[index] (starting from what the previous pass wrote)."""
        current = self.ranks.get(index) or self.prev_ranks.get(index) or RankStatus(
            node_index=index, restarts=0
        )
        updated = current.model_copy(update=changes)
        if "last_heartbeat_time" in changes:
            self.beats_version += 1
        self.ranks[index] = updated
        return updated

    def next_attempt(self, index: int) -> int:
        current = self.ranks.get(index) or self.prev_ranks.get(index)
        if current is None or current.attempt is None:
            return 0
        return current.attempt + 1


def some(names: Sequence[str], shown: int = 5, *, sep: str = ", ", last: str = " and ") -> str:
    """`a, b, c, d, e and 3 more`: a list of pods (or faults) in a message, bounded; clauses
    that hold commas themselves take `sep="; ", last="; and "`."""
    head = sep.join(names[:shown])
    return head + (f"{last}{len(names) - shown} more" if len(names) > shown else "")
