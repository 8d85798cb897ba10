"""The operator's settings from the environment, and the argv of ft_launcher and nvrx-control."""

from __future__ import annotations

from typing import Any

import pytest
from rtj_operator import launcher
from rtj_operator.api.models import parse_job
from rtj_operator.config import ConfigurationError, OperatorSettings, load_settings

pytestmark = pytest.mark.unit


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


# --- config -------------------------------------------------------------------------------------


def test_settings_default_when_nothing_is_set() -> None:
    assert load_settings({}) == OperatorSettings()


def test_settings_are_read_from_prefixed_variables() -> None:
    settings = load_settings({
        "RTJ_OPERATOR_NAMESPACE": "ml",
        "RTJ_OPERATOR_RECONCILE_INTERVAL_SECONDS": "2.5",
        "RTJ_OPERATOR_METRICS_PORT": "0",
        "RTJ_OPERATOR_PEERING": "true",
        "UNRELATED": "x",
    })
    assert settings.namespace == "ml"
    assert settings.reconcile_interval_seconds == 2.5
    assert settings.metrics_port == 0
    assert settings.peering is True


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        ("RTJ_OPERATOR_RECONCILE_INTERVAL_SECONDS", "fast", "expected a number"),
        ("RTJ_OPERATOR_METRICS_PORT", "80.5", "expected an integer"),
        ("RTJ_OPERATOR_PEERING", "maybe", "expected true or false"),
        ("RTJ_OPERATOR_RECONCILE_INTERVAL_SECONDS", "0", "must be > 0"),
        ("RTJ_OPERATOR_RENDEZVOUS_PORT", "70000", "not a usable port"),
        ("RTJ_OPERATOR_RECONCILE_INTERVALL_SECONDS", "3", "unknown setting"),
    ],
)
def test_a_bad_setting_is_an_error_that_names_the_variable(
    variable: str, value: str, expected: str
) -> None:
    with pytest.raises(ConfigurationError) as error:
        load_settings({variable: value})
    assert variable in str(error.value)
    assert expected in str(error.value)


def test_liveness_endpoint_is_off_with_port_zero() -> None:
    assert OperatorSettings(liveness_port=0).liveness_endpoint() is None
    assert OperatorSettings().liveness_endpoint() == "http://127.0.0.1:8091/healthz"


def test_the_operator_exits_with_a_clear_error_on_bad_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from rtj_operator import __main__ as entry
    from rtj_operator.config import settings_from_environment

    monkeypatch.setenv("RTJ_OPERATOR_METRICS_PORT", "eighty")
    settings_from_environment.cache_clear()
    try:
        assert entry.main() == 2
    finally:
        settings_from_environment.cache_clear()
    assert "RTJ_OPERATOR_METRICS_PORT='eighty': expected an integer" in capsys.readouterr().err


# --- launcher -----------------------------------------------------------------------------------


def test_ft_launcher_argv_for_a_p5_job() -> None:
    argv = launcher.trainer_argv(
        job(args=["--preset", "7b"], faultTolerance={"launcherMaxRestarts": 5,
                                                    "heartbeatTimeoutSeconds": 90,
                                                    "initialHeartbeatTimeoutSeconds": 900}),
        OperatorSettings(),
    )
    assert argv == [
        "ft_launcher",
        "--nnodes=8",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=llama-rdzv:29400",
        "--rdzv-id=uid-1",
        "--rdzv-conf=is_host=false,join_timeout=600",
        "--local-addr=$(POD_IP)",
        "--max-restarts=5",
        "--term-timeout=25",
        "--ft-initial-rank-heartbeat-timeout=900",
        "--ft-rank-heartbeat-timeout=90",
        "--ft-gpu-memory-reclaim-timeout=50",
        "--no-python",
        "python", "-m", "rtj_trainer", "--preset", "7b",
    ]


def test_term_timeout_stays_below_the_grace_period() -> None:
    for grace in (1, 5, 10, 30, 120, 600, 3600):
        assert launcher.term_timeout_seconds(grace) < max(grace, 2)
    argv = launcher.trainer_argv(job(podTemplate={"terminationGracePeriodSeconds": 300}),
                                 OperatorSettings())
    assert "--term-timeout=270" in argv


def test_a_cpu_job_does_not_wait_for_gpu_memory() -> None:
    cpu = job(instanceType="c7i.8xlarge", procsPerNode=2,
              resources={"requests": {"cpu": "4"}, "limits": {}})
    argv = launcher.trainer_argv(cpu, OperatorSettings())
    assert "--ft-gpu-memory-reclaim-timeout=0" in argv
    assert "--nproc-per-node=2" in argv


def test_every_ft_launcher_flag_we_pass_exists_in_nvrx_0_7() -> None:
    """The flags are checked against the installed ft_launcher's own parser."""
    from nvidia_resiliency_ext.fault_tolerance.launcher import get_args_parser

    argv = launcher.trainer_argv(job(), OperatorSettings())
    parsed = get_args_parser().parse_args(argv[1:])
    assert parsed.nnodes == "8"
    assert parsed.rdzv_conf == "is_host=false,join_timeout=600"
    assert parsed.no_python is True
    assert parsed.training_script == "python"
    assert parsed.training_script_args == ["-m", "rtj_trainer"]


def test_nvrx_control_argv() -> None:
    argv = launcher.rendezvous_argv(job(), OperatorSettings())
    assert argv == [
        "nvrx-control", "--nnodes=8", "--rdzv-endpoint=$(POD_IP):29400", "--rdzv-id=uid-1",
        "--rdzv-conf=join_timeout=600", "--local-addr=$(POD_IP)",
        "--ft-enable-log-server", "false",
    ]


def test_every_nvrx_control_flag_we_pass_exists_in_nvrx_0_7() -> None:
    from nvidia_resiliency_ext.fault_tolerance.control_plane import parse_args

    parsed = parse_args(launcher.rendezvous_argv(job(), OperatorSettings())[1:])
    assert parsed.nnodes == "8"
    assert parsed.rdzv_endpoint == "$(POD_IP):29400"
    assert not parsed.ft_enable_log_server
