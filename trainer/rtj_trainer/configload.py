"""Loading the trainer's configuration, and the one place that reads the process environment.

A run is configured in layers, later ones winning: a named preset (`tiny` for CPU tests up to
`8b`), an optional YAML/JSON file, the environment the operator sets (docs/design.md), and finally
`--set section.field=value` overrides from the command line. Every layer is a nested dict merged
into the preset's dict, and pydantic validates the result once (`rtj_trainer.config.Config`), so a
bad value anywhere produces one error that names the field path (`checkpoint.interval_steps: ...`).

The launcher's variables (RANK, LOCAL_RANK, WORLD_SIZE, TORCHELASTIC_RESTART_COUNT, ...) are read
by rtj_trainer.launchenv.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError
from rtj_wire import env as wire_env

from .config import Config, ConfigError
from .presets import PRESETS
from .stop import TERM_TIMEOUT_ENV

# Operator environment (docs/design.md; names: rtj_wire.env) -> config path. Read only here.
OPERATOR_ENV: dict[str, str] = {
    wire_env.JOB_NAME: "job.name",
    wire_env.JOB_UID: "job.uid",
    wire_env.POD_NAMESPACE: "job.namespace",
    wire_env.POD_NAME: "job.pod_name",
    wire_env.POD_UID: "job.pod_uid",
    wire_env.POD_IP: "job.pod_ip",
    wire_env.NODE_INDEX: "job.node_index",
    wire_env.NNODES: "job.nnodes",
    wire_env.PROCS_PER_NODE: "job.procs_per_node",
    wire_env.ATTEMPT: "job.attempt",
    wire_env.CHECKPOINT_DIR: "checkpoint.dir",
    wire_env.CHECKPOINT_INTERVAL_STEPS: "checkpoint.interval_steps",
    wire_env.CHECKPOINT_KEEP: "checkpoint.keep",
    wire_env.CHECKPOINT_MODE: "checkpoint.mode",
    wire_env.CHECKPOINT_RESUME_FROM_JOBS: "checkpoint.resume_from_jobs",
    wire_env.METRICS_PORT: "metrics.port",
    wire_env.METRICS_HOST: "metrics.host",
    wire_env.INPROCESS_RESTART: "resiliency.inprocess_restart",
    wire_env.SPARE_NODES: "resiliency.spare_nodes",
    wire_env.LOST_PODS_FILE: "resiliency.lost_pods_file",
    wire_env.HEARTBEAT_TIMEOUT_SECONDS: "resiliency.heartbeat_timeout_seconds",
    wire_env.TRAINER_FAULTS: "faults",
    wire_env.FAULT_INJECTION: "fault_injection",
    wire_env.LOG_LEVEL: "train.log_level",
}
LAUNCHER_ENV: dict[str, str] = {
    TERM_TIMEOUT_ENV: "checkpoint.stop_timeout_seconds",
}
"""What the launcher shim (rtj_trainer.launcher) sets for its workers -> config path."""


def _set_path(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted}: '{part}' is a value, not a section")
        node = child
    node[leaf] = value


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def environment_overrides(source: Mapping[str, str]) -> dict[str, Any]:
    """The operator's (and the launcher shim's) variables that are set (and non-empty), as a
    nested override dict."""
    tree: dict[str, Any] = {}
    for var, path in {**OPERATOR_ENV, **LAUNCHER_ENV}.items():
        value = source.get(var)
        if value is not None and (value != "" or var == wire_env.TRAINER_FAULTS):
            _set_path(tree, path, value)
    return tree


def parse_set_overrides(assignments: Sequence[str]) -> dict[str, Any]:
    """`["a.b=1", "c=x"]` -> nested dict; values are YAML scalars (`true`, `3`, `null`)."""
    tree: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, raw = assignment.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {assignment!r}: expected KEY=VALUE, e.g. train.steps=20")
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        if isinstance(value, (dict, list)):
            value = raw
        _set_path(tree, key.strip(), value)
    return tree


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A YAML or JSON file whose top level is a mapping of sections."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {file}: {exc.strerror}") from exc
    try:
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {file}: not valid {file.suffix or 'YAML'}: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {file}: the top level must be a mapping of sections")
    preset = data.pop("preset", None)
    if preset is not None:
        data = {"__preset__": preset, **data}
    return data


def _describe(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        path = ".".join(str(part) for part in item["loc"]) or "<config>"
        if item["type"] == "extra_forbidden":
            lines.append(f"{path}: unknown field")
        else:
            given = item.get("input")
            shown = "" if isinstance(given, dict) else f" (got {given!r})"
            lines.append(f"{path}: {item['msg']}{shown}")
    return "invalid trainer config: " + "; ".join(lines)


def build_config(
    *,
    preset: str | None = "tiny",
    file: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Sequence[str] = (),
) -> Config:
    """Preset < file < operator environment < `--set` overrides, validated once."""
    file_tree = read_config_file(file) if file is not None else {}
    preset = file_tree.pop("__preset__", None) or preset
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"preset: unknown preset {preset!r} (known: {', '.join(PRESETS)})")
    tree: dict[str, Any] = json.loads(json.dumps(PRESETS[preset])) if preset else {}
    tree = _merge(tree, file_tree)
    tree = _merge(tree, environment_overrides(os.environ if env is None else env))
    tree = _merge(tree, parse_set_overrides(overrides))
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        raise ConfigError(_describe(exc)) from None
