"""The wheel a team installs into its own image (`make wheel`, docs/byo.md): built from this
repository, it holds the trainer package with its public library and the wire, and the console
scripts of both packages."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_the_trainer_its_library_and_the_wire(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path), str(ROOT)],
                   check=True, capture_output=True, timeout=25)
    (wheel,) = tmp_path.glob("resilient_training_operator-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for module in ("rtj_trainer/lib/__init__.py", "rtj_trainer/lib/run.py",
                   "rtj_trainer/lib/hf.py", "rtj_trainer/launcher/shim.py",
                   "rtj_trainer/export.py", "rtj_wire/ranks.py", "rtj_wire/py.typed",
                   "rtj_trainer/nvrx/guards.py"):
        assert module in names, module
    metadata = next(n for n in names if n.endswith("METADATA"))
    text = zipfile.ZipFile(wheel).read(metadata).decode()
    assert 'Requires-Dist: nvidia-resiliency-ext==0.7.0; extra == "trainer"' in text
    assert 'Requires-Dist: transformers' in text
