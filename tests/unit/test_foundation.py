"""Foundation invariants: the NVRx install is whole, `operator` stays the standard library,
and the operator and trainer packages stay apart."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.unit


def test_every_nvrx_piece_the_trainer_uses_imports() -> None:
    launcher = importlib.import_module("nvidia_resiliency_ext.fault_tolerance.launcher")
    assert callable(launcher.main), "ft_launcher's console entry point is launcher:main"
    ft = importlib.import_module("nvidia_resiliency_ext.fault_tolerance")
    assert hasattr(ft, "RankMonitorClient")
    inprocess = importlib.import_module("nvidia_resiliency_ext.inprocess")
    assert hasattr(inprocess, "Wrapper")
    core = importlib.import_module("nvidia_resiliency_ext.checkpointing.async_ckpt.core")
    assert hasattr(core, "AsyncCallsQueue") and hasattr(core, "AsyncRequest")
    importlib.import_module("nvidia_resiliency_ext.checkpointing.async_ckpt.filesystem_async")
    importlib.import_module("nvidia_resiliency_ext.checkpointing.async_ckpt.state_dict_saver")
    from importlib.metadata import version

    assert version("nvidia-resiliency-ext") == "0.7.0"


@pytest.mark.parametrize("script", ["ft_launcher", "nvrx-control"])
def test_nvrx_console_scripts_answer_help(script: str) -> None:
    exe = Path(sys.executable).parent / script
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "--rdzv-endpoint" in out.stdout


@pytest.mark.parametrize("cwd", [ROOT, ROOT / "operator", ROOT / "tests"])
def test_import_operator_is_the_standard_library(cwd: Path) -> None:
    code = "import operator, sys; print(operator.__file__); print(operator.itemgetter(1)([5, 6]))"
    out = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True,
                         check=True)
    path, value = out.stdout.split()
    assert value == "6"
    assert "site-packages" not in path and Path(path).parent.name.startswith("python3")


def test_import_contracts_hold() -> None:
    exe = Path(sys.executable).parent / "lint-imports"
    out = subprocess.run([str(exe)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "never import each other KEPT" in out.stdout
