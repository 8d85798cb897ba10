"""The two "bring your own script" examples (examples/byo/): `train_fsdp2.py`, a plain FSDP2
script whose only tie to the operator is NVRx heartbeats (its lines marked `# NVRx`), and
`train_fsdp2_rtj.py`, the same script with the trainer's library. The library's promise is a
small diff: the lines it adds are exactly those marked `# rtj` (at most 10), the lines it
removes exactly those marked `# NVRx`, and it needs nothing of the trainer but
`rtj_trainer.lib`. Checked on the text, so the examples and their docstrings cannot drift."""

from __future__ import annotations

import ast
import difflib
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "byo"
PLAIN = EXAMPLES / "train_fsdp2.py"
WITH_LIB = EXAMPLES / "train_fsdp2_rtj.py"
RTJ_MARK = re.compile(r"#\s*rtj\s*$")
NVRX_MARK = re.compile(r"#\s*NVRx\s*$")
MAX_ADDED_LINES = 10


def _code_lines(path: Path) -> list[str]:
    """The file's lines after its module docstring (which differs in prose, not code)."""
    source = path.read_text()
    tree = ast.parse(source)
    first = tree.body[0]
    assert isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
        and isinstance(first.value.value, str), f"{path.name} has no module docstring"
    assert first.end_lineno is not None
    return source.splitlines()[first.end_lineno:]


def _diff() -> tuple[list[str], list[str]]:
    """(lines the library version adds, lines it removes), from difflib's opcodes."""
    plain, with_lib = _code_lines(PLAIN), _code_lines(WITH_LIB)
    added: list[str] = []
    removed: list[str] = []
    matcher = difflib.SequenceMatcher(a=plain, b=with_lib, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag in ("delete", "replace"):
            removed.extend(plain[i1:i2])
        if tag in ("insert", "replace"):
            added.extend(with_lib[j1:j2])
    return added, removed


def test_the_library_version_adds_exactly_the_lines_marked_rtj_and_at_most_10() -> None:
    """Every added code line carries `# rtj` and every `# rtj` line is an added one: the mark
    is an honest count of what the library costs a script, and it stays at 10 lines or fewer."""
    added, _ = _diff()
    marked = [line for line in _code_lines(WITH_LIB) if RTJ_MARK.search(line)]
    assert added == marked
    assert 0 < len(added) <= MAX_ADDED_LINES, added


def _hunks() -> list[tuple[list[str], list[str]]]:
    """(removed lines, added lines) of every changed hunk."""
    plain, with_lib = _code_lines(PLAIN), _code_lines(WITH_LIB)
    matcher = difflib.SequenceMatcher(a=plain, b=with_lib, autojunk=False)
    return [(plain[i1:i2], with_lib[j1:j2])
            for tag, i1, i2, j1, j2 in matcher.get_opcodes() if tag != "equal"]


LOOP_HEADER = "    for step in range(1, args.steps + 1):"
"""The one unmarked line of the plain script the library version rewrites: its loop starts
after the step it resumed from (`run.start_step`)."""


def test_the_library_version_removes_the_nvrx_lines_and_rewrites_only_the_loop_header() -> None:
    """Every line marked `# NVRx` is gone (the four its docstring names: the import, the
    client, its init and the heartbeat); the only other line that changes is the loop header,
    rewritten in place by a `# rtj` line; nothing of the plain script is dropped unreplaced."""
    _, removed = _diff()
    marked = [line for line in _code_lines(PLAIN) if NVRX_MARK.search(line)]
    assert len(marked) == 4
    assert [line for line in removed if NVRX_MARK.search(line)] == marked
    assert [line for line in removed if not NVRX_MARK.search(line)] == [LOOP_HEADER]
    for old, new in _hunks():
        if LOOP_HEADER in old:
            assert new and all(RTJ_MARK.search(line) for line in new), new
            assert any("run.start_step + 1" in line for line in new), new
    assert not any(NVRX_MARK.search(line) for line in _code_lines(WITH_LIB))
    assert not any(RTJ_MARK.search(line) for line in _code_lines(PLAIN))


def test_the_library_version_removes_the_nvrx_lines_and_the_loop_header_only() -> None:
    """The claim of train_fsdp2_rtj.py's docstring: the `# rtj` lines replace the four NVRx
    lines and the loop header (the library's loop starts after the resumed step), nothing else
    of the plain script."""
    _, removed = _diff()
    nvrx = [line for line in _code_lines(PLAIN) if NVRX_MARK.search(line)]
    assert len(nvrx) == 4
    assert sorted(removed) == sorted([*nvrx, "    for step in range(1, args.steps + 1):"])


def _imported_modules(path: Path) -> list[str]:
    """Every module an import statement of `path` names (`from a import b` counts as `a.b`,
    since b may be a submodule), anywhere in the file."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path.name}: a relative import"
            assert node.module is not None
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("path", [PLAIN, WITH_LIB], ids=lambda p: p.name)
def test_no_script_imports_anything_of_the_trainer_but_its_library(path: Path) -> None:
    """A team's script may use `rtj_trainer.lib` (the supported surface) and nothing else of
    rtj_trainer: its internals may change under it."""
    trainer = [name for name in _imported_modules(path)
               if name == "rtj_trainer" or name.startswith("rtj_trainer.")]
    assert all(name == "rtj_trainer.lib" or name.startswith("rtj_trainer.lib.")
               for name in trainer), trainer
    if path == PLAIN:
        assert not [n for n in _imported_modules(path) if n.startswith(("rtj_", "rtj."))]
    else:
        assert trainer == ["rtj_trainer.lib"]


@pytest.mark.parametrize("path", [PLAIN, WITH_LIB], ids=lambda p: p.name)
def test_both_scripts_compile(path: Path) -> None:
    """Each example is valid Python as shipped."""
    compile(path.read_text(), str(path), "exec")
