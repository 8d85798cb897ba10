"""Pydantic models of the ResilientTrainingJob resource: the single source of truth of the API.

This module holds the resource, its metadata and its spec. Each section of the spec has a module
of its own: `spec_env.py` (`env`), `spec_checkpoint.py` (`checkpoint`), `spec_fault_tolerance.py`
(`faultTolerance`), `spec_pods.py` (`resources`, `podTemplate`), with the field types and CEL
helpers they share in `spec_fields.py`. The status is `status.py`, written in the words of
`vocabulary.py`.

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

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from rtj_operator import profiles
from rtj_operator.api.schema import MAX_NODES as MAX_NODES
from rtj_operator.api.schema import ApiModel as ApiModel
from rtj_operator.api.spec_checkpoint import Checkpoint
from rtj_operator.api.spec_env import EnvVar
from rtj_operator.api.spec_fault_tolerance import FaultTolerance
from rtj_operator.api.spec_fields import (
    DNS_LABEL_1035,
    INT32_MAX,
    Argument,
    cel,
    immutable,
    same_optional,
    validations,
)
from rtj_operator.api.spec_pods import PodTemplate, Resources
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

# --- spec -------------------------------------------------------------------------------------


def _only_while_suspended(field_name: str) -> dict[str, str]:
    return cel(
        f"self.{field_name} == oldSelf.{field_name} || oldSelf.suspend",
        f"{field_name} may change only while the job is suspended",
        field_path=f".{field_name}",
    )


def _only_while_suspended_optional(field_name: str) -> dict[str, str]:
    same = same_optional(field_name, field_name)["rule"]
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
    ("faultTolerance", "inProcessRestart", "Enabled"),
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


BUILT_IN_TRAINER_COMMAND = ("python", "-m", "rtj_trainer")
BUILT_IN_TRAINER_CEL = (
    "!has(self.command) || (self.command.size() >= 3 && "
    "self.command[0].matches('^(.*/)?python[0-9.]*$') && self.command[1] == '-m' && "
    "self.command[2] == 'rtj_trainer')"
)
"""The CEL form of `runs_builtin_trainer`."""
SPARES_COMMAND_MESSAGE = (
    "faultTolerance.spares needs in-process restart, which a command other than the built-in "
    "trainer (`python -m rtj_trainer`) gets only with faultTolerance.inProcessRestart: Enabled "
    "(the worker must run NVRx's in-process wrapper)"
)


def runs_builtin_trainer(command: Sequence[str]) -> bool:
    """Whether `command` is the built-in trainer: `<python> -m rtj_trainer` (any python binary,
    by name or path). Every other command is a team's own script (docs/byo.md): no in-process
    restart or warm workers by default, and hang detection only from what it reports."""
    return (len(command) >= 3 and re.fullmatch(r"(.*/)?python[0-9.]*", command[0]) is not None
            and command[1] == "-m" and command[2] == "rtj_trainer")


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
            same_optional("procsPerNode", "procsPerNode"),
            _only_while_suspended("nodes"),
            _only_while_suspended("image"),
            _only_while_suspended("command"),
            _only_while_suspended("args"),
            _only_while_suspended("env"),
            _only_while_suspended_optional("resources"),
            _only_while_suspended_optional("podTemplate"),
            _only_while_suspended_optional("rendezvousImage"),
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
                "!has(self.podTemplate) || !has(self.podTemplate.volumeMounts) || "
                "!has(self.checkpoint.mountPath) || self.podTemplate.volumeMounts.all(m, "
                "m.mountPath != self.checkpoint.mountPath)",
                "podTemplate.volumeMounts: the checkpoint volume's mountPath is taken",
                field_path=".podTemplate.volumeMounts",
            ),
            cel(
                "!has(self.faultTolerance) || !has(self.faultTolerance.spares) || "
                "self.faultTolerance.spares == 0 || (has(self.faultTolerance.inProcessRestart) "
                "&& self.faultTolerance.inProcessRestart == 'Enabled') || "
                + BUILT_IN_TRAINER_CEL,
                SPARES_COMMAND_MESSAGE,
                field_path=".faultTolerance.spares",
            ),
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
            "while the job is suspended; on resume every pod starts at the new size and resumes "
            "from the newest committed checkpoint, resharded for the new world size."
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
    image: str = Field(
        description=(
            "Container image of the trainer pods. It runs the launcher shim (`python -m "
            "rtj_trainer.launcher`), so it needs the trainer package (`pip install` of the "
            "wheel built from this repository) with nvidia-resiliency-ext 0.7.0 and torch; a "
            "team's own code and packages beside it (docs/byo.md)."
        ),
        min_length=1, max_length=1024)
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="When the kubelet pulls the image."
    )
    rendezvous_image: str | None = Field(
        default=None,
        description=(
            "Image of the rendezvous pod, which runs NVRx's `nvrx-control` (needs "
            "nvidia-resiliency-ext 0.7.0, nothing else of the trainer's). Default: `image`. Set "
            "it when a team's own image is large or lacks NVRx's console scripts."
        ),
        min_length=1,
        max_length=1024,
    )
    command: list[Argument] = Field(
        default_factory=lambda: ["python", "-m", "rtj_trainer"],
        description=(
            "Entrypoint argv of each worker process (never a shell string); ft_launcher runs it "
            "procsPerNode times per pod. Default: the built-in trainer. Any other command is a "
            "team's own script: it gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT "
            "and the RTJ_* variables (RTJ_CHECKPOINT_DIR among them); it must leave ports "
            "RTJ_METRICS_PORT-1 and up and exit codes 93-95 alone; on its pod's end it gets "
            "SIGTERM, then SIGKILL after the grace period (SIGUSR2 first, to checkpoint, when "
            "it uses the trainer's library); it is watched for hangs when it sends NVRx "
            "heartbeats (RankMonitorClient) or uses the trainer's library, which also reports "
            "step, loss and goodput. Contract: docs/byo.md."
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
        if self.fault_tolerance.spares and not self.in_process_restart_enabled:
            raise ValueError(SPARES_COMMAND_MESSAGE)
        mounts = self.pod_template.volume_mounts if self.pod_template is not None else []
        checkpoint_path = self.checkpoint.mount_path.rstrip("/")
        if any(m.mount_path.rstrip("/") == checkpoint_path for m in mounts):
            raise ValueError(f"podTemplate.volumeMounts: {checkpoint_path} is the checkpoint "
                             "volume's mountPath")
        return self

    def pod_spec_hash(self) -> str:
        """16 hex digits of the settings the running pods were built from or read at start:
        the fields that may change only while the job is suspended (`nodes`, `image`,
        `command`, `args`, `env`, `resources`, `podTemplate`, `rendezvousImage` and
        `POD_READ_SETTINGS`). Every pod carries it (label `SPEC_HASH_LABEL`); a pod whose hash
        differs was built from another spec (an edit that reached a running job: suspend, edit
        and resume before a pass saw the suspend), and the job restarts every pod from the new
        spec (decisions.podfaults, review-2 F4)."""
        # Defaults left out: an operator upgrade that adds a field or changes a default must
        # not restart every running job; only values a person set count.
        read = self.model_dump(mode="json", by_alias=True, exclude_none=True,
                               exclude_defaults=True, include={
            "nodes": True, "image": True, "command": True, "args": True, "env": True,
            "resources": True, "pod_template": True, "rendezvous_image": True,
            "checkpoint": {"interval_steps", "mode"},
            "fault_tolerance": {"in_process_restart", "heartbeat_timeout_seconds",
                                "initial_heartbeat_timeout_seconds", "fault_injection"}})
        read = {key: value for key, value in read.items() if value != {}}
        text = json.dumps(read, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def runs_builtin_trainer(self) -> bool:
        """The workers are the built-in trainer (`runs_builtin_trainer`)."""
        return runs_builtin_trainer(self.command)

    @property
    def in_process_restart_enabled(self) -> bool:
        """`faultTolerance.inProcessRestart` resolved: `Auto` is on for the built-in trainer."""
        setting = self.fault_tolerance.in_process_restart
        return setting == "Enabled" or (setting == "Auto" and self.runs_builtin_trainer)


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
RENDEZVOUS_SUFFIX = "-rdzv"
JOB_NAME_SUFFIX_RULE = cel(
    f"!self.metadata.name.endsWith('{RENDEZVOUS_SUFFIX}')",
    f"metadata.name must not end in '{RENDEZVOUS_SUFFIX}': the job named without it has its "
    f"rendezvous Service `<name>{RENDEZVOUS_SUFFIX}`, which would be this job's headless Service "
    "too (each job's pods would resolve to the other's)",
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
        if name is not None and name.endswith(RENDEZVOUS_SUFFIX):
            raise ValueError(JOB_NAME_SUFFIX_RULE["message"])
        return name


class ResilientTrainingJob(ApiModel):
    """A multi-node PyTorch training job that recovers from faults by restarting only the failed
    rank where it can, bounded by restart budgets, and reports its progress in status."""

    model_config = ConfigDict(json_schema_extra=validations(JOB_NAME_RULE,
                                                             JOB_NAME_SUFFIX_RULE))

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
