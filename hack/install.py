#!/usr/bin/env python3
"""Create or refresh the project's virtual environment (.venv) — what `make install` runs.

Idempotent: a stamp file (.venv/.rtj-installed) records a hash of pyproject.toml and this script;
when both are unchanged the script returns at once.

Steps
1. Pick Python 3.12 (the trainer image's Python and the only CPython the NVRx 0.7.0 wheel is built
   for besides 3.14): $RTJ_PYTHON, else python3.12 on PATH, else pyenv's 3.12.x. Python 3.11 is
   accepted as a fallback (NVRx is pure Python apart from one module we never import).
2. pip install -e '.[operator]' plus the trainer extra (torch, numpy) and the test and lint
   dependency groups.
3. nvidia-resiliency-ext 0.7.0 — see install_nvrx() for why it is not a plain pip install here.
4. Import every NVRx piece we use, so a broken install fails here, loudly.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("RTJ_VENV", ROOT / ".venv"))
STAMP = VENV / ".rtj-installed"
NVRX = "nvidia-resiliency-ext==0.7.0"


def log(msg: str) -> None:
    print(f"[install] {msg}", flush=True)


def run(*cmd: str | Path) -> None:
    log(" ".join(str(c) for c in cmd))
    subprocess.run([str(c) for c in cmd], check=True)


def fingerprint() -> str:
    h = hashlib.sha256()
    for f in (ROOT / "pyproject.toml", Path(__file__)):
        h.update(f.read_bytes())
    return h.hexdigest()


def find_python() -> str:
    candidates = [os.environ.get("RTJ_PYTHON", ""), shutil.which("python3.12") or ""]
    pyenv_root = os.environ.get("PYENV_ROOT", str(Path.home() / ".pyenv"))
    candidates += sorted(glob.glob(f"{pyenv_root}/versions/3.12*/bin/python3.12"), reverse=True)
    candidates += [shutil.which("python3.11") or "", sys.executable]
    for c in candidates:
        if not c:
            continue
        try:
            out = subprocess.run(
                [c, "-c", "import sys; print(sys.version_info[:2] >= (3, 11))"],
                capture_output=True, text=True, check=True,
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            continue
        if out == "True":
            return c
    sys.exit("install: no Python >= 3.11 found; set RTJ_PYTHON to a python3.12 interpreter")


def pyproject() -> dict:  # type: ignore[type-arg]
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def install_nvrx(py: Path) -> None:
    """Install nvidia-resiliency-ext 0.7.0 into the venv.

    Its only wheels are cp312/cp314 tagged manylinux_2_39 (glibc >= 2.39). Debian 12 has glibc
    2.36, so pip refuses the wheel even on Python 3.12. The wheel is pure Python except one
    CUPTI extension (`nvrx_cupti_module`, straggler detection, needs CUDA 13's libcupti) that the
    trainer never imports (docs/nvrx.md section 1). So where plain pip works (the trainer
    image: Ubuntu 24.04, Python 3.12) we use it, and elsewhere we install THE SAME UNMODIFIED
    WHEEL with PyPA's `installer`, the reference wheel installer, which installs a wheel file
    without checking its platform tag (no retagging, RECORD stays valid, console scripts such as
    ft_launcher and nvrx-control are generated), then pip-install the wheel's declared
    dependencies. tests/unit/test_foundation.py imports every piece we use so a broken
    install fails loudly.
    """
    with tempfile.TemporaryDirectory() as probe:
        # Would pip take the wheel for this interpreter and platform? (`pip download` checks the
        # tags like `pip install` does, without touching the venv.)
        native = subprocess.run(
            [str(py), "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             "-d", probe, NVRX], capture_output=True, check=False).returncode == 0
    if native:
        run(py, "-m", "pip", "install", "-q", "--only-binary=:all:", NVRX)
        log("nvidia-resiliency-ext installed by pip (the wheel's platform tag matches)")
        return
    log("pip refuses the manylinux_2_39 wheel here (expected on Debian 12, glibc 2.36); "
        "installing the same wheel with PyPA installer")
    with tempfile.TemporaryDirectory() as tmp:
        run(py, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--python-version", "3.12", "--platform", "manylinux_2_39_x86_64", "-d", tmp, NVRX)
        (wheel,) = glob.glob(f"{tmp}/nvidia_resiliency_ext-*.whl")
        meta_name = next(n for n in zipfile.ZipFile(wheel).namelist()
                         if n.endswith(".dist-info/METADATA"))
        meta = zipfile.ZipFile(wheel).read(meta_name).decode()
        deps = [line.split(":", 1)[1].strip() for line in meta.splitlines()
                if line.startswith("Requires-Dist:") and "extra ==" not in line]
        run(py, "-m", "pip", "install", "-q", "installer>=0.7,<2", *deps)
        check = ("import importlib.metadata as m; "
                 "assert m.version('nvidia-resiliency-ext') == '0.7.0'")
        if subprocess.run([str(py), "-c", check], capture_output=True, check=False).returncode == 0:
            log("nvidia-resiliency-ext 0.7.0 is already installed")
            return
        # Re-installs replace the previous copy (installer refuses to overwrite files).
        subprocess.run([str(py), "-m", "pip", "uninstall", "-q", "-y", "nvidia-resiliency-ext"],
                       check=False, capture_output=True)
        run(py, "-m", "installer", "--compile-bytecode", "0", wheel)


def main() -> None:
    if STAMP.exists() and STAMP.read_text().strip() == fingerprint() and "--force" not in sys.argv:
        log(f"{VENV} is up to date")
        return
    py = VENV / "bin" / "python"
    if not py.exists():
        base = find_python()
        log(f"creating {VENV} with {base}")
        run(base, "-m", "venv", VENV)
    run(py, "-m", "pip", "install", "-q", "--upgrade", "pip>=25.1")
    cfg = pyproject()
    trainer_deps = [d for d in cfg["project"]["optional-dependencies"]["trainer"]
                    if not d.startswith("nvidia-resiliency-ext")]
    log("installing torch and the project (first time: several GB of CUDA wheels, a few minutes)")
    run(py, "-m", "pip", "install", "-q", "-e", f"{ROOT}[operator]", *trainer_deps,
        "--group", f"{ROOT / 'pyproject.toml'}:test", "--group", f"{ROOT / 'pyproject.toml'}:lint")
    install_nvrx(py)
    run(py, "-c", "import nvidia_resiliency_ext.fault_tolerance, "
        "nvidia_resiliency_ext.inprocess, nvidia_resiliency_ext.checkpointing.async_ckpt.core; "
        "print('[install] NVRx imports OK')")
    STAMP.write_text(fingerprint() + "\n")
    log(f"done: {VENV}")


if __name__ == "__main__":
    main()
