"""`spec.faultTolerance`: how faults are detected (heartbeat, progress and pod start timeouts) and
recovered from (in-process and launcher restarts, warm spares, the restart strategy and the
budgets of rank and full restarts).
"""

from __future__ import annotations

from typing import Annotated, Literal, Self

from pydantic import ConfigDict, Field, model_validator

from rtj_operator.api.schema import ApiModel
from rtj_operator.api.spec_fields import INT32_MAX, cel, validations
from rtj_operator.api.status import MAX_RESTART_RECORDS


class RankRestartBudget(ApiModel):
    """How many single-node (rank) restarts the job may spend within a sliding window."""

    max: int = Field(
        default=10,
        description=(
            "Restarts allowed within the window (at most 100: the status keeps a record of each)."
        ),
        ge=0,
        le=MAX_RESTART_RECORDS,
    )
    window_seconds: int = Field(
        default=3600, description="Length of the sliding window in seconds.", ge=1, le=INT32_MAX
    )


class FullRestartBudget(ApiModel):
    """How many whole-job restarts (every pod recreated) the job may spend within a window."""

    max: int = Field(
        default=3,
        description=(
            "Restarts allowed within the window (at most 100: the status keeps a record of each)."
        ),
        ge=0,
        le=MAX_RESTART_RECORDS,
    )
    window_seconds: int = Field(
        default=86400, description="Length of the sliding window in seconds.", ge=1, le=INT32_MAX
    )


class FaultTolerance(ApiModel):
    """How faults are detected and which recovery the operator may spend on them.

    A soft fault (an exception, a stuck collective) is handled inside the processes by NVRx
    in-process restart when it is enabled; a dead worker process by ft_launcher, which restarts
    the workers in place (up to launcherMaxRestarts); a lost or failed pod by a new pod for that
    node index (spends rankRestartBudget); a hang by the heartbeat and progress timeouts. When the
    rank budget is spent, or restartStrategy is FullRestart, every pod is recreated (spends
    fullRestartBudget); when that budget is spent too, the job fails.
    """

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "self.initialHeartbeatTimeoutSeconds >= self.heartbeatTimeoutSeconds",
                "faultTolerance.initialHeartbeatTimeoutSeconds must be at least "
                "heartbeatTimeoutSeconds",
                field_path=".initialHeartbeatTimeoutSeconds",
            ),
            cel(
                "self.spares == 0 || self.inProcessRestart != 'Disabled'",
                "faultTolerance.spares needs in-process restart, not inProcessRestart: Disabled "
                "(spares take over inside the in-process restart's world)",
                field_path=".spares",
            ),
        )
    )

    heartbeat_timeout_seconds: int = Field(
        default=60,
        description="A rank that sends no heartbeat for this long (after its first) is hung.",
        ge=1,
        le=86400,
    )
    initial_heartbeat_timeout_seconds: int = Field(
        default=600,
        description=(
            "Time a rank may take from start to its first heartbeat (loading the checkpoint, "
            "building the model)."
        ),
        ge=1,
        le=86400,
    )
    progress_timeout_seconds: int = Field(
        default=900,
        description=(
            "The job is stalled when the step of the slowest rank does not advance for this long "
            "although every rank sends heartbeats."
        ),
        ge=1,
        le=604800,
    )
    pod_start_timeout_seconds: int = Field(
        default=600,
        description=(
            "A pod still Pending this long after it was created (not scheduled, or its "
            "container waiting: ImagePullBackOff, CreateContainerConfigError, ...) is a fault: "
            "it is replaced (its node avoided when it was scheduled), spending the restart "
            "budgets like any other fault. Why it does not start shows at once in the "
            "`PodsNotStarting` condition. Keep it below heartbeatTimeoutSeconds + "
            "initialHeartbeatTimeoutSeconds: the other pods wait for it without heartbeats. "
            "May change at any time."
        ),
        ge=10,
        le=604800,
    )
    in_process_restart: Literal["Auto", "Enabled", "Disabled"] = Field(
        default="Auto",
        description=(
            "`Enabled` lets NVRx restart the training loop inside the running processes first "
            "(fastest recovery; the worker must run NVRx's in-process wrapper, as the built-in "
            "trainer does); `Disabled` goes straight to process restarts. `Auto`: enabled for "
            "the built-in trainer (`command` is `python -m rtj_trainer`), disabled for any "
            "other command."
        ),
    )
    warm_workers: Literal["Auto", "Enabled", "Disabled"] = Field(
        default="Auto",
        description=(
            "`Enabled`: the launcher keeps worker processes that imported torch and NVRx ahead "
            "of time and starts every worker (the first ones, and each restart's) in one of "
            "them, seconds sooner. `Disabled`: every worker starts as a new process. `Auto`: "
            "enabled on pods with GPUs (their CPU cores have room for the imports), disabled "
            "otherwise. May change at any time (new pods get it)."
        ),
    )
    device_keepers: Literal["Auto", "Enabled", "Disabled"] = Field(
        default="Auto",
        description=(
            "`Enabled`: the launcher starts one keeper process per GPU that holds the "
            "node-local snapshots' buffer in device memory, so a worker killed on its node "
            "leaves its last snapshot on the GPU and the restarted worker loads it from there "
            "(no host copy, no read; costs one CUDA context per GPU). `Disabled`: each worker "
            "holds its own buffer. `Auto`: enabled on pods with GPUs that run the built-in "
            "trainer. May change at any time (new pods get it)."
        ),
    )
    rendezvous_disruption_budget: Literal["Enabled", "Disabled"] = Field(
        default="Disabled",
        description=(
            "`Enabled`: a PodDisruptionBudget `<job>-rdzv` (maxUnavailable 0) keeps a node drain "
            "or any other eviction from taking the Ready rendezvous pod while the job runs: a "
            "drain of its node then waits until the job ends or is suspended, or the pod is "
            "deleted by hand. `Disabled` (default, as for trainer pods: drains always proceed): "
            "an evicted rendezvous pod stops every pod with a checkpoint of its current step "
            "and the whole job starts again, spending no budget. Read when the rendezvous "
            "Service is created (the job's first start)."
        ),
    )
    spares: int = Field(
        default=0,
        description=(
            "Warm spare pods (`<job>-<nodes>` and up), started with the job: their ranks import, "
            "join the process group's world and wait. When a trainer pod is lost, a spare's "
            "ranks take over the lost ranks inside the running processes (NVRx in-process "
            "restart) while every other pod keeps its processes; the operator then creates a "
            "new pod for the lost index, which waits as a spare from the next launcher restart "
            "of the job on. A takeover spends no restart budget. Needs inProcessRestart: "
            "Enabled; may change only while the job is suspended."
        ),
        ge=0,
        le=64,
    )
    fault_injection: Literal["Enabled", "Disabled"] = Field(
        default="Disabled",
        description=(
            "`Enabled` arms the trainer's fault injector: the faults listed in the env variable "
            "TRAINER_FAULTS fire (tests, demos, chaos drills) and the operator posts a "
            "FaultInjectionArmed Event. `Disabled`: a job that sets TRAINER_FAULTS is refused."
        ),
    )
    launcher_max_restarts: int = Field(
        default=3,
        description=(
            "Restarts of the worker processes that ft_launcher may do inside one pod before the "
            "pod fails."
        ),
        ge=0,
        le=1000,
    )
    rank_restart_budget: RankRestartBudget = Field(
        default_factory=RankRestartBudget,
        description="Budget of single-node restarts (a new pod for one node index).",
        json_schema_extra={"default": RankRestartBudget().to_api()},
    )
    full_restart_budget: FullRestartBudget = Field(
        default_factory=FullRestartBudget,
        description="Budget of whole-job restarts (every pod recreated).",
        json_schema_extra={"default": FullRestartBudget().to_api()},
    )
    restart_strategy: Literal["RankRestart", "FullRestart"] = Field(
        default="RankRestart",
        description=(
            "`RankRestart` replaces only the failed node's pod and lets the others rejoin the "
            "rendezvous; `FullRestart` restarts every pod on any fault (what a plain Kubernetes "
            "Job gives, kept as a baseline for comparison)."
        ),
    )
    non_retryable_exit_codes: list[Annotated[int, Field(ge=1, le=255)]] = Field(
        default_factory=list,
        description=(
            "Exit codes that fail the job at once instead of restarting. Each is matched "
            "against a trainer worker's exit code (the launcher shim then stops ft_launcher's "
            "restarts and reports the code in the pod's termination message) and against the "
            "trainer container's own exit code (ft_launcher's: 1, or 128+N for signal N). 93 "
            "(ft_launcher's 'do not restart') and the trainer's fatal-error code 94 always "
            "fail the job. A worker's 95 (it committed a checkpoint and stopped because another "
            "pod was being ended) is never matched: it is restarted."
        ),
        max_length=32,
        json_schema_extra={"x-kubernetes-list-type": "set", "default": []},
    )

    @model_validator(mode="after")
    def _initial_timeout_covers_heartbeat_timeout(self) -> Self:
        if self.initial_heartbeat_timeout_seconds < self.heartbeat_timeout_seconds:
            raise ValueError(
                "faultTolerance.initialHeartbeatTimeoutSeconds must be at least "
                "heartbeatTimeoutSeconds"
            )
        return self

    @model_validator(mode="after")
    def _spares_need_in_process_restart(self) -> Self:
        if self.spares and self.in_process_restart == "Disabled":
            raise ValueError("faultTolerance.spares needs in-process restart (inProcessRestart "
                             "Auto or Enabled)")
        return self
