"""The argv of a trainer container: `ft_launcher <flags derived from the spec> <command> <args>`,
and the argv of the rendezvous container (`nvrx-control`).

Argv only: pure functions of the parsed job, its `PodPlan` (procs, device counts, term timeout,
rendezvous id and endpoint, resolved once a pass in `podplan`) and the operator settings. Every
flag was checked against `ft_launcher --help` / `nvrx-control --help` of nvidia-resiliency-ext
0.7.0; the reasons for the values are in docs/nvrx.md sections 2 and 7 (and docs/operator.md).
"""

from __future__ import annotations

from rtj_wire import pod

from rtj_operator.api.models import ResilientTrainingJob
from rtj_operator.config import OperatorSettings
from rtj_operator.ftflags import LauncherSettings, ft_flags
from rtj_operator.podplan import PodPlan

TRAINER_FATAL_EXIT_CODE = pod.FATAL_EXIT_CODE
"""The trainer's exit code for an error restarting cannot fix (rtj_wire.pod)."""
NO_RESTART_EXIT_CODE = pod.NO_RESTART_EXIT_CODE
"""ft_launcher's `--ft-no-restart-exit-code`: NVRx decided the job must not be restarted (also
what every launcher exits with after a worker exited with a non-retryable code: the shim)."""
SPARES_EXIT_BARRIER_SECONDS = 5.0
"""torchelastic's exit barrier in jobs with spares (`--rtj-exit-barrier-timeout`): after a takeover
the lost launcher never arrives there. It only keeps a store-hosting launcher alive for the
others, and our store lives in the rendezvous pod, so the survivors need not wait long (30 s
until 2026-12-03: 25 s more at the end of every job with a takeover)."""


def non_retryable_worker_codes(job: ResilientTrainingJob) -> list[int]:
    """Worker exit codes that stop ft_launcher's restarts: the trainer's fatal code and
    `faultTolerance.nonRetryableExitCodes`."""
    return sorted({TRAINER_FATAL_EXIT_CODE, *job.spec.fault_tolerance.non_retryable_exit_codes})


def launcher_settings(job: ResilientTrainingJob, plan: PodPlan) -> LauncherSettings:
    """The shared ft_launcher settings (`ftflags`) of this job's trainer pods."""
    ft = job.spec.fault_tolerance
    return LauncherSettings(
        # Every launcher also spends a restart on each fault the operator answers with a
        # RankRestart (ftflags' docstring): add the job's rank-restart budget to the pod's own.
        max_restarts=ft.launcher_max_restarts + ft.rank_restart_budget.max,
        term_timeout_seconds=plan.term_timeout_seconds,
        initial_heartbeat_timeout_seconds=ft.initial_heartbeat_timeout_seconds,
        heartbeat_timeout_seconds=ft.heartbeat_timeout_seconds,
        gpus=plan.gpus,
    )


def trainer_argv(
    job: ResilientTrainingJob, plan: PodPlan, settings: OperatorSettings
) -> list[str]:
    """The trainer container's argv: ft_launcher, its flags, then the worker's argv.

    `$(POD_IP)` is expanded by the kubelet from the container's env (downward API).
    """
    spec = job.spec
    return [
        # ft_launcher through the trainer image's shim (rtj_trainer.launcher): a worker that
        # exits with a non-retryable code (the trainer's fatal 94, nonRetryableExitCodes) stops
        # every launcher's restarts, and they exit 93. With spares, its exit barrier does not
        # wait five minutes for the launcher of a pod a spare replaced.
        "python", "-m", "rtj_trainer.launcher",
        f"--rtj-non-retryable-exit-codes={','.join(map(str, non_retryable_worker_codes(job)))}",
        *([f"--rtj-exit-barrier-timeout={SPARES_EXIT_BARRIER_SECONDS:g}"]
          if spec.fault_tolerance.spares else []),
        # `--max-restarts` counts over the job's life in NVRx: each launcher gives a restart back
        # once it is older than the rank-restart budget's window, so the operator's windowed
        # budgets, not the count of faults since the job began, decide when the job escalates.
        f"--rtj-restart-window={spec.fault_tolerance.rank_restart_budget.window_seconds}",
        # Every launcher, spares included: NVRx's world holds the spares as inactive ranks.
        f"--nnodes={plan.pods}",
        f"--nproc-per-node={plan.procs_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={plan.rendezvous_endpoint}",
        f"--rdzv-id={plan.rendezvous_id}",
        # The store lives in the rendezvous pod (nvrx-control), never in a trainer pod: losing
        # the pod that hosts the store loses the job (nvrx.md E5/E6).
        f"--rdzv-conf=is_host=false,join_timeout={settings.rendezvous_join_timeout_seconds}",
        # The node address is the pod IP; it also becomes MASTER_ADDR on group rank 0.
        "--local-addr=$(POD_IP)",
        *ft_flags(launcher_settings(job, plan)),
        "--no-python",
        *spec.command,
        *spec.args,
    ]


def rendezvous_argv(
    job: ResilientTrainingJob, plan: PodPlan, settings: OperatorSettings
) -> list[str]:
    """The rendezvous container's argv: nvrx-control hosting the store and the rounds."""
    return [
        "nvrx-control",
        f"--nnodes={plan.pods}",
        f"--rdzv-endpoint=$(POD_IP):{settings.rendezvous_port}",
        f"--rdzv-id={plan.rendezvous_id}",
        f"--rdzv-conf=join_timeout={settings.rendezvous_join_timeout_seconds}",
        "--local-addr=$(POD_IP)",
        # Log funnelling is on by default and then needs a log path, else nvrx-control refuses
        # to start (nvrx.md E6).
        "--ft-enable-log-server",
        "false",
    ]
