"""The pod plan: every fact about a job's pods that follows from the spec, resolved once a pass.

A trainer pod needs the same few derived facts in several places: the resources of its instance
profile (requests, limits, node selector, /dev/shm), how many GPUs and EFA devices it asks for
(tolerations, env, `--ft-gpu-memory-reclaim-timeout`), the worker processes per pod (argv, env,
metrics ports, and how many ranks the scraper asks), the grace period and ft_launcher's
`--term-timeout` below it, and the rendezvous id and endpoint (argv and env). They used to be
recomputed by each consumer (`resolve_profile` ran 2 + 3·N times for a pass creating N pods);
`plan_for` computes them once, `reconcile.run_pass` hands the frozen `PodPlan` down, and
`builders`, `launcher` and `scraping` only read it.

`profiles.py` stays pure data (the instance table); the resolution lives here, so the API
models import the table without importing the logic that reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from rtj_operator import naming
from rtj_operator.api.models import ResilientTrainingJob, ResilientTrainingJobSpec
from rtj_operator.config import OperatorSettings
from rtj_operator.profiles import (
    BUILT_IN_PROFILES,
    DEFAULT_PROCS_PER_NODE_WITHOUT_PROFILE,
    EFA_RESOURCE,
    GPU_RESOURCE,
    HUGEPAGES_RESOURCE,
    InstanceProfile,
)

DEFAULT_TERMINATION_GRACE_PERIOD_SECONDS = 120
DEFAULT_SHM_SIZE = "1Gi"
"""/dev/shm of an instance type without a built-in profile (the container runtime's own is 64
MiB, too little for a DataLoader's workers); podTemplate.shmSize sets any size."""
"""The trainer pod's grace period when spec.podTemplate.terminationGracePeriodSeconds is not set.

On SIGTERM (suspend, preemption, deletion, drain) the trainers commit a checkpoint of their
current step before they exit (rtj_trainer.stop), within ft_launcher's `--term-timeout` (this
minus a tenth: 108 s). Sized for a p5.48xlarge: finishing the step in progress (seconds), then
waiting for the previous asynchronous save still being written (at most one save), then
writing the stop save. A rank's shard of the 1B preset (11.3 GB) writes in 7-9 s at the
1.3-1.6 GB/s measured on one H200 node (docs/benchmarks.md), so two saves take under 20 s; 108 s
leaves room for two saves of about 70 GB per rank (a 70B model with Adam over 16 ranks) at that
rate. Jobs with bigger shards or slower storage set a longer one. Kubernetes' own default
(30 s) was too short for that. Pods deleted to recover from a fault get a short one instead
(`decisions.recovery.RECOVERY_GRACE_SECONDS`)."""


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
    """Size limit of the memory-backed /dev/shm emptyDir (podTemplate.shmSize, else the
    profile's, else DEFAULT_SHM_SIZE); None: no dedicated /dev/shm."""
    profile: InstanceProfile | None


@dataclass(frozen=True, kw_only=True)
class PodPlan:
    """The derived facts of a job's pods for one reconcile pass (see the module docstring)."""

    resources: ResolvedResources
    gpus: int
    """GPUs a trainer pod asks for (`nvidia.com/gpu`)."""
    efa_devices: int
    """EFA interfaces a trainer pod asks for (`vpc.amazonaws.com/efa`)."""
    procs_per_node: int
    """Worker processes (ranks) per trainer pod."""
    termination_grace_period_seconds: int
    """The trainer pod's grace period between SIGTERM and SIGKILL."""
    term_timeout_seconds: int
    """ft_launcher's `--term-timeout`, below the grace period (`term_timeout_seconds`)."""
    rendezvous_id: str
    """The job's UID, so a re-created job of the same name never joins its predecessor's rounds."""
    rendezvous_endpoint: str
    """`<job>-rdzv:<port>`: the ClusterIP Service in front of nvrx-control."""
    pods: int
    """Trainer pods (launchers): `spec.nodes` plus `faultTolerance.spares`, indices 0..pods-1;
    the spares hold the highest indices (the highest ranks, which NVRx keeps inactive)."""


def resolve_profile(spec: ResilientTrainingJobSpec) -> ResolvedResources:
    """Resources, env and node selector of a trainer pod for `spec`.

    With a built-in profile: the profile's requests and limits (extended resources and hugepages
    have limits equal to requests, as Kubernetes requires), overridden key by key by
    `spec.resources`. Without one: exactly `spec.resources` (the API requires it then).
    """
    profile = BUILT_IN_PROFILES.get(spec.instance_type)
    requests: dict[str, str] = {}
    limits: dict[str, str] = {}
    node_selector: dict[str, str] = {}
    env: dict[str, str] = {}
    shm_size: str = DEFAULT_SHM_SIZE
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
        if spec.pod_template.shm_size is not None:
            shm_size = spec.pod_template.shm_size
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


def requested_count(resolved: ResolvedResources, resource: str) -> int:
    """How many devices of an extended resource (GPUs, EFA interfaces) a trainer pod asks for."""
    quantity = resolved.limits.get(resource) or resolved.requests.get(resource) or "0"
    try:
        return int(quantity)
    except ValueError:  # extended resources are whole numbers; anything else counts as none
        return 0


def termination_grace_period_seconds(job: ResilientTrainingJob) -> int:
    """The trainer pod's grace period between SIGTERM and SIGKILL."""
    template = job.spec.pod_template
    if template is not None and template.termination_grace_period_seconds is not None:
        return template.termination_grace_period_seconds
    return DEFAULT_TERMINATION_GRACE_PERIOD_SECONDS


def term_timeout_seconds(grace_seconds: int) -> int:
    """ft_launcher's `--term-timeout`, kept below the pod's grace period.

    On SIGTERM the launcher forwards the signal to the workers and SIGKILLs them after
    `--term-timeout` (default 1800 s); it must finish before the kubelet SIGKILLs the launcher,
    so leave a margin of a tenth of the grace period, at least 5 s.
    """
    return max(1, grace_seconds - max(5, grace_seconds // 10))


def rendezvous_endpoint(job: ResilientTrainingJob, settings: OperatorSettings) -> str:
    """`<job>-rdzv:<port>`: the ClusterIP Service in front of nvrx-control."""
    return f"{naming.rendezvous_name(job.name)}:{settings.rendezvous_port}"


def rendezvous_id(job: ResilientTrainingJob) -> str:
    """The rendezvous id: the job's UID, so a re-created job of the same name never joins the
    rounds of its predecessor."""
    if job.metadata.uid is None:
        raise ValueError("metadata.uid is not set")
    return job.metadata.uid


def plan_for(job: ResilientTrainingJob, settings: OperatorSettings) -> PodPlan:
    """The pod plan of `job` under `settings` (raises ValueError when metadata.uid is unset)."""
    resources = resolve_profile(job.spec)
    grace = termination_grace_period_seconds(job)
    return PodPlan(
        resources=resources,
        gpus=requested_count(resources, GPU_RESOURCE),
        efa_devices=requested_count(resources, EFA_RESOURCE),
        procs_per_node=resources.procs_per_node,
        termination_grace_period_seconds=grace,
        term_timeout_seconds=term_timeout_seconds(grace),
        rendezvous_id=rendezvous_id(job),
        rendezvous_endpoint=rendezvous_endpoint(job, settings),
        pods=job.spec.nodes + job.spec.fault_tolerance.spares,
    )
