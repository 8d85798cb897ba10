"""Trainer config layering and TRAINER_FAULTS parsing: errors name the field or the entry."""

from __future__ import annotations

from pathlib import Path

import pytest
from rtj_trainer.config import ConfigError, build_config, launch_environment
from rtj_trainer.faults import Fault, FaultInjector, FaultSpecError, InjectedFault, parse_faults

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
           "RTJ_INPROCESS_RESTART": "1", "TRAINER_FAULTS": "3:1:hang", "RTJ_METRICS_PORT": "9400"}
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


def test_fault_list_parses_every_kind() -> None:
    faults = parse_faults(" 8:1:exception, 17:0:sigkill,26:1:hang,30:0:exit=3,40:2:launcher-kill,")
    assert faults == (
        Fault(8, 1, "exception"), Fault(17, 0, "sigkill"), Fault(26, 1, "hang"),
        Fault(30, 0, "exit", 3), Fault(40, 2, "launcher-kill"),
    )
    assert parse_faults("") == ()


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("8:1", "expected STEP:RANK:KIND"),
        ("x:1:hang", "must be integers"),
        ("0:1:hang", "STEP >= 1"),
        ("8:1:explode", "unknown KIND 'explode'"),
        ("8:1:exit=abc", "exit=CODE needs an integer"),
        ("8:1:exit=0", "CODE must be 1..255"),
        ("8:1:exit", "unknown KIND 'exit'"),
    ],
)
def test_malformed_fault_entries_are_quoted_in_the_error(text: str, needle: str) -> None:
    with pytest.raises(FaultSpecError) as caught:
        parse_faults(text)
    assert needle in str(caught.value) and text.split(",")[0] in str(caught.value)


def test_a_fault_fires_once_per_job_even_for_a_new_process(tmp_path: Path) -> None:
    faults = parse_faults("5:0:exception,5:1:hang")
    first = FaultInjector(faults, rank=0, marker_dir=tmp_path)
    first.maybe_fire(4)
    with pytest.raises(InjectedFault):
        first.maybe_fire(5)
    assert (tmp_path / "step5-rank0-exception").exists()
    restarted = FaultInjector(faults, rank=0, marker_dir=tmp_path)  # a later attempt
    restarted.maybe_fire(5)  # already fired: does nothing
    assert restarted.already_fired(faults[0]) and not restarted.already_fired(faults[1])
