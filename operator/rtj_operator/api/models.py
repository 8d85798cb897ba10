"""Pydantic models of the ResilientTrainingJob resource: the single source of truth of the API.

Python names are snake_case; the YAML/JSON names are camelCase through an alias generator, and
models accept both (`populate_by_name`). Unknown fields are errors (`extra="forbid"`), as they are
on the API server with strict field validation.

Every field carries a description, bounds and (for strings and lists) a maximum size: the CRD
generator (`rtj_operator.api.crd`) copies them into the OpenAPI schema, where `kubectl explain`
shows the descriptions and the API server's CEL cost estimator needs the sizes. Cross-field and
immutability rules are written twice on purpose, next to each other: as CEL
(`x-kubernetes-validations`, enforced by the API server at apply time) and as pydantic validators
(enforced when the operator or a test parses an object); `tests/unit/test_api_models.py` and the
invalid-manifest corpus keep the two in step.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from datetime import datetime
from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

from rtj_operator import profiles
from rtj_operator.api.schema import MAX_NODES as MAX_NODES
from rtj_operator.api.schema import ApiModel as ApiModel
from rtj_operator.api.status import MAX_INCIDENTS as MAX_INCIDENTS
from rtj_operator.api.status import MAX_RESTART_RECORDS as MAX_RESTART_RECORDS
from rtj_operator.api.status import Condition as Condition
from rtj_operator.api.status import Incident as Incident
from rtj_operator.api.status import LastCheckpoint as LastCheckpoint
from rtj_operator.api.status import RankStatus as RankStatus
from rtj_operator.api.status import ResilientTrainingJobStatus as ResilientTrainingJobStatus
from rtj_operator.api.status import RestartCounts as RestartCounts

# --- limits -----------------------------------------------------------------------------------

MAX_PROCS_PER_NODE = 64
MAX_JOB_NAME_LENGTH = 50
"""Longest job name. Children are named `<name>-<index>` (pod hostnames, index < MAX_NODES, so
at most 5 more characters) and `<name>-rdzv`, and hostnames must be DNS labels of at most 63
characters: that allows 58. We keep 8 characters in reserve for children we may add later (a
per-attempt suffix, for example) because a limit can be raised later but never lowered without
breaking existing objects."""
INT32_MAX = 2**31 - 1
DNS_LABEL_1035 = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
RESERVED_ENV_PREFIX = "RTJ_"
JOB_REFERENCE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z]([-a-z0-9]*[a-z0-9])?$"
"""`<namespace>/<name>` of a job."""
JobReference = Annotated[str, Field(pattern=JOB_REFERENCE, max_length=317)]

# --- shared types -----------------------------------------------------------------------------


def _number_to_quantity_string(value: object) -> object:
    """YAML `cpu: 4` arrives as an int; Kubernetes quantities are int-or-string."""
    if isinstance(value, bool):
        return value  # let the str validator reject it
    if isinstance(value, int | float):
        return str(value)
    return value


Quantity = Annotated[
    str,
    BeforeValidator(_number_to_quantity_string),
    Field(pattern=QUANTITY_PATTERN, max_length=64),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
            "pattern": QUANTITY_PATTERN,
        }
    ),
]
"""A Kubernetes resource quantity such as `4`, `500m`, `1800Gi`."""

ShortString = Annotated[str, Field(max_length=253)]
LabelValue = Annotated[str, Field(max_length=63)]
LabelKey = Annotated[str, Field(max_length=317)]  # prefix (253) + "/" + name (63)
AnnotationValue = Annotated[str, Field(max_length=4096)]
Argument = Annotated[str, Field(max_length=4096)]


def cel(
    rule: str,
    message: str,
    *,
    field_path: str | None = None,
    reason: str | None = None,
) -> dict[str, str]:
    """One `x-kubernetes-validations` entry."""
    entry = {"rule": rule, "message": message}
    if field_path is not None:
        entry["fieldPath"] = field_path
    if reason is not None:
        entry["reason"] = reason
    return entry


def validations(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


def immutable(field_name: str) -> dict[str, Any]:
    return validations(cel("self == oldSelf", f"{field_name} is immutable"))


# --- spec: environment ------------------------------------------------------------------------


class KeySelector(ApiModel):
    """Selects a key of a Secret or ConfigMap in the job's namespace."""

    name: Annotated[str, Field(description="Name of the Secret or ConfigMap.", max_length=253)]
    key: Annotated[str, Field(description="The key to select.", max_length=253)]
    optional: bool | None = Field(
        default=None, description="Whether the Secret or ConfigMap (or its key) may be missing."
    )


class FieldSelector(ApiModel):
    """Selects a field of the pod (downward API)."""

    field_path: str = Field(
        description="Path of the field, for example `metadata.name` or `status.hostIP`.",
        max_length=256,
    )
    api_version: str | None = Field(
        default=None,
        description="API version the fieldPath is written in (default `v1`).",
        max_length=64,
    )


class EnvVarSource(ApiModel):
    """Source of an environment variable's value: exactly one of the selectors."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "[has(self.secretKeyRef), has(self.configMapKeyRef), has(self.fieldRef)]"
                ".filter(x, x).size() == 1",
                "valueFrom must set exactly one of secretKeyRef, configMapKeyRef, fieldRef",
            )
        )
    )

    secret_key_ref: KeySelector | None = Field(default=None, description="A key of a Secret.")
    config_map_key_ref: KeySelector | None = Field(
        default=None, description="A key of a ConfigMap."
    )
    field_ref: FieldSelector | None = Field(default=None, description="A field of the pod.")

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Self:
        chosen = [self.secret_key_ref, self.config_map_key_ref, self.field_ref]
        if sum(x is not None for x in chosen) != 1:
            raise ValueError(
                "valueFrom must set exactly one of secretKeyRef, configMapKeyRef, fieldRef"
            )
        return self


class EnvVar(ApiModel):
    """An environment variable of the trainer container: a literal value or a reference."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!(has(self.value) && has(self.valueFrom))",
                "env: value and valueFrom are mutually exclusive",
                field_path=".valueFrom",
            ),
            cel(
                f"!self.name.startsWith('{RESERVED_ENV_PREFIX}')",
                f"env name: the prefix {RESERVED_ENV_PREFIX} is reserved for the operator",
                field_path=".name",
            ),
        )
    )

    name: str = Field(
        description=(
            "Name of the variable. Names starting with `RTJ_` are reserved: the operator sets "
            "them (see docs/design.md). `TRAINER_FAULTS` is passed to the trainer's fault "
            "injector."
        ),
        min_length=1,
        max_length=256,
        pattern=r"^[^=]+$",
    )
    value: str | None = Field(default=None, description="Literal value.", max_length=32768)
    value_from: EnvVarSource | None = Field(
        default=None, description="Take the value from a Secret, a ConfigMap or the pod."
    )

    @model_validator(mode="after")
    def _value_xor_value_from(self) -> Self:
        if self.value is not None and self.value_from is not None:
            raise ValueError("env: value and valueFrom are mutually exclusive")
        if self.name.startswith(RESERVED_ENV_PREFIX):
            raise ValueError(
                f"env name: the prefix {RESERVED_ENV_PREFIX} is reserved for the operator"
            )
        return self


# --- spec: resources, checkpoint, fault tolerance ---------------------------------------------


class Resources(ApiModel):
    """Quantities are Kubernetes quantities such as `4`, `500m`, `1800Gi`."""

    requests: dict[Annotated[str, Field(max_length=253)], Quantity] = Field(
        default_factory=dict,
        description=(
            "Minimum resources per pod (for example `cpu`, `memory`, `nvidia.com/gpu`, "
            "`vpc.amazonaws.com/efa`, `hugepages-2Mi`)."
        ),
        max_length=32,
    )
    limits: dict[Annotated[str, Field(max_length=253)], Quantity] = Field(
        default_factory=dict,
        description="Maximum resources per pod. Extended resources need limits equal to requests.",
        max_length=32,
    )


CHECKPOINT_SOURCE_RULES = (
    cel(
        "has(self.claimName) != has(self.storageClassName)",
        "checkpoint: exactly one volume source must be set: claimName (an existing PVC) or "
        "storageClassName with size (a volume the operator creates)",
        field_path=".claimName",
        reason="FieldValueInvalid",
    ),
    cel(
        "has(self.storageClassName) == has(self.size)",
        "checkpoint.size is required with checkpoint.storageClassName, and only with it",
        field_path=".size",
        reason="FieldValueRequired",
    ),
    cel(
        "!has(self.claimDeletePolicy) || has(self.storageClassName)",
        "checkpoint.claimDeletePolicy applies only to a volume the operator creates "
        "(storageClassName)",
        field_path=".claimDeletePolicy",
    ),
)


def _same_optional(field_name: str, path: str) -> dict[str, str]:
    """Immutability of an optional field: it may not be added, removed or changed."""
    return cel(
        f"has(self.{field_name}) == has(oldSelf.{field_name}) && "
        f"(!has(self.{field_name}) || self.{field_name} == oldSelf.{field_name})",
        f"{path} is immutable",
        field_path=f".{field_name}",
    )


class Checkpoint(ApiModel):
    """Where and how often the trainer writes checkpoints.

    The volume is shared by every pod (ReadWriteMany, FSx for Lustre on AWS): either an existing
    claim (`claimName`) or one the operator creates from a StorageClass (`storageClassName` and
    `size`). The volume source, `mountPath` and `path` are immutable.
    """

    model_config = ConfigDict(
        json_schema_extra=validations(
            *CHECKPOINT_SOURCE_RULES,
            _same_optional("claimName", "checkpoint.claimName"),
            _same_optional("storageClassName", "checkpoint.storageClassName"),
            _same_optional("size", "checkpoint.size"),
            _same_optional("path", "checkpoint.path"),
        )
    )

    claim_name: str | None = Field(
        default=None,
        description=(
            "Name of an existing ReadWriteMany PersistentVolumeClaim in the job's namespace "
            "(for example a static FSx for Lustre volume). Exclusive with storageClassName."
        ),
        max_length=253,
        pattern=DNS_SUBDOMAIN,
    )
    storage_class_name: str | None = Field(
        default=None,
        description=(
            "StorageClass of a ReadWriteMany volume that the operator creates as the claim "
            "`<job name>-checkpoints` (for example a dynamic FSx for Lustre class). Needs size."
        ),
        max_length=253,
        pattern=DNS_SUBDOMAIN,
    )
    size: Quantity | None = Field(
        default=None,
        description="Capacity of the volume the operator creates (with storageClassName).",
    )
    claim_delete_policy: Literal["Delete", "Retain"] | None = Field(
        default=None,
        description=(
            "What happens to the claim the operator created when the job is deleted: `Delete` "
            "(the default) or `Retain`. Only with storageClassName; an existing claim is never "
            "deleted."
        ),
    )
    mount_path: str = Field(
        default="/checkpoints",
        description="Absolute path where the volume is mounted in every trainer container.",
        max_length=1024,
        pattern=r"^/([^/]+(/[^/]+)*)?$",
        json_schema_extra=immutable("checkpoint.mountPath"),
    )
    path: str | None = Field(
        default=None,
        description=(
            "Subdirectory of the volume that holds this job's checkpoints (default: "
            "`<namespace>/<name>`, so a job deleted and applied again resumes its own). A "
            "relative path without `..`; the trainer gets `<mountPath>/<path>` as "
            "RTJ_CHECKPOINT_DIR. Checkpoints another job wrote there are refused unless "
            "resumeFromJobs names that job."
        ),
        max_length=512,
        pattern=r"^[A-Za-z0-9._-]+(/[A-Za-z0-9._-]+)*$",
        json_schema_extra=validations(
            cel(
                "!self.split('/').exists(s, s == '..' || s == '.')",
                "checkpoint.path may not contain '.' or '..' segments",
            )
        ),
    )
    resume_from_jobs: list[JobReference] = Field(
        default_factory=list,
        description=(
            "Other jobs, as `<namespace>/<name>`, whose committed checkpoints in this job's "
            "checkpoint directory it may resume (for example to continue another run: set "
            "path to that run's directory and name it here). Without it, a trainer that finds "
            "another job's checkpoints fails with reason ForeignCheckpoint."
        ),
        max_length=16,
    )
    interval_steps: int = Field(
        default=100,
        description="Write a checkpoint every this many optimizer steps.",
        ge=1,
        le=INT32_MAX,
    )
    keep: int = Field(
        default=3, description="Number of newest committed checkpoints kept.", ge=1, le=100
    )
    mode: Literal["Async", "Sync"] = Field(
        default="Async",
        description=(
            "`Async` stages the state in memory and writes it in the background (short stall); "
            "`Sync` blocks the step loop until the checkpoint is committed."
        ),
    )
    stale_after_intervals: int = Field(
        default=3,
        description=(
            "Raise the `CheckpointStale` condition (and a Warning Event) when the job's step is "
            "more than this many checkpoint intervals past the newest committed checkpoint "
            "(`status.lastCheckpoint`); it clears when a commit catches up."
        ),
        ge=1,
        le=1000,
    )

    @field_validator("path")
    @classmethod
    def _no_dot_segments(cls, path: str | None) -> str | None:
        if path is not None and any(s in (".", "..") for s in path.split("/")):
            raise ValueError("checkpoint.path may not contain '.' or '..' segments")
        return path

    @model_validator(mode="after")
    def _exactly_one_source(self) -> Self:
        if (self.claim_name is None) == (self.storage_class_name is None):
            raise ValueError(CHECKPOINT_SOURCE_RULES[0]["message"])
        if (self.storage_class_name is None) != (self.size is None):
            raise ValueError(CHECKPOINT_SOURCE_RULES[1]["message"])
        if self.claim_delete_policy is not None and self.storage_class_name is None:
            raise ValueError(CHECKPOINT_SOURCE_RULES[2]["message"])
        return self

    @property
    def is_dynamic(self) -> bool:
        """Whether the operator creates (and owns) the claim."""
        return self.storage_class_name is not None

    @property
    def effective_claim_delete_policy(self) -> Literal["Delete", "Retain"]:
        return self.claim_delete_policy or "Delete"


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
                "self.spares == 0 || self.inProcessRestart == 'Enabled'",
                "faultTolerance.spares needs inProcessRestart: Enabled (spares take over inside "
                "the in-process restart's world)",
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
    in_process_restart: Literal["Enabled", "Disabled"] = Field(
        default="Enabled",
        description=(
            "`Enabled` lets NVRx restart the training loop inside the running processes first "
            "(fastest recovery); `Disabled` goes straight to process restarts."
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
        if self.spares and self.in_process_restart != "Enabled":
            raise ValueError("faultTolerance.spares needs inProcessRestart: Enabled")
        return self


# --- spec: pod template -----------------------------------------------------------------------


class Toleration(ApiModel):
    """A core/v1 Toleration: lets trainer pods run on nodes with matching taints."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "!has(self.operator) || self.operator != 'Exists' || !has(self.value) "
                "|| self.value == ''",
                "tolerations: value must be empty when operator is Exists",
                field_path=".value",
            )
        )
    )

    key: str | None = Field(
        default=None,
        description="Taint key; empty with operator Exists matches every taint.",
        max_length=317,
    )
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="`Equal` (default) or `Exists`."
    )
    value: str | None = Field(default=None, description="Taint value to match.", max_length=63)
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="Taint effect to match; empty matches every effect."
    )
    toleration_seconds: int | None = Field(
        default=None,
        description="With effect NoExecute: how long the pod stays bound after the taint appears.",
        ge=-(2**63),
        le=2**63 - 1,
    )

    @model_validator(mode="after")
    def _exists_takes_no_value(self) -> Self:
        if self.operator == "Exists" and self.value:
            raise ValueError("tolerations: value must be empty when operator is Exists")
        return self


ID_MAX = 2**31 - 1
"""Largest user or group id the operator accepts (Linux ids are 32-bit; the API allows int64)."""
CAPABILITY = Annotated[str, Field(pattern=r"^[A-Z][A-Z_]*$", max_length=64)]
"""A Linux capability as Kubernetes writes it, without `CAP_` (`NET_BIND_SERVICE`)."""


class SeccompProfile(ApiModel):
    """A core/v1 SeccompProfile."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "self.type == 'Localhost' ? has(self.localhostProfile) : "
                "!has(self.localhostProfile)",
                "seccompProfile.localhostProfile is required with type Localhost, and only "
                "with it",
                field_path=".localhostProfile",
            )
        )
    )

    type: Literal["RuntimeDefault", "Localhost", "Unconfined"] = Field(
        description="`RuntimeDefault` (the operator's default), `Localhost` or `Unconfined`."
    )
    localhost_profile: str | None = Field(
        default=None, description="Profile file on the node, with type Localhost.", max_length=4096
    )

    @model_validator(mode="after")
    def _localhost_profile_with_localhost(self) -> Self:
        if (self.type == "Localhost") != (self.localhost_profile is not None):
            raise ValueError("seccompProfile.localhostProfile is required with type Localhost, "
                             "and only with it")
        return self


class Capabilities(ApiModel):
    """Linux capabilities added to and dropped from the container's default set."""

    add: list[CAPABILITY] | None = Field(
        default=None, description="Capabilities added.", max_length=64
    )
    drop: list[CAPABILITY] | None = Field(
        default=None, description="Capabilities dropped (`ALL` for every one).", max_length=64
    )


class PodSecurityContext(ApiModel):
    """Pod-level core/v1 PodSecurityContext fields a job may set; each one given replaces the
    operator's default of that field (docs/security.md)."""

    run_as_user: int | None = Field(
        default=None, description="User id of every container's processes.", ge=0, le=ID_MAX
    )
    run_as_group: int | None = Field(
        default=None, description="Primary group id of every container's processes.", ge=0,
        le=ID_MAX,
    )
    run_as_non_root: bool | None = Field(
        default=None,
        description="Refuse to start a container whose user is root (default: true).",
    )
    fs_group: int | None = Field(
        default=None,
        description=(
            "Group that owns the pod's volumes (and that every process joins): set it when the "
            "checkpoint volume is root-owned when new (FSx for Lustre), so a non-root trainer "
            "may write it."
        ),
        ge=0,
        le=ID_MAX,
    )
    fs_group_change_policy: Literal["OnRootMismatch", "Always"] | None = Field(
        default=None,
        description=(
            "When the kubelet changes volume ownership to fsGroup: `OnRootMismatch` (only when "
            "the volume's root differs: cheap on a large FSx volume) or `Always`."
        ),
    )
    supplemental_groups: list[Annotated[int, Field(ge=0, le=ID_MAX)]] | None = Field(
        default=None, description="Extra group ids of every process.", max_length=32
    )
    seccomp_profile: SeccompProfile | None = Field(
        default=None, description="Seccomp profile of the pod (default: RuntimeDefault)."
    )


class ContainerSecurityContext(ApiModel):
    """Container-level core/v1 SecurityContext fields a job may set for its containers (trainer
    and rendezvous); each one given replaces the operator's default of that field."""

    run_as_user: int | None = Field(
        default=None, description="User id of the container's processes.", ge=0, le=ID_MAX
    )
    run_as_group: int | None = Field(
        default=None, description="Primary group id of the container's processes.", ge=0,
        le=ID_MAX,
    )
    run_as_non_root: bool | None = Field(
        default=None, description="Refuse to start the container as root."
    )
    read_only_root_filesystem: bool | None = Field(
        default=None, description="Mount the container's root filesystem read-only."
    )
    allow_privilege_escalation: bool | None = Field(
        default=None,
        description="Whether a process may gain more privileges than its parent (default: false).",
    )
    capabilities: Capabilities | None = Field(
        default=None,
        description=(
            "Capabilities (default: drop ALL). IPC_LOCK is added by memoryLock, not here."
        ),
    )
    seccomp_profile: SeccompProfile | None = Field(
        default=None, description="Seccomp profile of the container (default: the pod's)."
    )


class PodTemplate(ApiModel):
    """Overrides applied to every pod of the job (trainers and rendezvous), so that queueing
    systems (Kueue, Volcano) and cluster policies can place the job."""

    labels: dict[LabelKey, LabelValue] = Field(
        default_factory=dict, description="Labels added to every pod.", max_length=64
    )
    annotations: dict[LabelKey, AnnotationValue] = Field(
        default_factory=dict, description="Annotations added to every pod.", max_length=64
    )
    node_selector: dict[LabelKey, LabelValue] = Field(
        default_factory=dict,
        description="Node labels a pod requires, merged over the instance profile's selector.",
        max_length=32,
    )
    tolerations: list[Toleration] = Field(
        default_factory=list, description="Tolerations of every pod.", max_length=64
    )
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="core/v1 Affinity of every pod (node, pod and pod anti-affinity).",
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )
    priority_class_name: str | None = Field(
        default=None,
        description="PriorityClass of the pods.",
        max_length=253,
        pattern=DNS_SUBDOMAIN,
    )
    service_account_name: str | None = Field(
        default=None,
        description="ServiceAccount the pods run as.",
        max_length=253,
        pattern=DNS_SUBDOMAIN,
    )
    scheduler_name: str | None = Field(
        default=None,
        description="Scheduler that places the pods (for example `volcano`).",
        max_length=253,
    )
    termination_grace_period_seconds: int | None = Field(
        default=None,
        description=(
            "Seconds a trainer gets between SIGTERM and SIGKILL (default 120). On SIGTERM the "
            "trainers commit a checkpoint of their current step before they exit; size it for "
            "one or two saves of a rank's shard."
        ),
        ge=0,
        le=86400,
    )
    security_context: PodSecurityContext | None = Field(
        default=None,
        description=(
            "Pod security context, merged field by field over the operator's defaults "
            "(runAsNonRoot true, seccompProfile RuntimeDefault), for example fsGroup."
        ),
    )
    container_security_context: ContainerSecurityContext | None = Field(
        default=None,
        description=(
            "Security context of the trainer and rendezvous containers, merged field by field "
            "over the operator's defaults (allowPrivilegeEscalation false, capabilities drop "
            "ALL)."
        ),
    )
    memory_lock: bool = Field(
        default=False,
        description=(
            "Add the IPC_LOCK capability to the trainer container, so it may pin any amount of "
            "memory (EFA registers memory for RDMA). Needed only where the container runtime "
            "caps the memlock limit; IPC_LOCK is outside Pod Security `baseline`, so the "
            "namespace must allow `privileged`."
        ),
    )
    automount_service_account_token: bool = Field(
        default=False,
        description=(
            "Mount the ServiceAccount's API token into the pods (the trainer does not use the "
            "API; default false)."
        ),
    )


# --- spec -------------------------------------------------------------------------------------


def _only_while_suspended(field_name: str) -> dict[str, str]:
    return cel(
        f"self.{field_name} == oldSelf.{field_name} || oldSelf.suspend",
        f"{field_name} may change only while the job is suspended",
        field_path=f".{field_name}",
    )


def _only_while_suspended_optional(field_name: str) -> dict[str, str]:
    same = _same_optional(field_name, field_name)["rule"]
    return cel(
        f"({same}) || oldSelf.suspend",
        f"{field_name} may change only while the job is suspended",
        field_path=f".{field_name}",
    )


def _nested_only_while_suspended(
    parent: str, field_name: str, non_default: str | None = None
) -> dict[str, str]:
    """`parent.field_name` may change only while suspended. Integers are compared as they are
    (absent reads as -1); an enum of two values is compared through its non-default value, since
    comparing two strings of unbounded length costs too much in CEL's budget."""
    def value(side: str) -> str:
        present = f"has({side}.{parent}) && has({side}.{parent}.{field_name})"
        if non_default is None:
            return f"({present} ? {side}.{parent}.{field_name} : -1)"
        return f"({present} && {side}.{parent}.{field_name} == '{non_default}')"
    return cel(
        f"{value('self')} == {value('oldSelf')} || oldSelf.suspend",
        f"{parent}.{field_name} may change only while the job is suspended (the running pods "
        "read it; pods created later would disagree with them)",
        field_path=f".{parent}.{field_name}",
    )


POD_READ_SETTINGS: tuple[tuple[str, str, str | None], ...] = (
    ("checkpoint", "intervalSteps", None),
    ("checkpoint", "mode", "Sync"),
    ("faultTolerance", "inProcessRestart", "Disabled"),
    ("faultTolerance", "heartbeatTimeoutSeconds", None),
    ("faultTolerance", "initialHeartbeatTimeoutSeconds", None),
    ("faultTolerance", "faultInjection", "Enabled"),
)
"""Settings the trainers read at start: changing them while pods run would split the job (a
replacement with another checkpoint mode or interval, or without in-process restart, would not
match the running ranks' collectives). They change only while the job is suspended."""


PROFILE_REQUIRED_MESSAGE = (
    "resources is required when instanceType has no built-in profile (built-in: "
    + ", ".join(profiles.BUILT_IN_PROFILES)
    + ")"
)


class ResilientTrainingJobSpec(ApiModel):
    """Desired state of a ResilientTrainingJob: a multi-node PyTorch training run that survives
    node and process faults by restarting only what failed and resuming from checkpoints."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            cel(
                "self.instanceType in "
                + json.dumps(list(profiles.BUILT_IN_PROFILES)).replace('"', "'")
                + " || has(self.resources)",
                PROFILE_REQUIRED_MESSAGE,
                field_path=".resources",
                reason="FieldValueRequired",
            ),
            _same_optional("procsPerNode", "procsPerNode"),
            _only_while_suspended("nodes"),
            _only_while_suspended("image"),
            _only_while_suspended("command"),
            _only_while_suspended("args"),
            _only_while_suspended("env"),
            _only_while_suspended_optional("resources"),
            _only_while_suspended_optional("podTemplate"),
            cel(
                "!has(self.env) || !self.env.exists(e, e.name == 'TRAINER_FAULTS') || "
                "(has(self.faultTolerance) && has(self.faultTolerance.faultInjection) && "
                "self.faultTolerance.faultInjection == 'Enabled')",
                "env TRAINER_FAULTS needs faultTolerance.faultInjection: Enabled",
                field_path=".env",
            ),
            *(_nested_only_while_suspended(parent, name, other)
              for parent, name, other in POD_READ_SETTINGS),
            cel(
                "!has(self.faultTolerance) || !has(oldSelf.faultTolerance) || "
                "(has(self.faultTolerance.spares) ? self.faultTolerance.spares : 0) == "
                "(has(oldSelf.faultTolerance.spares) ? oldSelf.faultTolerance.spares : 0) || "
                "oldSelf.suspend",
                "faultTolerance.spares may change only while the job is suspended",
                field_path=".faultTolerance.spares",
            ),
        )
    )

    nodes: int = Field(
        description=(
            "Number of nodes (one trainer pod per node, named `<job>-<index>`). May change only "
            "while the job is suspended; on resume every pod starts at the new size. A new size "
            "does not resume from the last checkpoint: checkpoints are per-rank shards, rejected "
            "at another world size, so training starts again from step 0."
        ),
        ge=1,
        le=MAX_NODES,
    )
    instance_type: str = Field(
        default=profiles.DEFAULT_INSTANCE_TYPE,
        description=(
            "EC2 instance type of the nodes. A built-in profile ("
            + ", ".join(profiles.BUILT_IN_PROFILES)
            + ") gives GPU, EFA, hugepages, CPU and memory requests and the node selector; other "
            "types need resources. Immutable."
        ),
        min_length=1,
        max_length=63,
        json_schema_extra=immutable("instanceType"),
    )
    procs_per_node: int | None = Field(
        default=None,
        description=(
            "Worker processes per node (ranks per pod); default: the profile's (one per GPU), "
            "or 1 without a profile. Immutable."
        ),
        ge=1,
        le=MAX_PROCS_PER_NODE,
    )
    resources: Resources | None = Field(
        default=None,
        description=(
            "Requests and limits of each trainer pod, merged over the instance profile's key by "
            "key; required for instance types without a built-in profile."
        ),
    )
    image: str = Field(description="Container image of the trainer.", min_length=1, max_length=1024)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="When the kubelet pulls the image."
    )
    command: list[Argument] = Field(
        default_factory=lambda: ["python", "-m", "rtj_trainer"],
        description=(
            "Entrypoint argv of each worker process (never a shell string); ft_launcher runs it "
            "procsPerNode times per pod."
        ),
        min_length=1,
        max_length=64,
        json_schema_extra={"default": ["python", "-m", "rtj_trainer"]},
    )
    args: list[Argument] = Field(
        default_factory=list,
        description="Arguments appended to command, for example `[--preset, tiny]`.",
        max_length=256,
        json_schema_extra={"default": []},
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        description="Environment variables of the trainer container (names unique).",
        max_length=128,
        json_schema_extra={
            "default": [],
            "x-kubernetes-list-type": "map",
            "x-kubernetes-list-map-keys": ["name"],
        },
    )
    checkpoint: Checkpoint = Field(
        description="Checkpoint volume and policy. The trainer resumes from the newest committed "
        "checkpoint after any restart."
    )
    fault_tolerance: FaultTolerance = Field(
        default_factory=FaultTolerance,
        description="Fault detection timeouts, recovery strategy and restart budgets.",
        json_schema_extra={"default": FaultTolerance().to_api()},
    )
    suspend: bool = Field(
        default=False,
        description=(
            "`true` deletes the job's pods (the checkpoint volume stays); `false` starts them "
            "again, resuming from the last checkpoint. Queueing systems such as Kueue use it."
        ),
    )
    active_deadline_seconds: int | None = Field(
        default=None,
        description="The job fails with reason `DeadlineExceeded` after running this long.",
        ge=1,
        le=INT32_MAX,
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        description="Delete the job this many seconds after it succeeded or failed.",
        ge=0,
        le=INT32_MAX,
    )
    pod_template: PodTemplate | None = Field(
        default=None,
        description=(
            "Labels, annotations and scheduling settings added to every pod; may change only "
            "while the job is suspended."
        ),
    )

    @model_validator(mode="after")
    def _resources_without_profile(self) -> Self:
        if self.instance_type not in profiles.BUILT_IN_PROFILES and self.resources is None:
            raise ValueError(PROFILE_REQUIRED_MESSAGE)
        names = [e.name for e in self.env]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"env: duplicate names {duplicates}")
        if "TRAINER_FAULTS" in names and self.fault_tolerance.fault_injection != "Enabled":
            raise ValueError("env TRAINER_FAULTS needs faultTolerance.faultInjection: Enabled")
        return self


# --- the resource -----------------------------------------------------------------------------

JOB_NAME_RULE = cel(
    f"self.metadata.name.size() <= {MAX_JOB_NAME_LENGTH} "
    "&& self.metadata.name.matches('" + DNS_LABEL_1035 + "')",
    f"metadata.name must be at most {MAX_JOB_NAME_LENGTH} characters of lower-case letters, "
    "digits and '-', starting with a letter: pod hostnames `<name>-<index>` and the Service "
    "`<name>-rdzv` are derived from it and must be DNS labels",
    field_path=".metadata.name",
    reason="FieldValueInvalid",
)


class ObjectMeta(BaseModel):
    """The parts of metav1.ObjectMeta the operator reads; other fields are kept but not typed."""

    model_config = ConfigDict(populate_by_name=True, extra="allow", alias_generator=to_camel)

    name: str | None = None
    namespace: str | None = None
    uid: str | None = None
    generation: int | None = None
    resource_version: str | None = None
    creation_timestamp: datetime | None = None
    deletion_timestamp: datetime | None = None
    labels: dict[str, str] = Field(default_factory=dict)
    annotations: dict[str, str] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _name_fits_pod_hostnames(cls, name: str | None) -> str | None:
        if name is not None and (
            len(name) > MAX_JOB_NAME_LENGTH or not re.fullmatch(DNS_LABEL_1035, name)
        ):
            raise ValueError(JOB_NAME_RULE["message"])
        return name


class ResilientTrainingJob(ApiModel):
    """A multi-node PyTorch training job that recovers from faults by restarting only the failed
    rank where it can, bounded by restart budgets, and reports its progress in status."""

    model_config = ConfigDict(json_schema_extra=validations(JOB_NAME_RULE))

    api_version: Literal["training.resilient.dev/v1alpha1"] = Field(
        default="training.resilient.dev/v1alpha1", description="training.resilient.dev/v1alpha1"
    )
    kind: Literal["ResilientTrainingJob"] = Field(
        default="ResilientTrainingJob", description="ResilientTrainingJob"
    )
    metadata: ObjectMeta = Field(default_factory=ObjectMeta, description="Standard metadata.")
    spec: ResilientTrainingJobSpec
    status: ResilientTrainingJobStatus | None = None

    @property
    def name(self) -> str:
        if self.metadata.name is None:
            raise ValueError("metadata.name is not set")
        return self.metadata.name

    @property
    def checkpoint_dir(self) -> str:
        """RTJ_CHECKPOINT_DIR: `<mountPath>/<path>`, where path defaults to
        `<namespace>/<name>` (scoped to the job; the UID is left out on purpose, so that a job
        deleted and applied again resumes)."""
        if self.metadata.namespace is None and self.spec.checkpoint.path is None:
            raise ValueError("metadata.namespace is not set")
        sub = self.spec.checkpoint.path or f"{self.metadata.namespace}/{self.name}"
        return f"{self.spec.checkpoint.mount_path.rstrip('/')}/{sub}"

    @property
    def checkpoint_claim_name(self) -> str:
        """Claim mounted by every trainer pod: the given one or `<name>-checkpoints`."""
        return self.spec.checkpoint.claim_name or f"{self.name}-checkpoints"


def plain(value: Any) -> Any:
    """Deep copy of a Mapping/sequence tree into dicts and lists (kopf bodies are views)."""
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def parse_job(body: Mapping[str, Any]) -> ResilientTrainingJob:
    """Parse a ResilientTrainingJob object (a kopf body, a dict, a loaded YAML document).

    Raises pydantic.ValidationError whose messages name the offending field.
    """
    return ResilientTrainingJob.model_validate(plain(body))


def parse_status(status: Mapping[str, Any]) -> ResilientTrainingJobStatus:
    """Parse only a status, as stored on the server."""
    return ResilientTrainingJobStatus.model_validate(plain(status))
