"""Instance profiles: what a trainer pod needs on a given EC2 GPU instance type.

A user writes `instanceType: p5.48xlarge` and nothing else; this table turns that into the
GPU, EFA, hugepages, CPU and memory requests, the shared-memory size and the node selector that
a pod needs to own the whole instance. Instance types without a built-in profile must give
`spec.resources` explicitly (the CRD enforces that with a CEL rule generated from this table).

The module is pure data and imports nothing of the operator: the API models (`rtj_operator.api`)
read the table for the CRD's enum and CEL rule, and `podplan.resolve_profile` turns a spec into the
resources of its pods. Because the CRD embeds the list of instance types, adding a profile is an
API change: regenerate the CRDs (`make crds`) and re-apply them (docs/api.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

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


# EFA environment of trainer pods. Sources:
# [aws-sample] awslabs/awsome-distributed-training, 3.test_cases/pytorch/nvrx manifests;
# [efa-docs] AWS EFA user guide ("Get started with EFA and NCCL").
LIBFABRIC_EFA_ENV: tuple[tuple[str, str], ...] = (
    # libfabric must pick the EFA provider, never fall back to TCP sockets [aws-sample, efa-docs].
    ("FI_PROVIDER", "efa"),
    # GPUDirect RDMA: EFA reads and writes GPU memory directly on p4d/p5 [efa-docs; the
    # aws-sample Dockerfile says "only for P5; set it in the manifest"].
    ("FI_EFA_USE_DEVICE_RDMA", "1"),
)
"""The libfabric settings of an EFA instance type: the `env` of the built-in profiles."""
EFA_ENV: tuple[tuple[str, str], ...] = (
    *LIBFABRIC_EFA_ENV,
    # ft_launcher and dataloaders fork/spawn processes after libfabric is loaded; make
    # libfabric's EFA provider and rdma-core safe across fork [aws-sample].
    ("FI_EFA_FORK_SAFE", "1"),
    ("RDMAV_FORK_SAFE", "1"),
)
"""Everything a trainer pod that gets EFA devices needs (the builders add it)."""

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
            env=dict(LIBFABRIC_EFA_ENV),
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
            env=dict(LIBFABRIC_EFA_ENV),
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
            env=dict(LIBFABRIC_EFA_ENV),
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
            env=dict(LIBFABRIC_EFA_ENV),
        ),
    )
}

DEFAULT_INSTANCE_TYPE = "p5.48xlarge"
DEFAULT_PROCS_PER_NODE_WITHOUT_PROFILE = 1

