"""What the operator sees of a job, as plain frozen records.

`observe` builds `Observed` from the job's children in the API server, `scraping` builds
`RankLiveness` from the trainers' metrics endpoints, and `decisions.decide` reads only these
records, never the Kubernetes client: that is what lets the decision table be unit-tested without
a cluster. They hold observations only; what they mean (the oldest heartbeat of a pod, the step
all its ranks completed) is decided in `decisions/hangs.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime

from rtj_wire.termination import TerminationMessage

VOLUNTARY_DISRUPTIONS = frozenset({"EvictionByEvictionAPI", "PreemptionByScheduler"})
"""`DisruptionTarget` reasons of a voluntary disruption: someone asked for the pod's place (a
node drain, a descheduler, a higher-priority pod). The others (`DeletionByTaintManager`,
`TerminationByKubelet`, `DeletionByPodGC`) follow a fault of the node."""


@dataclass(frozen=True, kw_only=True)
class PodView:
    """The parts of a pod the decisions need."""

    name: str
    uid: str
    role: str
    node_index: int | None = None
    attempt: int | None = None
    spec_hash: str | None = None
    """The `pod_spec_hash` of the spec the pod was built from (None: a pod of an operator
    version that did not stamp it)."""
    phase: str = "Pending"
    """Pending, Running, Succeeded, Failed or Unknown."""
    deleting: bool = False
    """The pod has a deletionTimestamp: it is going away and its name is still taken."""
    exit_code: int | None = None
    """Exit code of the main container once it terminated."""
    reason: str | None = None
    """Why the pod or its container ended (for example `Evicted`, `Error`, `OOMKilled`)."""
    started_at: datetime | None = None
    finished_at: datetime | None = None
    node_name: str | None = None
    pod_ip: str | None = None
    outcome: TerminationMessage | None = None
    """The trainer's termination message (`rtj_wire.termination`), once it has one."""
    outcome_problem: str | None = None
    """Why a termination message was there but ignored (not the trainer's format)."""
    created_at: datetime | None = None
    """metadata.creationTimestamp: the pod start deadline counts from it."""
    unscheduled_reason: str | None = None
    """The PodScheduled condition is False: the scheduler's reason (`Unschedulable`)."""
    unscheduled_message: str | None = None
    """...and its message (`0/3 nodes are available: ...`)."""
    waiting_reason: str | None = None
    """The main container waits: the kubelet's reason (`ImagePullBackOff`, `ContainerCreating`)."""
    waiting_message: str | None = None
    node_ready: str | None = None
    """The Ready condition of the pod's node (`True`, `False`, `Unknown`); None when the node is
    not known (not scheduled, or the operator cannot read nodes)."""
    node_unreachable: bool = False
    """The pod's node carries the `node.kubernetes.io/unreachable` or
    `node.kubernetes.io/not-ready` taint (the node controller's mark of a lost node)."""
    disruption: str | None = None
    """The reason of the pod's `DisruptionTarget` condition when it is True: why Kubernetes is
    ending the pod (`EvictionByEvictionAPI`: a drain's eviction; `PreemptionByScheduler`;
    `DeletionByTaintManager`; `TerminationByKubelet`; `DeletionByPodGC`)."""

    @property
    def terminated(self) -> bool:
        return self.phase in ("Succeeded", "Failed")

    @property
    def completed_training(self) -> bool:
        """Exited 0 at the end of training: not a trainer that was asked to stop and
        checkpointed first (that exits 0 too)."""
        return self.phase == "Succeeded" and not (self.outcome is not None
                                                  and self.outcome.stopped)

    @property
    def node_lost(self) -> bool:
        """The pod's node is lost: not Ready (False or Unknown) and tainted by the node
        controller. Its kubelet can no longer finish a graceful delete."""
        return self.node_ready in ("False", "Unknown") and self.node_unreachable

    @property
    def voluntarily_disrupted(self) -> bool:
        """Ended by a voluntary disruption (the eviction API, as a drain uses it, or the
        scheduler's preemption), not by a fault of the pod or its node."""
        return self.disruption in VOLUNTARY_DISRUPTIONS

    @property
    def start_problem(self) -> tuple[str, str] | None:
        """Why a pod that is not running yet does not start, as (reason, message): the
        scheduler's when it is not scheduled, else the kubelet's when its container waits."""
        if self.phase != "Pending" or self.deleting:
            return None
        if self.unscheduled_reason:
            return self.unscheduled_reason, self.unscheduled_message or ""
        if self.waiting_reason:
            return self.waiting_reason, self.waiting_message or ""
        return None


@dataclass(frozen=True, kw_only=True)
class NodeView:
    """What the operator needs of a Kubernetes node: is it lost?"""

    name: str
    ready: str | None = None
    """status.conditions[Ready].status: `True`, `False` or `Unknown` (None: not reported)."""
    unreachable: bool = False
    """Carries the `node.kubernetes.io/unreachable` or `node.kubernetes.io/not-ready` taint."""


@dataclass(frozen=True, kw_only=True)
class ClaimView:
    """The dynamic checkpoint claim, when it exists."""

    name: str
    owned_by_job: bool
    phase: str | None = None


@dataclass(frozen=True, kw_only=True)
class StopSeen:
    """A job pod that was ending on purpose, as the pod watch last saw it, possibly just before
    it went away (`stopmemory.StopMemory`): a trainer pod whose termination message says `Stopped`
    (asked to stop, it committed a checkpoint of its current step first), or a trainer or
    rendezvous pod a voluntary disruption ends (`PodView.voluntarily_disrupted`)."""

    pod: PodView
    job_uid: str
    """The UID of the job that owned the pod (a job deleted and created again has another)."""
    seen_at: datetime
    """When the pod watch first saw the pod ending."""

    @property
    def stopped(self) -> bool:
        """Its trainers committed a checkpoint of their current step and stopped."""
        return (self.pod.outcome is not None and self.pod.outcome.stopped
                and self.pod.outcome.committed_step is not None)

    @property
    def committed_step(self) -> int | None:
        return self.pod.outcome.committed_step if self.pod.outcome is not None else None


@dataclass(frozen=True, kw_only=True)
class Observed:
    """The job's children as the API server has them now."""

    trainer_pods: Mapping[int, PodView] = field(default_factory=dict)
    """Trainer pods by node index (`<job>-<i>` is unique, so at most one per index)."""
    rendezvous_pod: PodView | None = None
    rendezvous_service: bool = False
    headless_service: bool = False
    network_policy: str | None = None
    """The digest of the NetworkPolicy last rendered for the job, from the headless Service's
    annotation (`naming.NETWORK_POLICY_ANNOTATION`); None: no such Service or no annotation
    (made by an operator before the annotation existed)."""
    service_ports: Mapping[str, int] = field(default_factory=dict)
    """The ports the job's Services were created with, by port name (`rendezvous`, `metrics`):
    the running pods use them, whatever the operator's settings say now."""
    claim: ClaimView | None = None
    stops: tuple[StopSeen, ...] = ()
    """Trainer pods of this job that said they stopped after a checkpoint, seen by the pod
    watch (including pods that are gone since), oldest first."""
    nodes_disrupted: str | None = None
    """Why no node counts as lost now (`NodeCache.disruption`): every node is NotReady at once,
    which is the control plane's or the network's failure, not that of every node, or they came
    back from such a disruption too recently. None: nodes are judged one by one."""


@dataclass(frozen=True, kw_only=True)
class RankSample:
    """The metrics of one trainer rank (one worker process), from one scrape."""

    local_rank: int
    rank: int | None = None
    heartbeat: float | None = None
    """Unix time of the rank's last heartbeat."""
    step: int | None = None
    committed_step: int | None = None
    committed_time: float | None = None
    goodput_ratio: float | None = None
    restarts: Mapping[str, int] = field(default_factory=dict)
    """Restarts seen by the job, by kind (`inprocess`, `launcher`, `pod`)."""
    standby: bool = False
    """The rank is a warm spare waiting to take over (`rtj_trainer_standby` 1): it trains
    nothing and sends no heartbeats."""
    connected_time: float | None = None
    """Only for a rank known from its NVRx rank monitor (a team's own script): when its worker
    connected to the monitor."""


@dataclass(frozen=True, kw_only=True)
class NodeLiveness:
    """Scrape results of every local rank of one trainer pod."""

    node_index: int
    pod_uid: str
    samples: tuple[RankSample, ...] = ()
    """The ranks that answered; a rank whose endpoint did not answer is missing."""
    expected_ranks: int = 0
    finished: bool = False
    """The pod's launcher reports that every local worker exited 0 (`"finished": true` in its
    `GET /ranks`): its training is done and the launcher waits in torchelastic's exit barrier for
    the others, so its ranks' heartbeats stop for a good reason."""
    read_time: float | None = None
    """Unix time the pod's answer arrived: a heartbeat's age is measured at its read, so an
    answer read a while ago (a pass that re-reads only some pods) never makes a heartbeat look
    older than it was. None: read in this pass (the pass's own clock)."""

    @property
    def complete(self) -> bool:
        """Whether every local rank answered."""
        return self.expected_ranks > 0 and len(self.samples) == self.expected_ranks


RankLiveness = Mapping[int, NodeLiveness]
"""Liveness of each trainer pod, by node index."""


# --- Kueue ----------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Placement:
    """Where a job's pods may go: `spec.podTemplate.nodeSelector` and `tolerations` (JSON)."""

    node_selector: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, object], ...] = ()


@dataclass(frozen=True, kw_only=True)
class WorkloadCondition:
    """One condition of a Kueue Workload."""

    status: str
    reason: str = ""
    message: str = ""


@dataclass(frozen=True, kw_only=True)
class WorkloadView:
    """What the operator reads of the job's Kueue Workload."""

    name: str
    resource_version: str
    generation: int | None = None
    queue_name: str = ""
    active: bool = True
    """spec.active (false: deactivated by a user or by Kueue)."""
    pod_sets: tuple[Mapping[str, object], ...] = ()
    """spec.podSets as the API server has them."""
    conditions: Mapping[str, WorkloadCondition] = field(default_factory=dict)
    """status.conditions by type."""
    raw_conditions: tuple[Mapping[str, object], ...] = ()
    """status.conditions as they are: a status patch writes the whole list back."""
    cluster_queue: str | None = None
    """status.admission.clusterQueue, while quota is reserved."""
    flavors: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    """status.admission.podSetAssignments: the ResourceFlavors assigned to each pod set."""
    check_updates: Mapping[str, tuple[Placement, ...]] = field(default_factory=dict)
    """status.admissionChecks[].podSetUpdates: placement an admission check adds, by pod set."""

    def true(self, kind: str) -> bool:
        condition = self.conditions.get(kind)
        return condition is not None and condition.status == "True"


@dataclass(frozen=True, kw_only=True)
class FlavorView:
    """A Kueue ResourceFlavor: what it adds to the pods of a pod set assigned to it."""

    name: str
    node_labels: Mapping[str, str] = field(default_factory=dict)
    tolerations: tuple[Mapping[str, object], ...] = ()


@dataclass(frozen=True, kw_only=True)
class QueueView:
    """A job queued through Kueue (`kueue.x-k8s.io/queue-name`): its Workload and the flavors of
    its admission."""

    queue_name: str
    workload: WorkloadView | None = None
    flavors: Mapping[str, FlavorView] = field(default_factory=dict)
    """The ResourceFlavors the admission names, by name (read only while admitted); one that
    could not be read is missing."""
    unavailable: str | None = None
    """Why the operator cannot use Kueue's API (not installed, forbidden); None when it can."""
