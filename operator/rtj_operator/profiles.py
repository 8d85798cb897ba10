"""Instance profiles: what a trainer pod needs on a given EC2 GPU instance type.

A user writes `instanceType: p5.48xlarge` and nothing else; this table turns that into the
GPU, EFA, hugepages, CPU and memory requests, the shared-memory size and the node selector that
a pod needs to own the whole instance. Instance types without a built-in profile must give
`spec.resources` explicitly (the CRD enforces that with a CEL rule generated from this table).

The module is pure data plus one pure function, `resolve_profile`, so both the CRD generator
(`rtj_operator.api`) and the pod builder of the operator use the same facts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # models import this module for the table; avoid the import cycle at runtime
    from rtj_operator.api.models import ResilientTrainingJobSpec

GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
HUGEPAGES_RESOURCE = "hugepages-2Mi"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


@dataclass(frozen=True, kw_only=True)
class InstanceProfile:
    """Facts about one instance type and the requests that reserve the whole instance for a pod."""

    instance_type: str
    gpus: int
    """NVIDIA GPUs per instance (`nvidia.com/gpu`)."""
    efa_devices: int
    """EFA network interfaces per instance (`vpc.amazonaws.com/efa`)."""
    hugepages_2mi: str
    """2 MiB hugepages for libfabric/EFA (a quantity)."""
    cpu_request: str
    """CPU request: the instance's vCPUs minus headroom for kubelet and daemonsets."""
    memory_request: str
    """Memory request: the instance's memory minus headroom for the system."""
    shm_size: str
    """Size limit of the memory-backed /dev/shm (NCCL and dataloader workers use it)."""
    default_procs_per_node: int
    """Worker processes per pod when `spec.procsPerNode` is not given (one per GPU)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Environment the trainer container gets on this instance type (libfabric settings)."""

    @property
    def node_selector(self) -> dict[str, str]:
        return {INSTANCE_TYPE_LABEL: self.instance_type}


_EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1"}

BUILT_IN_PROFILES: Mapping[str, InstanceProfile] = {
    p.instance_type: p
    for p in (
        # 8x H100 80 GB, 192 vCPU, 2048 GiB, 32 EFA (3200 Gbps EFAv2).
        InstanceProfile(
            instance_type="p5.48xlarge",
            gpus=8,
            efa_devices=32,
            hugepages_2mi="5120Mi",
            cpu_request="184",
            memory_request="1800Gi",
            shm_size="256Gi",
            default_procs_per_node=8,
            env=_EFA_ENV,
        ),
        # 8x H200 141 GB, 192 vCPU, 2048 GiB, 32 EFA (3200 Gbps EFAv2): the p5 host with H200s.
        InstanceProfile(
            instance_type="p5e.48xlarge",
            gpus=8,
            efa_devices=32,
            hugepages_2mi="5120Mi",
            cpu_request="184",
            memory_request="1800Gi",
            shm_size="256Gi",
            default_procs_per_node=8,
            env=_EFA_ENV,
        ),
        # 8x A100 40 GB, 96 vCPU, 1152 GiB, 4 EFA (400 Gbps).
        InstanceProfile(
            instance_type="p4d.24xlarge",
            gpus=8,
            efa_devices=4,
            hugepages_2mi="5120Mi",
            cpu_request="88",
            memory_request="1000Gi",
            shm_size="128Gi",
            default_procs_per_node=8,
            env=_EFA_ENV,
        ),
        # 8x A100 80 GB, otherwise the p4d host.
        InstanceProfile(
            instance_type="p4de.24xlarge",
            gpus=8,
            efa_devices=4,
            hugepages_2mi="5120Mi",
            cpu_request="88",
            memory_request="1000Gi",
            shm_size="128Gi",
            default_procs_per_node=8,
            env=_EFA_ENV,
        ),
    )
}

DEFAULT_INSTANCE_TYPE = "p5.48xlarge"
DEFAULT_PROCS_PER_NODE_WITHOUT_PROFILE = 1


@dataclass(frozen=True, kw_only=True)
class ResolvedResources:
    """Everything about a trainer pod that follows from the instance type and `spec.resources`."""

    procs_per_node: int
    requests: dict[str, str]
    limits: dict[str, str]
    node_selector: dict[str, str]
    """The profile's selector merged under `spec.podTemplate.nodeSelector` (the template wins)."""
    env: dict[str, str]
    shm_size: str | None
    """Size limit of a memory-backed /dev/shm emptyDir, or None for no dedicated /dev/shm."""
    profile: InstanceProfile | None


def profile_for(instance_type: str) -> InstanceProfile | None:
    """The built-in profile of an instance type, or None when there is none."""
    return BUILT_IN_PROFILES.get(instance_type)


def resolve_profile(spec: ResilientTrainingJobSpec) -> ResolvedResources:
    """Resources, env and node selector of a trainer pod for `spec`.

    With a built-in profile: the profile's requests and limits (extended resources and hugepages
    have limits equal to requests, as Kubernetes requires), overridden key by key by
    `spec.resources`. Without one: exactly `spec.resources` (the API requires it then).
    """
    profile = profile_for(spec.instance_type)
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    node_selector: dict[str, str] = {}
    env: dict[str, str] = {}
    shm_size: str | None = None
    if profile is not None:
        reserved = {
            GPU_RESOURCE: str(profile.gpus),
            EFA_RESOURCE: str(profile.efa_devices),
            HUGEPAGES_RESOURCE: profile.hugepages_2mi,
        }
        requests = {"cpu": profile.cpu_request, "memory": profile.memory_request, **reserved}
        limits = dict(reserved)
        node_selector = profile.node_selector
        env = dict(profile.env)
        shm_size = profile.shm_size
    if spec.resources is not None:
        requests.update(spec.resources.requests)
        limits.update(spec.resources.limits)
    if spec.pod_template is not None:
        node_selector.update(spec.pod_template.node_selector)
    if spec.procs_per_node is not None:
        procs = spec.procs_per_node
    elif profile is not None:
        procs = profile.default_procs_per_node
    else:
        procs = DEFAULT_PROCS_PER_NODE_WITHOUT_PROFILE
    return ResolvedResources(
        procs_per_node=procs,
        requests=requests,
        limits=limits,
        node_selector=node_selector,
        env=env,
        shm_size=shm_size,
        profile=profile,
    )
