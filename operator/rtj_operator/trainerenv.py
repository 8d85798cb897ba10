"""The trainer container's environment: what the operator tells the trainer through it.

`trainer_env` lists every variable a trainer pod gets, in this order: the pod's own identity from
the downward API, the contract with the trainer (the `RTJ_*` variables named in rtj_wire.env,
`GROUP_RANK`; docs/design.md lists them, rtj_trainer.config reads them), the instance's EFA/NCCL
settings (`profiles.EFA_ENV`, `NCCL_ENV`), then `spec.env`, which wins over those defaults. The
builders (`builders.trainer_pod`) put it in the pod.
"""

from __future__ import annotations

from rtj_wire import env

from rtj_operator import profiles
from rtj_operator.api.models import ResilientTrainingJob
from rtj_operator.config import OperatorSettings
from rtj_operator.intents import Manifest
from rtj_operator.podplan import PodPlan

# NCCL environment of trainer pods that get GPUs (the EFA part, `profiles.EFA_ENV`, is instance
# data). Sources: [aws-sample] awslabs/awsome-distributed-training, 3.test_cases/pytorch/nvrx
#   manifests (summarised in docs/nvrx.md section 6); [ofi-nccl] the aws-ofi-nccl wiki
#   "Environment Variables".
NCCL_ENV: tuple[tuple[str, str], ...] = (
    # NCCL's bootstrap and socket traffic must not use loopback or container bridges
    # [aws-sample uses ^docker,lo,veth; ofi-nccl excludes lo,docker0 by default].
    ("NCCL_SOCKET_IFNAME", "^lo,docker,veth"),
    # NVLink SHARP (NVLS) buffers are not released on communicator abort, which in-process
    # restart relies on; the aws-sample sets it on every manifest.
    ("NCCL_NVLS_ENABLE", "0"),
    # The NCCL watchdog aborts the communicator and ends the process on an async error so that
    # ft_launcher sees a failed worker instead of a hang [aws-sample; ft_launcher's default].
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
)


IN_PROCESS_RESTART_NCCL_ENV: tuple[tuple[str, str], ...] = (
    # With in-process restart, CUDA errors seen by the watchdog must not be rethrown into the
    # training thread as fatal [aws-sample in-process manifests].
    ("TORCH_NCCL_RETHROW_CUDA_ERRORS", "0"),
    # The in-process wrapper aborts the communicators of every rank on a fault; 1 (TearDown)
    # would then end the survivors' processes and turn the restart into a launcher restart of
    # all. 2 (CleanUpOnly) aborts the communicator and keeps the process (the trainer also sets
    # it itself, rtj_trainer.resiliency; docs/nvrx.md).
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"),
)


def field_env(name: str, field_path: str) -> Manifest:
    """A variable set from the pod's own fields (the downward API)."""
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": field_path}}}


TERMINATION_MESSAGE_PATH = "/dev/termination-log"
"""The trainer container's terminationMessagePath (Kubernetes' default), also passed to the
trainer as RTJ_TERMINATION_MESSAGE_PATH."""


def _value_env(pairs: list[tuple[str, str]]) -> list[Manifest]:
    return [{"name": name, "value": value} for name, value in pairs]


def trainer_env(
    job: ResilientTrainingJob,
    *,
    plan: PodPlan,
    node_index: int,
    attempt: int,
    settings: OperatorSettings,
) -> list[Manifest]:
    """The trainer container's environment (the contract in docs/design.md), then the
    instance's EFA/NCCL settings, then spec.env (which wins over the EFA/NCCL defaults)."""
    spec = job.spec
    downward = [
        field_env(env.POD_IP, "status.podIP"),
        field_env(env.POD_NAME, "metadata.name"),
        field_env(env.POD_NAMESPACE, "metadata.namespace"),
        # What the operator names when it tells the other pods this one is lost (podloss).
        field_env(env.POD_UID, "metadata.uid"),
        # The metrics server binds the pod IP only.
        field_env(env.METRICS_HOST, "status.podIP"),
    ]
    contract = [
        (env.JOB_NAME, job.name),
        (env.JOB_UID, plan.rendezvous_id),
        (env.NODE_INDEX, str(node_index)),
        # ft_launcher orders nodes by GROUP_RANK: pod <job>-0 hosts global rank 0 (nvrx.md E7).
        ("GROUP_RANK", str(node_index)),
        (env.NNODES, str(spec.nodes)),
        (env.PROCS_PER_NODE, str(plan.procs_per_node)),
        (env.ATTEMPT, str(attempt)),
        (env.CHECKPOINT_DIR, job.checkpoint_dir),
        (env.CHECKPOINT_INTERVAL_STEPS, str(spec.checkpoint.interval_steps)),
        (env.CHECKPOINT_KEEP, str(spec.checkpoint.keep)),
        (env.CHECKPOINT_MODE, spec.checkpoint.mode.lower()),
        (env.METRICS_PORT, str(settings.trainer_metrics_port)),
        (env.INPROCESS_RESTART, "1" if spec.in_process_restart_enabled else "0"),
        (env.SPARE_NODES, str(spec.fault_tolerance.spares)),
        # Only a job that asks for it may fire TRAINER_FAULTS (the trainer refuses them else).
        *(((env.FAULT_INJECTION, "1"),)
          if spec.fault_tolerance.fault_injection == "Enabled" else ()),
        (env.HEARTBEAT_TIMEOUT_SECONDS, str(spec.fault_tolerance.heartbeat_timeout_seconds)),
        (env.WARM_WORKERS, "1" if warm_workers(spec.fault_tolerance.warm_workers, plan,
                                                 builtin=spec.runs_builtin_trainer) else "0"),
        # Same rule: the keepers serve the built-in trainer's snapshots (rtj_trainer.keeper).
        (env.DEVICE_KEEPER, "1" if warm_workers(spec.fault_tolerance.device_keepers, plan,
                                                  builtin=spec.runs_builtin_trainer) else "0"),
        # Other jobs whose checkpoints this one may resume (the trainer refuses any other's).
        *(((env.CHECKPOINT_RESUME_FROM_JOBS, ",".join(spec.checkpoint.resume_from_jobs)),)
          if spec.checkpoint.resume_from_jobs else ()),
        # Where local rank 0 writes how the pod ended (rtj_wire.termination).
        (env.TERMINATION_MESSAGE_PATH, TERMINATION_MESSAGE_PATH),
    ]
    platform: dict[str, str] = dict(plan.resources.env)
    if plan.efa_devices > 0:
        platform.update(profiles.EFA_ENV)
    if plan.gpus > 0:
        platform.update(NCCL_ENV)
        if spec.in_process_restart_enabled:
            platform.update(IN_PROCESS_RESTART_NCCL_ENV)
    user = [e.to_api() for e in spec.env]
    user_names = {e.name for e in spec.env}
    platform_env = _value_env([(k, v) for k, v in platform.items() if k not in user_names])
    return [*downward, *_value_env(contract), *platform_env, *user]


def warm_workers(setting: str, plan: PodPlan, *, builtin: bool = True) -> bool:
    """Whether the launcher starts its workers from pre-imported processes
    (rtj_trainer.launcher.warmpool, `faultTolerance.warmWorkers`). `Auto` turns them on with GPUs:
    on one H200 a SIGKILLed rank was training again 9.5-11.7 s after the fault instead of 20 s, and
    a cold start took 11-12 s instead of 17-18 s; on a 2-core CPU machine the imports of the
    refilled pool compete with training (docs/benchmarks.md)."""
    if setting == "Auto":
        return plan.gpus > 0 and builtin  # the shim starts warm workers for rtj_trainer only
    return setting == "Enabled"
