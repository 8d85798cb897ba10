"""The argv of ft_launcher and nvrx-control (`rtj_operator.launcher`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rtj_operator import ftflags, launcher
from rtj_operator.api.models import ResilientTrainingJob, parse_job
from rtj_operator.config import OperatorSettings
from rtj_operator.podplan import plan_for, term_timeout_seconds
from rtj_trainer.launcher.shim import split_argv

pytestmark = pytest.mark.unit
REPO_ROOT = Path(__file__).resolve().parents[2]


def job(**spec: Any) -> Any:
    body = {
        "apiVersion": "training.resilient.dev/v1alpha1",
        "kind": "ResilientTrainingJob",
        "metadata": {"name": "llama", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": {
            "nodes": 8,
            "image": "trainer:1",
            "checkpoint": {"claimName": "fsx"},
            **spec,
        },
    }
    return parse_job(body)


def trainer_argv(j: ResilientTrainingJob, settings: OperatorSettings) -> list[str]:
    return launcher.trainer_argv(j, plan_for(j, settings), settings)


def rendezvous_argv(j: ResilientTrainingJob, settings: OperatorSettings) -> list[str]:
    return launcher.rendezvous_argv(j, plan_for(j, settings), settings)


def test_ft_launcher_argv_for_a_p5_job() -> None:
    argv = trainer_argv(
        job(args=["--preset", "7b"], faultTolerance={"launcherMaxRestarts": 5,
                                                    "heartbeatTimeoutSeconds": 90,
                                                    "initialHeartbeatTimeoutSeconds": 900}),
        OperatorSettings(),
    )
    assert argv == [
        # Through the shim: a worker's fatal exit (94) stops every launcher's restarts.
        "python", "-m", "rtj_trainer.launcher", "--rtj-non-retryable-exit-codes=94",
        # Each launcher restart is given back after the rank-restart window (default 1 h).
        "--rtj-restart-window=3600",
        "--nnodes=8",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=llama-rdzv:29400",
        "--rdzv-id=uid-1",
        "--rdzv-conf=is_host=false,join_timeout=600",
        "--local-addr=$(POD_IP)",
        # The pod's own 5 plus the job's rank-restart budget (default 10): every launcher
        # spends a restart on each RankRestart of another pod too.
        "--max-restarts=15",
        "--term-timeout=108",
        "--workers-stop-timeout=5",
        "--monitor-interval=0.3",
        "--ft-initial-rank-heartbeat-timeout=900",
        "--ft-rank-heartbeat-timeout=90",
        "--ft-workload-check-interval=1",
        "--ft-gpu-memory-reclaim-timeout=50",
        "--ft-gpu-memory-poll-interval=0.1",
        "--no-python",
        "python", "-m", "rtj_trainer", "--preset", "7b",
    ]


def test_term_timeout_stays_below_the_grace_period() -> None:
    for grace in (1, 5, 10, 30, 120, 600, 3600):
        assert term_timeout_seconds(grace) < max(grace, 2)
    argv = trainer_argv(job(podTemplate={"terminationGracePeriodSeconds": 300}),
                                 OperatorSettings())
    assert "--term-timeout=270" in argv


def test_a_cpu_job_does_not_wait_for_gpu_memory() -> None:
    cpu = job(instanceType="c7i.8xlarge", procsPerNode=2,
              resources={"requests": {"cpu": "4"}, "limits": {}})
    argv = trainer_argv(cpu, OperatorSettings())
    assert "--ft-gpu-memory-reclaim-timeout=0" in argv
    assert not any(a.startswith("--ft-gpu-memory-poll-interval") for a in argv)
    assert "--nproc-per-node=2" in argv


def test_every_ft_launcher_flag_we_pass_exists_in_nvrx_0_7() -> None:
    """The flags are checked against the installed ft_launcher's own parser."""
    from nvidia_resiliency_ext.fault_tolerance.launcher import get_args_parser

    argv = trainer_argv(job(), OperatorSettings())
    assert argv[:3] == ["python", "-m", "rtj_trainer.launcher"]
    options, rest = split_argv(argv[3:])
    assert options.non_retryable == {94} and options.restart_window == 3600.0
    parsed = get_args_parser().parse_args(rest)
    assert parsed.nnodes == "8"
    assert parsed.rdzv_conf == "is_host=false,join_timeout=600"
    assert parsed.no_python is True
    assert parsed.training_script == "python"
    assert parsed.training_script_args == ["-m", "rtj_trainer"]


def test_non_retryable_codes_reach_the_shim_and_spares_get_a_short_exit_barrier() -> None:
    argv = trainer_argv(job(faultTolerance={"nonRetryableExitCodes": [3, 42]}),
                        OperatorSettings())
    assert argv[3] == "--rtj-non-retryable-exit-codes=3,42,94"
    assert not any(a.startswith("--rtj-exit-barrier") for a in argv)
    spares = trainer_argv(job(faultTolerance={"spares": 1, "inProcessRestart": "Enabled"}),
                          OperatorSettings())
    options, rest = split_argv(spares[3:])
    assert options.exit_barrier_timeout == 5.0
    assert rest[0] == "--nnodes=9"


def test_the_shim_refuses_options_it_does_not_know() -> None:
    with pytest.raises(SystemExit, match="unknown option --rtj-nope"):
        split_argv(["--rtj-nope=1", "--nnodes=1"])
    with pytest.raises(SystemExit, match="comma-separated integers"):
        split_argv(["--rtj-non-retryable-exit-codes=a", "--nnodes=1"])
    with pytest.raises(SystemExit, match="--rtj-restart-window=0: expected seconds > 0"):
        split_argv(["--rtj-restart-window=0", "--nnodes=1"])


def test_the_launchers_restart_window_is_the_rank_restart_budgets() -> None:
    argv = trainer_argv(job(faultTolerance={"rankRestartBudget": {"max": 4,
                                                                  "windowSeconds": 600}}),
                        OperatorSettings())
    options, _ = split_argv(argv[3:])
    assert options.restart_window == 600.0
    assert "--max-restarts=7" in argv  # the pod's 3 plus the job's 4


def test_nvrx_control_argv() -> None:
    argv = rendezvous_argv(job(), OperatorSettings())
    assert argv == [
        "nvrx-control", "--nnodes=8", "--rdzv-endpoint=$(POD_IP):29400", "--rdzv-id=uid-1",
        "--rdzv-conf=join_timeout=600", "--local-addr=$(POD_IP)",
        "--ft-enable-log-server", "false",
    ]


def test_every_nvrx_control_flag_we_pass_exists_in_nvrx_0_7() -> None:
    from nvidia_resiliency_ext.fault_tolerance.control_plane import parse_args

    parsed = parse_args(rendezvous_argv(job(), OperatorSettings())[1:])
    assert parsed.nnodes == "8"
    assert parsed.rdzv_endpoint == "$(POD_IP):29400"
    assert not parsed.ft_enable_log_server


def test_local_runs_get_the_flags_the_operator_gives_its_pods(capsys: Any) -> None:
    """trainer/scripts/train-local.sh (what the benchmarks measure) prints its flags with
    `python -m rtj_operator.ftflags`; for the same numbers they are the pod's flags."""
    j = job(faultTolerance={"launcherMaxRestarts": 2, "heartbeatTimeoutSeconds": 30,
                            "initialHeartbeatTimeoutSeconds": 300,
                            "rankRestartBudget": {"max": 4, "windowSeconds": 600}})
    settings = OperatorSettings()
    plan = plan_for(j, settings)
    pod = launcher.launcher_settings(j, plan)
    assert pod.max_restarts == 6
    assert ftflags.main([
        f"--max-restarts={pod.max_restarts}", f"--term-timeout={pod.term_timeout_seconds}",
        f"--initial-heartbeat-timeout={pod.initial_heartbeat_timeout_seconds}",
        f"--heartbeat-timeout={pod.heartbeat_timeout_seconds}", f"--gpus={pod.gpus}",
    ]) == 0
    printed = capsys.readouterr().out.splitlines()
    argv = launcher.trainer_argv(j, plan, settings)
    assert printed == argv[argv.index("--local-addr=$(POD_IP)") + 1:argv.index("--no-python")]


def test_train_local_takes_its_flags_from_ftflags() -> None:
    script = (REPO_ROOT / "trainer" / "scripts" / "train-local.sh").read_text()
    assert "-m rtj_operator.ftflags" in script and '"${FT_FLAGS[@]}"' in script
    for flag in ("--workers-stop-timeout", "--monitor-interval", "--ft-workload-check-interval",
                 "--ft-rank-heartbeat-timeout", "--ft-checkpoint-iteration-file"):
        assert flag not in script.split("exec ")[-1], f"{flag} is set twice"
