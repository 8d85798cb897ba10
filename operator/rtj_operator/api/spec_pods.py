"""What each pod is made of beyond the instance profile: `spec.resources` (requests and limits
merged over the profile's) and `spec.podTemplate` (labels, annotations, scheduling, tolerations
and the security contexts of the pod and its containers).
"""

from __future__ import annotations

import copy
from typing import Annotated, Any, Literal, Self

from pydantic import ConfigDict, Field, model_validator

from rtj_operator.api.schema import ApiModel
from rtj_operator.api.spec_fields import (
    DNS_SUBDOMAIN,
    AnnotationValue,
    LabelKey,
    LabelValue,
    Quantity,
    cel,
    validations,
)


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


RESERVED_VOLUMES = ("checkpoints", "dshm")
"""Volume names the operator gives the trainer pods itself (CHECKPOINT_VOLUME and SHM_VOLUME
of rtj_operator.naming)."""
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
NAMED_OBJECT: dict[str, Any] = {"type": "object", "required": ["name"],
                "properties": {"name": {"type": "string", "maxLength": 63,
                                        "description": "Its name, unique in its list."}},
                "x-kubernetes-preserve-unknown-fields": True}
"""The schema of a core/v1 object kept whole (a Volume, a Container) whose `name` the CEL rules
read."""


class VolumeMount(ApiModel):
    """A core/v1 VolumeMount of the trainer container."""

    name: str = Field(
        description="A volume of podTemplate.volumes, or `checkpoints` (the checkpoint volume).",
        max_length=63,
        pattern=DNS_LABEL,
    )
    mount_path: str = Field(
        description="Where it is mounted; not /dev/shm (the operator's) nor the checkpoint "
        "volume's mountPath.",
        min_length=1,
        max_length=1024,
        pattern=r"^/",
    )
    sub_path: str | None = Field(
        default=None, description="A path inside the volume to mount instead of its root.",
        max_length=1024)
    read_only: bool = Field(default=False, description="Mount read-only.")


def _objects_named(field_name: str, *, reserved: tuple[str, ...] = ()) -> dict[str, str]:
    """CEL: every object of the list has a unique DNS-label `name`, none of `reserved`."""
    banned = "".join(f" && o.name != '{name}'" for name in reserved)
    return cel(
        f"!has(self.{field_name}) || (self.{field_name}.all(o, "
        f"o.name.matches('{DNS_LABEL}'){banned}) && self.{field_name}.all(o, "
        f"self.{field_name}.exists_one(p, p.name == o.name)))",
        f"{field_name}: every item needs a unique name (a DNS label"
        + (f", not {' or '.join(reserved)}" if reserved else "") + ")",
        field_path=f".{field_name}",
    )


class PodTemplate(ApiModel):
    """Overrides applied to every pod of the job (trainers and rendezvous), so that queueing
    systems (Kueue, Volcano) and cluster policies can place the job, and what a team's own image
    needs in its trainer pods (extra volumes, init containers, pull secrets, envFrom)."""

    model_config = ConfigDict(
        json_schema_extra=validations(
            _objects_named("volumes", reserved=RESERVED_VOLUMES),
            _objects_named("initContainers"),
            cel(
                "!has(self.volumeMounts) || self.volumeMounts.all(m, m.name == 'checkpoints' || "
                "(has(self.volumes) && self.volumes.exists(v, v.name == m.name)))",
                "volumeMounts: each names a volume of podTemplate.volumes, or `checkpoints`",
                field_path=".volumeMounts",
            ),
            cel(
                "!has(self.volumeMounts) || self.volumeMounts.all(m, m.mountPath != '/dev/shm')",
                "volumeMounts: /dev/shm is the operator's (size it with podTemplate.shmSize)",
                field_path=".volumeMounts",
            ),
        )
    )

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
    volumes: list[dict[str, Any]] = Field(
        default_factory=list,
        description=(
            "Extra volumes of the trainer pods (core/v1 Volume: a dataset's claim, a Hugging "
            "Face cache, a ConfigMap, an emptyDir shared with an init container); names other "
            "than `checkpoints` and `dshm`. Mount them with volumeMounts."
        ),
        max_length=32,
        json_schema_extra={"items": copy.deepcopy(NAMED_OBJECT)},
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list,
        description="Extra mounts of the trainer container.",
        max_length=32,
    )
    init_containers: list[dict[str, Any]] = Field(
        default_factory=list,
        description=(
            "Init containers of the trainer pods (core/v1 Container), run before the trainer "
            "in every pod (and again in a replacement pod): for example a download of a model "
            "or dataset into a volume of podTemplate.volumes. Their securityContext gets the "
            "same defaults as the trainer's."
        ),
        max_length=8,
        json_schema_extra={"items": copy.deepcopy(NAMED_OBJECT)},
    )
    image_pull_secrets: list[Annotated[str, Field(max_length=253, pattern=DNS_SUBDOMAIN)]] = (
        Field(default_factory=list,
              description="Secrets (names) the kubelet pulls every pod's images with.",
              max_length=16))
    env_from: list[dict[str, Any]] = Field(
        default_factory=list,
        description=(
            "Sources of the trainer container's environment (core/v1 EnvFromSource: a "
            "ConfigMap or Secret; spec.env and the operator's variables win over them)."
        ),
        max_length=16,
        json_schema_extra={"items": {"type": "object",
                                     "x-kubernetes-preserve-unknown-fields": True}},
    )
    working_dir: str | None = Field(
        default=None, description="The trainer container's working directory.",
        max_length=1024, pattern=r"^/")
    shm_size: Quantity | None = Field(
        default=None,
        description=(
            "Size of the trainer pods' memory-backed /dev/shm (NCCL, DataLoader workers). "
            "Default: the instance profile's, or 1Gi for an instance type without one."
        ),
    )

    @model_validator(mode="after")
    def _named_volumes(self) -> Self:
        names = [v.get("name") for v in self.volumes]
        for name in names:
            if not isinstance(name, str) or name in RESERVED_VOLUMES or names.count(name) > 1:
                raise ValueError(f"podTemplate.volumes: every volume needs a unique name, not "
                                 f"{' or '.join(RESERVED_VOLUMES)} (got {name!r})")
        for mount in self.volume_mounts:
            if mount.name != "checkpoints" and mount.name not in names:
                raise ValueError(f"podTemplate.volumeMounts: {mount.name!r} is not a volume of "
                                 "podTemplate.volumes (nor `checkpoints`)")
            if mount.mount_path.rstrip("/") == "/dev/shm":
                raise ValueError("podTemplate.volumeMounts: /dev/shm is the operator's (size it "
                                 "with podTemplate.shmSize)")
        containers = [c.get("name") for c in self.init_containers]
        for name in containers:
            if not isinstance(name, str) or containers.count(name) > 1:
                raise ValueError(f"podTemplate.initContainers: every container needs a unique "
                                 f"name (got {name!r})")
        return self
