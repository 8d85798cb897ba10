"""The argv of a trainer container: `ft_launcher <flags derived from the spec> <command> <args>`,
and the argv of the rendezvous container (`nvrx-control`).

Pure functions of the parsed job and the operator settings. Every flag was checked against
`ft_launcher --help` / `nvrx-control --help` of nvidia-resiliency-ext 0.7.0; the reasons for the
values are in docs/nvrx.md sections 2 and 7 (and docs/operator.md).
"""

from __future__ import annotations

from rtj_operator import naming, profiles
from rtj_operator.api.models import ResilientTrainingJob
from rtj_operator.config import OperatorSettings

DEFAULT_TERMINATION_GRACE_PERIOD_SECONDS = 30
"""Kubernetes' default; used when spec.podTemplate.terminationGracePeriodSeconds is not set."""

GPU_MEMORY_RECLAIM_TIMEOUT_SECONDS = 50
"""ft_launcher's default wait for GPU memory to be freed between worker restarts."""


def requested_count(resolved: profiles.ResolvedResources, resource: str) -> int:
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


def trainer_argv(job: ResilientTrainingJob, settings: OperatorSettings) -> list[str]:
    """The trainer container's argv: ft_launcher, its flags, then the worker's argv.

    `$(POD_IP)` is expanded by the kubelet from the container's env (downward API).
    """
    spec = job.spec
    ft = spec.fault_tolerance
    resolved = profiles.resolve_profile(spec)
    gpus = requested_count(resolved, profiles.GPU_RESOURCE)
    grace = termination_grace_period_seconds(job)
    return [
        "ft_launcher",
        f"--nnodes={spec.nodes}",
        f"--nproc-per-node={resolved.procs_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rendezvous_endpoint(job, settings)}",
        f"--rdzv-id={rendezvous_id(job)}",
        # The store lives in the rendezvous pod (nvrx-control), never in a trainer pod: losing
        # the pod that hosts the store loses the job (nvrx.md E5/E6).
        f"--rdzv-conf=is_host=false,join_timeout={settings.rendezvous_join_timeout_seconds}",
        # The node address is the pod IP; it also becomes MASTER_ADDR on group rank 0.
        "--local-addr=$(POD_IP)",
        # ft_launcher's default is 0 restarts.
        f"--max-restarts={ft.launcher_max_restarts}",
        f"--term-timeout={term_timeout_seconds(grace)}",
        # NVRx 0.7.0 has no default heartbeat timeouts: nothing is detected unless set.
        f"--ft-initial-rank-heartbeat-timeout={ft.initial_heartbeat_timeout_seconds}",
        f"--ft-rank-heartbeat-timeout={ft.heartbeat_timeout_seconds}",
        # Without GPUs there is no memory to wait for (and no NVML to ask).
        f"--ft-gpu-memory-reclaim-timeout={GPU_MEMORY_RECLAIM_TIMEOUT_SECONDS if gpus else 0}",
        "--no-python",
        *spec.command,
        *spec.args,
    ]


def rendezvous_argv(job: ResilientTrainingJob, settings: OperatorSettings) -> list[str]:
    """The rendezvous container's argv: nvrx-control hosting the store and the rounds."""
    return [
        "nvrx-control",
        f"--nnodes={job.spec.nodes}",
        f"--rdzv-endpoint=$(POD_IP):{settings.rendezvous_port}",
        f"--rdzv-id={rendezvous_id(job)}",
        f"--rdzv-conf=join_timeout={settings.rendezvous_join_timeout_seconds}",
        "--local-addr=$(POD_IP)",
        # Log funnelling is on by default and then needs a log path, else nvrx-control refuses
        # to start (nvrx.md E6).
        "--ft-enable-log-server",
        "false",
    ]
