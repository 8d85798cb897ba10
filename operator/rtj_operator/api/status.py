"""The job's status, written in the words of `vocabulary.py`.

The status models type their fields with the vocabulary's enums and take the words a field may hold
into its description (`_words`). The enums type the fields in Python only: each field's OpenAPI
schema is pinned with `WithJsonSchema` to what it was before the vocabulary was typed (free-form
fields stay bounded strings, the job state and condition type stay the same enums), so the CRD and
what the API server accepts do not change. Fields accept plain strings (`strict=False`) because a
status arrives from the API server as JSON.

The words are re-exported here, where they lived before `vocabulary.py`: `from
rtj_operator.api.status import IncidentCause` still works.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import AwareDatetime, Field, WithJsonSchema

from rtj_operator.api.schema import MAX_NODES, ApiModel
from rtj_operator.api.vocabulary import ConditionStatus as ConditionStatus
from rtj_operator.api.vocabulary import ConditionType as ConditionType
from rtj_operator.api.vocabulary import IncidentCause as IncidentCause
from rtj_operator.api.vocabulary import JobState as JobState
from rtj_operator.api.vocabulary import RankState as RankState
from rtj_operator.api.vocabulary import Reason as Reason
from rtj_operator.api.vocabulary import RecoveryAction as RecoveryAction
from rtj_operator.api.vocabulary import StopReason as StopReason

MAX_INCIDENTS = 20
"""status.incidents keeps the last MAX_INCIDENTS incidents."""
MAX_CONDITIONS = 16
MAX_EXCLUDED_NODES = 32
"""status.excludedNodes keeps the newest MAX_EXCLUDED_NODES nodes."""
RANKS_DETAIL_LIMIT = 64
"""Above this many trainer pods, the status written to the API lists only the ranks that are
not Running (`compact_ranks`): a 1,000-node job does not rewrite 1,000 entries."""
RANKS_LISTED_LIMIT = 256
"""At most this many entries of `ranks` are written (`compact_ranks`): an 8,192-node job whose
pods are all Pending (its start) keeps its status far below etcd's 1.5 MiB object limit."""
RANK_URGENCY = ("Failed", "Unresponsive", "Restarting", "Starting", "Pending", "Standby",
                "Suspended", "Succeeded")
"""Which not-Running ranks `compact_ranks` keeps first when there are more than
RANKS_LISTED_LIMIT."""


# --- the typed fields -------------------------------------------------------------------------


def _words(vocabulary: type[StrEnum]) -> str:
    return ", ".join(f"`{word}`" for word in vocabulary)


# The typed fields, each with the OpenAPI schema it had as a plain `str` / `Literal`.
JobStateField = Annotated[
    JobState, Field(strict=False),
    WithJsonSchema({"type": "string", "enum": [s.value for s in JobState]}),
]
ConditionTypeField = Annotated[
    ConditionType, Field(strict=False),
    WithJsonSchema({"type": "string", "enum": [t.value for t in ConditionType]}),
]
RankStateField = Annotated[
    RankState, Field(strict=False), WithJsonSchema({"type": "string", "maxLength": 32})
]
IncidentCauseField = Annotated[
    IncidentCause, Field(strict=False), WithJsonSchema({"type": "string", "maxLength": 64})
]
RecoveryActionField = Annotated[
    RecoveryAction, Field(strict=False), WithJsonSchema({"type": "string", "maxLength": 64})
]
StopReasonField = Annotated[
    StopReason, Field(strict=False), WithJsonSchema({"type": "string", "maxLength": 64})
]


# --- the status -----------------------------------------------------------------------------

Timestamp = Annotated[AwareDatetime, Field(strict=False)]


class Condition(ApiModel):
    """A metav1.Condition: one aspect of the job's state with the time it last changed."""

    type: ConditionTypeField = Field(
        description=(
            "`Ready` (summary: the job is training or finished well), `Running`, `Recovering`, "
            "`Suspended`, `Succeeded`, `Failed`, `CheckpointStale` (the step is more than "
            "`checkpoint.staleAfterIntervals` x `intervalSteps` past the newest committed "
            "checkpoint), `PodsNotStarting` (a pod is Pending with the scheduler's or the "
            "kubelet's reason, which the condition's reason and message carry), "
            "`ObservationDegraded` (a running pod's liveness could not be read for longer than "
            "`heartbeatTimeoutSeconds` while fewer than half of the job's running pods answer, "
            "or while the answering ones beat; no hang is declared for it), "
            "`AdmissionRefused` (the API server refused to create a pod or another child: "
            "reason `PodSecurity` or `Forbidden`, the server's message, or `NameTaken`: an "
            "object of a name the job needs exists and is not the job's), `Queued` (only on a "
            "job labelled `kueue.x-k8s.io/queue-name`: True while it waits for Kueue to admit "
            "its Workload, with Kueue's message, False once admitted)."
        )
    )
    status: ConditionStatus = Field(description="`True`, `False`, `Unknown`.")
    observed_generation: int | None = Field(
        default=None, description="metadata.generation the condition was computed from.", ge=0
    )
    last_transition_time: Timestamp = Field(description="When status last changed.")
    reason: str = Field(
        description="Why, as one CamelCase word.",
        min_length=1,
        max_length=1024,
        pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$",
    )
    message: str = Field(default="", description="Why, as a sentence for humans.", max_length=32768)


class LastCheckpoint(ApiModel):
    """The newest committed checkpoint."""

    step: int = Field(description="Optimizer step of the checkpoint.", ge=0)
    time: Timestamp | None = Field(default=None, description="When it was committed.")


class LastStop(ApiModel):
    """The last time the job's trainers were asked to stop and committed a checkpoint of the
    step they were at first (docs/operator.md, "Checkpoint now, then stop")."""

    reason: StopReasonField = Field(description=f"Why: {_words(StopReason)}.")
    step: int = Field(
        description="The step the trainers stopped at; its checkpoint is committed and the next "
        "start resumes from it.",
        ge=0,
    )
    checkpoint: str | None = Field(
        default=None,
        description="The committed checkpoint's directory, as the trainer pods see it.",
        max_length=1024,
    )
    time: Timestamp | None = Field(default=None, description="When it was committed.")
    message: str | None = Field(
        default=None, description="What was stopped, for humans.", max_length=1024
    )


class RestartCounts(ApiModel):
    """Restarts of this job by kind (cumulative, never reset)."""

    total: int = Field(default=0, description="Sum of rank, full, launcher and inProcess.", ge=0)
    rank: int = Field(default=0, description="Pods replaced for one node index.", ge=0)
    full: int = Field(default=0, description="Restarts of every pod.", ge=0)
    launcher: int = Field(
        default=0, description="Worker restarts by ft_launcher inside a pod.", ge=0
    )
    in_process: int = Field(default=0, description="In-process restarts by NVRx.", ge=0)
    spare: int | None = Field(
        default=None,
        description="Lost pods whose ranks a warm spare took over in place (set once one did).",
        ge=0,
    )


class RankStatus(ApiModel):
    """Observed state of one node index (one trainer pod)."""

    node_index: int = Field(description="Node index (the pod's RTJ_NODE_INDEX).", ge=0)
    pod: str | None = Field(default=None, description="Name of the current pod.", max_length=253)
    node: str | None = Field(
        default=None, description="Kubernetes node the pod runs on.", max_length=253
    )
    state: RankStateField | None = Field(
        default=None, description=f"State of the pod's workers: {_words(RankState)}."
    )
    last_heartbeat_time: Timestamp | None = Field(
        default=None, description="Newest heartbeat of the node's ranks."
    )
    unresponsive_since: Timestamp | None = Field(
        default=None,
        description=(
            "While `state` is `Unresponsive`: when the operator saw the heartbeat go stale "
            "(older than `heartbeatTimeoutSeconds`; `lastHeartbeatTime` is the last one)."
        ),
    )
    step: int | None = Field(
        default=None, description="Last completed step of the node's ranks.", ge=0
    )
    restarts: int | None = Field(default=None, description="Restarts of this node index.", ge=0)
    attempt: int | None = Field(
        default=None, description="Attempt number of the current pod.", ge=0
    )


MAX_RESTART_RECORDS = 100
"""Most restarts a budget may allow per window: each budget's records are kept in the status."""


class RestartRecords(ApiModel):
    """When the operator's own restarts happened, per kind: what the restart budgets count.

    Each list keeps the newest `max` entries of its budget (at most 100), apart from the incident
    list, so no other record can push a restart out before its window ends."""

    rank: list[Timestamp] = Field(
        default_factory=list, description="RankRestarts, oldest first.",
        max_length=MAX_RESTART_RECORDS)
    full: list[Timestamp] = Field(
        default_factory=list, description="FullRestarts, oldest first.",
        max_length=MAX_RESTART_RECORDS)


class ProgressClock(ApiModel):
    """The step the job's progress timeout counts from, and since when (kept in the status so
    an operator restart does not reset the clock)."""

    step: int = Field(description="Slowest step of the job when the clock started.", ge=0)
    since: Timestamp = Field(description="When that step was first seen.")


class SpareStatus(ApiModel):
    """The job's warm spares (`spec.faultTolerance.spares`)."""

    desired: int = Field(description="Spares the spec asks for.", ge=0)
    ready: int = Field(
        default=0,
        description="Spare pods whose ranks are up and waiting to take over a lost pod.",
        ge=0,
    )
    waiting: list[int] = Field(
        default_factory=list,
        description=(
            "Node indexes of replacement pods whose launcher waits for the job's next launcher "
            "round: a pod created after a takeover cannot join the running world, it becomes a "
            "spare (or an active node) at the next ft_launcher restart of the job."
        ),
        max_length=MAX_NODES,
        json_schema_extra={"x-kubernetes-list-type": "set"},
    )


class ExcludedNode(ApiModel):
    """A node the job's new trainer pods avoid (a preferred node anti-affinity), and why."""

    node: str = Field(description="Name of the Kubernetes node.", max_length=253)
    reason: IncidentCauseField = Field(
        description="The fault seen there: `HeartbeatTimeout`, `NodeLost` or `PodStartTimeout`."
    )
    since: Timestamp = Field(description="When the node was (last) excluded.")
    node_index: int | None = Field(
        default=None, description="Node index of the pod that failed there.", ge=0
    )
    message: str | None = Field(default=None, description="The evidence.", max_length=1024)


class Incident(ApiModel):
    """One fault and the recovery the operator chose for it."""

    cause: IncidentCauseField = Field(description=f"What went wrong: {_words(IncidentCause)}.")
    node_index: int | None = Field(default=None, description="Node index of the faulty pod.", ge=0)
    rank: int | None = Field(default=None, description="Global rank of the faulty process.", ge=0)
    detected_time: Timestamp = Field(description="When the operator saw the fault.")
    acted_time: Timestamp | None = Field(default=None, description="When recovery began.")
    recovered_time: Timestamp | None = Field(
        default=None, description=(
            "When every pod ran again after the operator's recovery (a warm spare already "
            "running can close it in the pass that detected the loss: 0 s); the trainers' "
            "resume after that shows in `step`.")
    )
    seconds: Annotated[float, Field(strict=False)] | None = Field(
        default=None, description="Seconds from detection to recovery.", ge=0
    )
    action: RecoveryActionField | None = Field(
        default=None, description=f"Recovery taken: {_words(RecoveryAction)}."
    )
    message: str | None = Field(default=None, description="Details for humans.", max_length=1024)


class ResilientTrainingJobStatus(ApiModel):
    """Observed state of a ResilientTrainingJob, written only by the operator."""

    observed_generation: int | None = Field(
        default=None, description="metadata.generation this status describes.", ge=0
    )
    conditions: list[Condition] = Field(
        default_factory=list,
        description="Conditions, one per type; `Ready` is the summary.",
        max_length=MAX_CONDITIONS,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["type"],
        },
    )
    state: JobStateField | None = Field(
        default=None,
        description=f"One-word summary for `kubectl get`: {', '.join(JobState)}. "
        "Read conditions for the details.",
    )
    nodes_ready: int | None = Field(
        default=None, description="Trainer pods running and ready.", ge=0
    )
    nodes_desired: int | None = Field(default=None, description="Trainer pods wanted.", ge=0)
    nodes: str | None = Field(
        default=None, description="`ready/desired`, for `kubectl get`.", max_length=16
    )
    step: int | None = Field(default=None, description="Last step completed by every rank.", ge=0)
    last_checkpoint: LastCheckpoint | None = Field(
        default=None, description="The newest committed checkpoint."
    )
    last_stop: LastStop | None = Field(
        default=None,
        description="The last checkpoint the trainers committed because they were asked to stop "
        "(a suspend, a preemption, an eviction, the job's deletion).",
    )
    restarts: RestartCounts | None = Field(default=None, description="Restarts by kind.")
    progress_clock: ProgressClock | None = Field(
        default=None,
        description="Where the progress timeout (`progressTimeoutSeconds`) counts from.",
    )
    restart_records: RestartRecords | None = Field(
        default=None,
        description="When the operator's restarts of each kind happened (what budgets count).",
    )
    spares: SpareStatus | None = Field(
        default=None, description="Warm spares: wanted, ready, replacements waiting."
    )
    rank_counts: dict[str, int] | None = Field(
        default=None,
        description=(
            "Trainer pods by the state of their workers (`ranks[].state`), every pod counted."
        ),
        json_schema_extra={"maxProperties": 16},
    )
    ranks: list[RankStatus] = Field(
        default_factory=list,
        description=(
            f"One entry per node index; a job of more than {RANKS_DETAIL_LIMIT} trainer pods "
            "lists only the pods that are not `Running`, at most "
            f"{RANKS_LISTED_LIMIT} of them, the most urgent states first (`rankCounts` counts "
            "them all)."
        ),
        max_length=MAX_NODES,
        json_schema_extra={
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["nodeIndex"],
        },
    )
    incidents: list[Incident] = Field(
        default_factory=list,
        description=f"The last {MAX_INCIDENTS} faults, oldest first.",
        max_length=MAX_INCIDENTS,
    )
    excluded_nodes: list[ExcludedNode] | None = Field(
        default=None,
        description=(
            "Nodes where a trainer pod failed its heartbeats, was lost with its node, or never "
            "started: trainer pods created afterwards prefer every other node (a preferred "
            "node anti-affinity, so they still land there when no other node fits). Kept for "
            f"the job's life, the newest {MAX_EXCLUDED_NODES}, oldest first."
        ),
        max_length=MAX_EXCLUDED_NODES,
    )
    goodput: str | None = Field(
        default=None,
        description="Share of wall time spent in steps that were kept, for example `93.1%`.",
        max_length=8,
        pattern=r"^[0-9]{1,3}(\.[0-9])?%$",
    )
    start_time: Timestamp | None = Field(
        default=None, description="When the job first started pods."
    )
    completion_time: Timestamp | None = Field(
        default=None, description="When the job succeeded or failed."
    )
    reason: str | None = Field(
        default=None,
        description="Reason of the current state, one CamelCase word.",
        max_length=1024,
    )
    message: str | None = Field(
        default=None, description="The current state explained in a sentence.", max_length=32768
    )


def compact_ranks(ranks: list[RankStatus]) -> list[RankStatus]:
    """`ranks` as the API stores them: every entry up to RANKS_DETAIL_LIMIT pods, else only the
    entries whose state is not Running, and of those at most RANKS_LISTED_LIMIT, the most
    urgent states first (RANK_URGENCY), in node-index order (the operator keeps the full list in
    memory; `rankCounts` counts every pod)."""
    if len(ranks) <= RANKS_DETAIL_LIMIT:
        return ranks
    listed = [rank for rank in ranks if rank.state != RankState.RUNNING]
    if len(listed) <= RANKS_LISTED_LIMIT:
        return listed
    order = {state: i for i, state in enumerate(RANK_URGENCY)}
    kept = sorted(listed, key=lambda r: (order.get(str(r.state), len(order)), r.node_index))
    return sorted(kept[:RANKS_LISTED_LIMIT], key=lambda r: r.node_index)
