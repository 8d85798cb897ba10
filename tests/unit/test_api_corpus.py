"""The invalid-manifest corpus, judged by the pydantic models instead of the API server.

tests/integration/invalid/ holds manifests the API server must reject, each naming the field the
error must mention (`# expect-field:`). The operator parses objects with the pydantic models, so
those must refuse the same manifests and name the same field: this keeps the CEL rules of the CRD
and the validators of the models in step. Update cases (immutability, `# update:`) need an old
object and are only checked against the API server.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from rtj_operator.api import models

pytestmark = pytest.mark.unit

CORPUS = Path(__file__).resolve().parents[1] / "integration" / "invalid"
CREATE_CASES = sorted(p for p in CORPUS.glob("*.yaml") if "\n# update:" not in p.read_text())


def expected_fields(text: str) -> list[str]:
    header = text.splitlines()[0]
    assert header.startswith("# expect-field: "), "the first line names the expected field"
    return header.removeprefix("# expect-field: ").split(" or ")


def location(loc: tuple[int | str, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def within(path: str, prefix: str) -> bool:
    return path == prefix or re.match(re.escape(prefix) + r"[.\[]", path) is not None


def names_field(error: dict[str, Any], field: str) -> bool:
    """The error sits at the field, or at an enclosing object and says the field's name."""
    where = location(error["loc"])
    leaf = re.split(r"[.\[]", field)[-1].rstrip("]")
    return within(where, field) or (within(field, where) and leaf in error["msg"])


def test_the_corpus_has_at_least_forty_manifests() -> None:
    assert len(list(CORPUS.glob("*.yaml"))) >= 40


@pytest.mark.parametrize("path", CREATE_CASES, ids=lambda p: p.stem)
def test_the_models_refuse_the_manifest_and_name_the_field(path: Path) -> None:
    text = path.read_text()
    field = expected_fields(text)[0]
    with pytest.raises(ValidationError) as caught:
        models.parse_job(yaml.safe_load(text))
    errors = caught.value.errors()
    assert any(names_field(dict(e), field) for e in errors), (field, errors)
