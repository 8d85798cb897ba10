"""What each NVRx patch was written against, so that an upgrade fails loudly instead of quietly.

Every place where the trainer replaces code inside NVRx 0.7.0 (or torchelastic, through NVRx's
launcher), or relies on one of its private attributes, is declared here as a `Patch`: a name, why
it exists, and the functions of the installed package whose source it was written against, each
with the sha256 of that source (`inspect.getsource`) at NVRx 0.7.0 / torch 2.13. The guard test
(tests/unit/test_trainer_nvrx_guards.py) recomputes the digests of the installed packages and
fails, naming the patch and its reason, when one differs: whoever upgrades NVRx re-reads exactly
those functions, checks that the patch still does what its reason says, and updates the digest.

At run time nothing is checked (reading sources costs milliseconds per process start);
`installed_version()` is logged by the launcher shim.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect
from dataclasses import dataclass
from typing import Any

NVRX_VERSION = "0.7.0"
"""The NVRx release every patch below was written for (pyproject.toml pins it)."""


@dataclass(frozen=True, slots=True)
class Target:
    """One function (or class) of an installed package: `module:qualified.name`."""

    path: str
    sha256: str
    """The first 16 hex digits of sha256(inspect.getsource(...)) at NVRx 0.7.0."""

    def resolve(self) -> object:
        module_name, _, qualname = self.path.partition(":")
        obj: object = importlib.import_module(module_name)
        for part in qualname.split("."):
            obj = getattr(obj, part)
        # A patched function is found under its original (it keeps `__wrapped__`-style access
        # through `_rtj_original`): the guard reads what NVRx ships, not our replacement.
        return getattr(obj, "_rtj_original", obj)


@dataclass(frozen=True, slots=True)
class Patch:
    """A replacement of, or a reliance on, code inside NVRx (see the module docstring)."""

    name: str
    reason: str
    targets: tuple[Target, ...]


def replace(owner: Any, name: str, replacement: Any) -> Any:
    """Set `owner.name` to `replacement` (once: a second call is a no-op); returns the original.
    The replacement remembers the original (`_rtj_original`), which the guards read."""
    original = getattr(owner, name)
    if getattr(original, "_rtj_patched", False):
        return original._rtj_original
    replacement._rtj_patched = True
    replacement._rtj_original = original
    setattr(owner, name, replacement)
    return original


def source_digest(obj: object) -> str:
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]  # type: ignore[arg-type]


def mismatches(patches: tuple[Patch, ...]) -> list[str]:
    """One line per target whose installed source differs from the one its patch was written
    for (or that is gone); [] when every patch still fits."""
    found = []
    for patch in patches:
        for target in patch.targets:
            try:
                digest = source_digest(target.resolve())
            except (AttributeError, ImportError, OSError, TypeError) as exc:
                found.append(f"{patch.name}: {target.path} is gone ({exc}); why the patch "
                             f"exists: {patch.reason}")
                continue
            if digest != target.sha256:
                found.append(f"{patch.name}: {target.path} changed (sha256 {digest}, the patch "
                             f"was written for {target.sha256}); why the patch exists: "
                             f"{patch.reason}")
    return found


def installed_version() -> str:
    try:
        return importlib.metadata.version("nvidia-resiliency-ext")
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
