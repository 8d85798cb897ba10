"""Trainer config layering: preset < file < environment < --set; errors name the field."""

from __future__ import annotations

from pathlib import Path

import pytest
from rtj_trainer.config import ConfigError
from rtj_trainer.configload import build_config
from rtj_trainer.launchenv import launch_environment, side_store_ports

pytestmark = pytest.mark.unit


def test_tiny_preset_is_a_small_cpu_model() -> None:
    cfg = build_config(preset="tiny", env={})
    assert (cfg.model.num_layers, cfg.model.d_model, cfg.model.seq_len) == (2, 64, 32)
    assert cfg.model.vocab_size == 256 and cfg.data.batch_size == 4


def test_layers_apply_preset_then_file_then_environment_then_set(tmp_path: Path) -> None:
    file = tmp_path / "run.yaml"
    file.write_text(
        "preset: tiny\ntrain:\n  steps: 11\ncheckpoint:\n  keep: 4\n  interval_steps: 3\n"
    )
    env = {"RTJ_CHECKPOINT_DIR": "/ckpt", "RTJ_CHECKPOINT_INTERVAL_STEPS": "7",
           "RTJ_INPROCESS_RESTART": "1", "TRAINER_FAULTS": "3:1:hang", "RTJ_METRICS_PORT": "9400",
           "RTJ_FAULT_INJECTION": "1"}
    cfg = build_config(preset=None, file=file, env=env, overrides=["checkpoint.interval_steps=9"])
    assert cfg.train.steps == 11 and cfg.checkpoint.keep == 4
    assert cfg.checkpoint.dir == "/ckpt"
    assert cfg.checkpoint.interval_steps == 9
    assert cfg.resiliency.inprocess_restart is True
    assert cfg.faults == "3:1:hang" and cfg.metrics.port == 9400


def test_json_config_files_are_accepted(tmp_path: Path) -> None:
    file = tmp_path / "run.json"
    file.write_text('{"preset": "small", "train": {"steps": 5}}')
    cfg = build_config(preset=None, file=file, env={})
    assert cfg.model.d_model == 768 and cfg.train.steps == 5


@pytest.mark.parametrize(
    ("overrides", "env", "needle"),
    [
        (["checkpoint.interval_steps=abc"], {}, "checkpoint.interval_steps"),
        (["checkpoint.intervall=3"], {}, "checkpoint.intervall: unknown field"),
        (["checkpoint.mode=fast"], {}, "checkpoint.mode"),
        (["model.num_heads=5"], {}, "model.d_model (64) must be divisible by model.num_heads"),
        ([], {"RTJ_CHECKPOINT_KEEP": "0"}, "checkpoint.keep"),
        (["steps"], {}, "expected KEY=VALUE"),
        (["train.min_step_seconds=-1"], {}, "train.min_step_seconds"),
        (["checkpoint.snapshot_bounce_mib=0"], {}, "checkpoint.snapshot_bounce_mib"),
    ],
)
def test_bad_values_raise_an_error_naming_the_field(
    overrides: list[str], env: dict[str, str], needle: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        build_config(preset="tiny", env=env, overrides=overrides)
    assert needle in str(caught.value)


def test_unknown_preset_is_named() -> None:
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        build_config(preset="huge", env={})


def test_launch_environment_reads_launcher_variables() -> None:
    launch = launch_environment({"RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4",
                                 "TORCHELASTIC_RESTART_COUNT": "2",
                                 "FT_RANK_MONITOR_IPC_SOCKET": "/tmp/x.socket"})
    assert (launch.rank, launch.local_rank, launch.world_size) == (3, 1, 4)
    assert launch.launcher_restart_count == 2 and launch.under_rank_monitor


def test_rank_0s_store_ports_lie_outside_the_ports_outgoing_connections_get() -> None:
    # ft_launcher picks MASTER_PORT from the ephemeral range (Linux's default: 32768-60999); the
    # ports beside it are the ones the kernel hands to any outgoing connection of the host
    # (EADDRINUSE on MASTER_PORT + 1 once in CI)
    launch = launch_environment({"MASTER_PORT": "56459"})
    ports = (launch.app_store_port, launch.wrapper_store_port)
    assert ports == side_store_ports(56459) and ports[1] == ports[0] + 1
    for master in range(32768, 65536):
        app, wrapper = side_store_ports(master)
        assert 20000 <= app < wrapper < 32000
    assert side_store_ports(40000) != side_store_ports(40001)  # neighbours: other ports
    # a MASTER_PORT set by hand below that range keeps the two ports after it
    assert side_store_ports(29500) == (29501, 29502)


def test_faults_fire_only_when_fault_injection_is_enabled() -> None:
    with pytest.raises(ConfigError, match="fault injection is not enabled"):
        build_config(env={"TRAINER_FAULTS": "3:1:hang"})
    cfg = build_config(env={"TRAINER_FAULTS": "3:1:hang", "RTJ_FAULT_INJECTION": "1"})
    assert [f.kind for f in cfg.fault_list] == ["hang"]
    assert build_config(env={}).fault_list == ()
