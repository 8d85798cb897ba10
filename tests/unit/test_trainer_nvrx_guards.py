"""The NVRx room's guards (rtj_trainer.nvrx.guards): every patch of NVRx, and every private
attribute the trainer relies on, was written against functions whose source digests are recorded
next to it. When the installed NVRx (or torch's elastic agent under it) differs, this test fails
and names the patch, its reason and the new digest: read that function, check the patch still
does what its reason says, then update the digest in rtj_trainer/nvrx/."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from rtj_trainer import nvrx
from rtj_trainer.nvrx import guards

pytestmark = pytest.mark.unit

TRAINER = Path(nvrx.__file__).resolve().parent.parent


def test_every_patched_function_is_the_one_its_patch_was_written_for() -> None:
    assert guards.installed_version() == guards.NVRX_VERSION
    assert guards.mismatches(nvrx.all_patches()) == []


def test_a_changed_function_is_reported_with_its_patch_and_reason() -> None:
    patch = guards.Patch("example", "why it exists", (
        guards.Target("rtj_trainer.nvrx.guards:source_digest", "0123456789abcdef"),
        guards.Target("rtj_trainer.nvrx.guards:no_such_function", "0123456789abcdef")))
    changed, gone = guards.mismatches((patch,))
    assert changed.startswith("example: rtj_trainer.nvrx.guards:source_digest changed")
    assert "why the patch exists: why it exists" in changed
    assert "no_such_function is gone" in gone


def test_a_patched_function_is_guarded_by_the_source_nvrx_ships() -> None:
    """After a patch is applied the guard still reads NVRx's own function (`_rtj_original`)."""
    from nvidia_resiliency_ext.inprocess.store import StoreMixin
    from rtj_trainer.nvrx.inprocess import patch_initial_ranks

    before = guards.source_digest(StoreMixin.get_initial_ranks)
    patch_initial_ranks()
    target = guards.Target("nvidia_resiliency_ext.inprocess.store:StoreMixin.get_initial_ranks",
                           before)
    assert guards.source_digest(target.resolve()) == before


def _imports(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_only_the_nvrx_room_imports_nvrx_anywhere_in_the_trainer() -> None:
    """What import-linter checks, plus the imports inside functions that it also sees, and
    strings: no module outside rtj_trainer/nvrx names an NVRx module at all."""
    outside = []
    for path in TRAINER.rglob("*.py"):
        if path.parent.name == "nvrx" and path.parent.parent == TRAINER:
            continue
        if any(name.startswith("nvidia_resiliency_ext") for name in _imports(path)) or \
                "nvidia_resiliency_ext" in path.read_text():
            outside.append(str(path.relative_to(TRAINER)))
    assert outside == []
