"""The words the operator writes in a job's status.

Every word the operator puts in status (a job state, a condition type, a rank state, an incident
cause, a recovery action, a stop reason, a condition's reason) is a member of one `StrEnum` below,
and the decision code writes the members, never string literals. The status models (`status.py`)
type their fields with these enums and generate the field descriptions from them, so the API
cannot document a word the operator never writes.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal


class JobState(StrEnum):
    """status.state: the one-word summary."""

    PENDING = "Pending"
    RUNNING = "Running"
    RECOVERING = "Recovering"
    SUSPENDED = "Suspended"
    QUEUED = "Queued"
    """Queued through Kueue (label `kueue.x-k8s.io/queue-name`), suspended and without pods
    until Kueue admits its Workload; the `Queued` condition says why it waits."""
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ConditionType(StrEnum):
    """status.conditions[].type, in the order the conditions are written."""

    READY = "Ready"
    RUNNING = "Running"
    RECOVERING = "Recovering"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CHECKPOINT_STALE = "CheckpointStale"
    """The job's step is more than `checkpoint.staleAfterIntervals` x `intervalSteps` past the
    newest committed checkpoint."""
    PODS_NOT_STARTING = "PodsNotStarting"
    """A pod is Pending with a reason from the scheduler or the kubelet (Unschedulable,
    ImagePullBackOff, ...), or past podStartTimeoutSeconds."""
    OBSERVATION_DEGRADED = "ObservationDegraded"
    """A running trainer pod's liveness could not be read for longer than
    heartbeatTimeoutSeconds, and the silence is no evidence against it (an outage: fewer than
    half of the job's running pods answer; or the answering pods beat): no hang is declared,
    except for a job's only countable pod (`nodes: 1`), which is replaced once silent for
    2 x (heartbeatTimeoutSeconds + initialHeartbeatTimeoutSeconds), its node not excluded."""
    ADMISSION_REFUSED = "AdmissionRefused"
    """The API server refused to create a child (403: Pod Security admission, an admission
    policy, a quota); reason `PodSecurity` or `Forbidden`, the message is the server's."""
    QUEUED = "Queued"
    """Only on a job queued through Kueue: True while it waits for Kueue to admit its Workload
    (or is being stopped after an eviction), with Kueue's own message; False once admitted."""
    HANG_DETECTION = "HangDetection"
    """Whether the operator can detect a hung worker: True while every running pod's workers
    report heartbeats (the built-in trainer, or a script that sends NVRx heartbeats or uses the
    trainer's library); False, with the pods named, while some pod of a team's own script
    reports nothing (it is supervised as processes only). Set once the pods run."""


class RankState(StrEnum):
    """status.ranks[].state: the state of one trainer pod's workers."""

    PENDING = "Pending"
    STARTING = "Starting"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    STANDBY = "Standby"
    """A warm spare (its ranks wait to take over) or a replacement waiting for the next round."""
    UNRESPONSIVE = "Unresponsive"
    """The pod answers, but its ranks' newest heartbeat was older than heartbeatTimeoutSeconds
    when read: ft_launcher restarts its workers; the operator replaces the pod if heartbeats
    are still missing after heartbeatTimeoutSeconds + initialHeartbeatTimeoutSeconds."""
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    SUSPENDED = "Suspended"


class IncidentCause(StrEnum):
    """status.incidents[].cause: what the operator saw go wrong."""

    POD_FAILED = "PodFailed"
    POD_VANISHED = "PodVanished"
    POD_DELETED = "PodDeleted"
    HEARTBEAT_TIMEOUT = "HeartbeatTimeout"
    PROGRESS_TIMEOUT = "ProgressTimeout"
    RENDEZVOUS_LOST = "RendezvousLost"
    WORKER_RESTART = "WorkerRestart"
    NODE_LOST = "NodeLost"
    """The pod's node is NotReady or unreachable (tainted by the node controller) and the pod's
    heartbeats stopped: the pod is force-deleted and replaced elsewhere."""
    POD_START_TIMEOUT = "PodStartTimeout"
    """The pod was still Pending podStartTimeoutSeconds after it was created."""
    POD_EVICTED = "PodEvicted"
    """A voluntary disruption, not a fault: the pod was evicted through the eviction API (a
    node drain) or preempted by the scheduler (its `DisruptionTarget` condition says which);
    its trainers committed a checkpoint of their current step before they exited."""
    SPEC_CHANGED = "SpecChanged"
    """Not a fault: a running pod was built from another spec than the job's (a setting that
    may change only while suspended was changed, and the job resumed, before a pass saw the
    suspend). Every pod is stopped with its checkpoint and started again from the new spec."""


class RecoveryAction(StrEnum):
    """status.incidents[].action: the recovery taken (the last two run inside the pods; the
    operator only sees them afterwards, in the trainers' counters)."""

    RANK_RESTART = "RankRestart"
    FULL_RESTART = "FullRestart"
    FAIL = "Fail"
    LAUNCHER_RESTART = "LauncherRestart"
    IN_PROCESS_RESTART = "InProcessRestart"
    SPARE_TAKEOVER = "SpareTakeover"
    """A warm spare's ranks took over the lost pod's ranks in place; the pod is replaced as a
    spare. Spends no budget."""
    SPARE_REPLACE = "SpareReplace"
    """A spare pod was lost and is replaced. Spends no budget."""
    RESCHEDULE = "Reschedule"
    """An evicted pod (`PodEvicted`) is created again once its name is free, on another node
    (the drained one is cordoned); with the rendezvous pod, every pod is. Spends no budget."""


class StopReason(StrEnum):
    """status.lastStop.reason: why the trainers were asked to checkpoint, then stop."""

    SUSPENDED = "Suspended"
    """`spec.suspend: true`."""
    PREEMPTED = "Preempted"
    """`spec.suspend: true` with the stop-reason annotation `Preempted` (a queueing system such
    as Kueue took the job's quota back), or a pod preempted by the scheduler."""
    EVICTED = "Evicted"
    """A pod of the job was evicted (a node drain, a descheduler); its replacement resumes."""
    DELETED = "Deleted"
    """The job was deleted; a job of the same name and namespace resumes from the checkpoint
    while the checkpoint volume is kept (a static claim, or `claimDeletePolicy: Retain`)."""


class Reason(StrEnum):
    """status.reason and the conditions' reason. While the job is `Recovering` the reason is the
    `RecoveryAction` under way instead."""

    CREATING = "CreatingPods"
    STARTING = "WaitingForHeartbeats"
    RUNNING = "AllRanksHeartbeating"
    SUSPENDED = "Suspended"
    COMPLETED = "Completed"
    DEADLINE = "DeadlineExceeded"
    NON_RETRYABLE = "NonRetryableExitCode"
    TRAINER_FATAL = "TrainerFatalError"
    """A trainer reported an error that restarting cannot fix (its termination message)."""
    BUDGET = "RestartBudgetExceeded"
    PARTIAL = "PartialCompletion"
    INVALID = "InvalidSpec"
    CHECKPOINT_STALE = "CheckpointStale"
    CHECKPOINT_CURRENT = "CheckpointCurrent"
    OBSERVATION_DEGRADED = "ObservationDegraded"
    POD_SECURITY = "PodSecurity"
    """AdmissionRefused: Pod Security admission refused a pod (the message names the level)."""
    FORBIDDEN = "Forbidden"
    """AdmissionRefused: another 403 (an admission policy, a quota, the operator's RBAC)."""
    NAME_TAKEN = "NameTaken"
    """AdmissionRefused: an object the job needs exists under its name and is not the job's."""
    ADMITTED = "Admitted"
    """AdmissionRefused is False: the children were created. Queued is False: Kueue admitted
    the job's Workload."""
    WAITING_FOR_ADMISSION = "WaitingForAdmission"
    """Queued: the job waits for Kueue to admit its Workload (Kueue's message says why)."""
    EVICTED = "Evicted"
    """Queued: Kueue evicted the job's Workload (preempted, deactivated, ...); the job is
    suspended (its trainers checkpoint first) and queued again."""
    KUEUE_UNAVAILABLE = "KueueUnavailable"
    """Queued: the job asks for Kueue, but the cluster does not serve Kueue's API or the
    operator may not use it; the job stays suspended."""
    WORKLOAD_FINISHED = "WorkloadFinished"
    """Queued: the job's Workload was marked Finished although the job did not finish; the job
    stays suspended."""
    PLACEMENT_CONFLICT = "PlacementConflict"
    """Queued: the admission's flavors cannot be merged into the job's placement."""
    HEARTBEATS_WATCHED = "HeartbeatsWatched"
    """HangDetection is True: every running pod's workers report heartbeats."""
    NO_HEARTBEATS = "WorkersReportNoHeartbeats"
    """HangDetection is False: some pod's workers send no NVRx heartbeats and serve no trainer
    metrics, so a hang there is not detected (exits and lost pods still are)."""


ConditionStatus = Literal["True", "False", "Unknown"]
