"""Checks the Dockerfile's invariants by parsing it, because CI has no Docker engine to build it.

What matters, and is checked here: both targets exist; the operator image never takes anything
from trainer/ (nor from the whole build context, which holds trainer/); both images run as a
non-root user; the trainer image has Python 3.12 on Ubuntu 24.04 (glibc 2.39), where the
nvidia-resiliency-ext 0.7.0 cp312/manylinux_2_39 wheel installs with plain pip; no base image or
download is `latest`; the entrypoints are what the chart and the operator expect; and the
requirement lists the build derives from pyproject.toml hold the right packages for each image.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"


@dataclass(frozen=True, slots=True)
class Instruction:
    """One Dockerfile instruction: keyword (upper case), its argument text, heredoc bodies."""

    keyword: str
    args: str
    heredocs: tuple[str, ...] = ()


@dataclass(slots=True)
class Stage:
    """One build stage: its name, its base (ARGs substituted) and its instructions."""

    name: str
    base: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]


def _logical_lines(text: str) -> list[tuple[str, tuple[str, ...]]]:
    """Join continuation lines, drop comments, and collect `<<'EOF'` heredoc bodies."""
    raw = text.splitlines()
    out: list[tuple[str, tuple[str, ...]]] = []
    index = 0
    while index < len(raw):
        line = raw[index]
        index += 1
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = [line]
        while parts[-1].rstrip().endswith("\\"):
            parts[-1] = parts[-1].rstrip()[:-1]
            while index < len(raw) and raw[index].lstrip().startswith("#"):
                index += 1  # comments inside a continued instruction are dropped by Docker too
            parts.append(raw[index])
            index += 1
        joined = " ".join(p.strip() for p in parts)
        bodies = []
        for delimiter in re.findall(r"<<-?['\"]?([A-Za-z_]+)['\"]?", joined):
            body = []
            while raw[index].strip() != delimiter:
                body.append(raw[index])
                index += 1
            index += 1
            bodies.append("\n".join(body) + "\n")
        out.append((joined, tuple(bodies)))
    return out


def _substitute(text: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), text)


def parse_dockerfile(text: str) -> tuple[dict[str, str], dict[str, Stage]]:
    """Global ARG defaults (those before the first FROM) and the stages by name, in order."""
    global_args: dict[str, str] = {}
    stages: dict[str, Stage] = {}
    current: Stage | None = None
    for line, bodies in _logical_lines(text):
        keyword, _, rest = line.partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            words = rest.split()
            base = _substitute(words[0], global_args)
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else str(len(stages))
            current = stages[name] = Stage(name=name, base=base)
        elif current is None:
            if keyword == "ARG":
                key, _, value = rest.partition("=")
                global_args[key] = value
        else:
            current.instructions.append(Instruction(keyword, rest, bodies))
    return global_args, stages


def _copy_sources(instruction: Instruction) -> tuple[str | None, list[str]]:
    """(the --from stage or None, the source paths) of a COPY/ADD."""
    words = shlex.split(instruction.args)
    from_stage = next((w.split("=", 1)[1] for w in words if w.startswith("--from=")), None)
    paths = [w for w in words if not w.startswith("--")]
    return from_stage, paths[:-1]


def _stage_closure(stages: dict[str, Stage], target: str) -> list[Stage]:
    """The target stage and every stage it builds on or copies from, transitively."""
    seen: list[str] = []
    todo = [target]
    while todo:
        name = todo.pop()
        if name in seen or name not in stages:
            continue  # a name that is no stage is an external image
        seen.append(name)
        stage = stages[name]
        todo.append(stage.base)
        for copy in stage.all("COPY") + stage.all("ADD"):
            from_stage, _ = _copy_sources(copy)
            if from_stage:
                todo.append(from_stage)
    return [stages[name] for name in seen]


def _exec_form(instruction: Instruction) -> list[str]:
    value = json.loads(instruction.args)
    assert isinstance(value, list), f"{instruction.keyword} must use the exec (JSON) form"
    return value


@pytest.fixture(scope="module")
def parsed() -> tuple[dict[str, str], dict[str, Stage]]:
    return parse_dockerfile(DOCKERFILE.read_text())


@pytest.fixture(scope="module")
def stages(parsed: tuple[dict[str, str], dict[str, Stage]]) -> dict[str, Stage]:
    return parsed[1]


def test_the_dockerfile_has_an_operator_target_and_a_trainer_target(
    stages: dict[str, Stage],
) -> None:
    assert {"operator", "trainer"} <= set(stages)


def test_the_operator_image_never_copies_anything_from_trainer_or_the_whole_context(
    stages: dict[str, Stage],
) -> None:
    closure = _stage_closure(stages, "operator")
    assert "trainer" not in {s.name for s in closure}
    assert "trainer-build" not in {s.name for s in closure}
    local_sources = [
        path
        for stage in closure
        for copy in stage.all("COPY") + stage.all("ADD")
        for from_stage, paths in [_copy_sources(copy)]
        if from_stage is None
        for path in paths
    ]
    assert local_sources, "the operator image copies its package from the build context"
    for path in local_sources:
        normalized = path.strip("./")
        assert normalized, f"COPY {path!r} would bring the whole context, trainer/ included"
        assert not normalized.startswith("trainer"), f"the operator image copies {path!r}"
    assert "operator/rtj_operator" in [p.rstrip("/") for p in local_sources]


@pytest.mark.parametrize("target", ["operator", "trainer"])
def test_each_image_runs_as_a_numeric_non_root_user(stages: dict[str, Stage], target: str) -> None:
    users = stages[target].all("USER")
    assert users, f"{target} sets no USER, so it would run as root"
    uid = users[-1].args.split(":")[0]
    # Numeric, so the kubelet can check runAsNonRoot without resolving a user name.
    assert uid.isdigit(), f"{target} USER {users[-1].args!r} is not numeric"
    assert int(uid) != 0


def test_the_trainer_image_has_python_3_12_on_ubuntu_24_04_for_the_nvrx_wheel(
    stages: dict[str, Stage],
) -> None:
    # NVRx 0.7.0 ships only cp312/cp314 wheels for manylinux_2_39: Ubuntu 24.04 has glibc 2.39.
    for name in ("trainer-build", "trainer"):
        assert "ubuntu24.04" in stages[name].base, stages[name].base
        assert stages[name].base.split("/")[-1].startswith("cuda:"), stages[name].base
        installs = " ".join(i.args for i in stages[name].all("RUN") if "apt-get install" in i.args)
        assert re.search(r"\bpython3\.12\b", installs), f"{name} does not install python3.12"
    venvs = [i.args for i in stages["trainer-build"].all("RUN") if "-m venv" in i.args]
    assert venvs and all(v.startswith("python3.12 -m venv") for v in venvs)
    copies = [c.args for c in stages["trainer"].all("COPY")]
    assert "--from=trainer-build /opt/venv /opt/venv" in copies


def test_no_base_image_or_download_is_pinned_to_latest(
    parsed: tuple[dict[str, str], dict[str, Stage]],
) -> None:
    global_args, stages = parsed
    for stage in stages.values():
        if stage.base in stages:
            continue
        image, _, tag = stage.base.rpartition(":")
        assert image and "/" not in tag, f"{stage.name}: base {stage.base!r} has no tag"
        assert tag != "latest", f"{stage.name}: base {stage.base!r}"
        assert "$" not in stage.base, f"{stage.name}: unresolved ARG in {stage.base!r}"
    stage_args = {
        key: value
        for stage in stages.values()
        for arg in stage.all("ARG")
        for key, _, value in [arg.args.partition("=")]
    }
    for key, value in {**global_args, **stage_args}.items():
        assert value and value != "latest", f"ARG {key} has no pinned default"
    assert "latest" not in DOCKERFILE.read_text().replace("`latest`", "")


def test_the_operator_entrypoint_is_python_m_rtj_operator(stages: dict[str, Stage]) -> None:
    (entrypoint,) = stages["operator"].all("ENTRYPOINT")
    assert _exec_form(entrypoint) == ["python", "-m", "rtj_operator"]


def test_the_trainer_has_no_entrypoint_and_runs_python_m_rtj_trainer(
    stages: dict[str, Stage],
) -> None:
    # The CUDA base image has an entrypoint script; the operator passes the whole argv itself.
    assert _exec_form(stages["trainer"].all("ENTRYPOINT")[-1]) == []
    assert _exec_form(stages["trainer"].all("CMD")[-1]) == ["python", "-m", "rtj_trainer"]


def test_the_trainer_installs_a_cuda_torch_build_and_efa_with_aws_ofi_nccl(
    stages: dict[str, Stage],
) -> None:
    build_runs = " ".join(i.args for i in stages["trainer-build"].all("RUN"))
    assert "https://download.pytorch.org/whl/${TORCH_CUDA}" in build_runs
    torch_cuda = next(
        a.args.partition("=")[2]
        for a in stages["trainer-build"].all("ARG")
        if a.args.startswith("TORCH_CUDA=")
    )
    assert torch_cuda.startswith("cu"), torch_cuda
    final_runs = " ".join(i.args for i in stages["trainer"].all("RUN"))
    assert "efa_installer.sh" in final_runs and "--skip-kmod" in final_runs
    assert "/opt/amazon/ofi-nccl/lib" in final_runs  # the build fails if the plugin is missing


def _requirements_written_by_the_build(tmp_path: Path, stages: dict[str, Stage]) -> Path:
    """Run the requirements stage's own script against the repository's pyproject.toml."""
    (script,) = [i for i in stages["requirements"].all("RUN") if i.heredocs]
    out = tmp_path / "requirements"
    subprocess.run(
        [sys.executable, "-", str(out)],
        input=script.heredocs[0],
        text=True,
        cwd=REPO,
        check=True,
    )
    return out


def _names(requirements: str) -> set[str]:
    return {re.split(r"[<>=!~\[; ]", line, maxsplit=1)[0].lower() for line in requirements.split()}


def test_the_operator_requirements_hold_kopf_and_its_peers_but_no_torch_or_nvrx(
    tmp_path: Path, stages: dict[str, Stage]
) -> None:
    operator_requirements = (
        _requirements_written_by_the_build(tmp_path, stages) / "operator.txt"
    ).read_text()
    names = _names(operator_requirements)
    assert {"kopf", "kubernetes", "pydantic", "prometheus-client"} <= names
    assert not names & {"torch", "nvidia-resiliency-ext", "numpy"}


def test_the_trainer_requirements_pin_nvrx_0_7_0_and_keep_the_pyproject_pins(
    tmp_path: Path, stages: dict[str, Stage]
) -> None:
    trainer_requirements = (
        (_requirements_written_by_the_build(tmp_path, stages) / "trainer.txt")
        .read_text()
        .splitlines()
    )
    assert "nvidia-resiliency-ext==0.7.0" in trainer_requirements
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert trainer_requirements == [
        *project["dependencies"],
        *project["optional-dependencies"]["trainer"],
    ]


def test_the_dockerignore_lets_in_only_what_the_dockerfile_copies(
    stages: dict[str, Stage],
) -> None:
    lines = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert lines[0] == "*", "the context is an allow-list: .venv and .git stay out"
    allowed = {line[1:].rstrip("/") for line in lines if line.startswith("!")}
    copied = {
        path.rstrip("/")
        for stage in stages.values()
        for copy in stage.all("COPY")
        for from_stage, paths in [_copy_sources(copy)]
        if from_stage is None
        for path in paths
    }
    assert copied == allowed
