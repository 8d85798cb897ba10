"""What each pod is made of beyond the instance profile: `spec.resources` (requests and limits
merged over the profile's) and `spec.podTemplate` (labels, annotations, scheduling, tolerations
and the security contexts of the pod and its containers).
"""

from __future__ import annotations

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
