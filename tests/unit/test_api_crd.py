"""The generated CRD: committed copies are up to date and the schema meets our standards.

`make crds` regenerates crds/ and the chart's copy from the pydantic models; this test fails when
someone edits the models and forgets to, or edits the YAML by hand.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from rtj_operator import api, profiles
from rtj_operator.api import crd, spec_fault_tolerance

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("relative", crd.CRD_PATHS, ids=str)
def test_the_committed_crd_is_the_generated_one(relative: Path) -> None:
    committed = (REPO / relative).read_text()
    assert committed == crd.render(), f"{relative} is stale: run `make crds`"


def schema() -> dict[str, Any]:
    return crd.custom_resource_definition()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}.*")
    if "items" in node:
        yield from walk(node["items"], f"{path}[*]")


def test_the_crd_names_the_kind_as_the_design_says() -> None:
    spec = crd.custom_resource_definition()["spec"]
    assert spec["group"] == "training.resilient.dev" and spec["scope"] == "Namespaced"
    assert spec["names"]["shortNames"] == ["rtj"]
    assert spec["names"]["plural"] == "resilienttrainingjobs"
    version = spec["versions"][0]
    assert version["name"] == api.VERSION and version["subresources"] == {"status": {}}


def test_the_printer_columns_are_the_promised_ones() -> None:
    columns = crd.custom_resource_definition()["spec"]["versions"][0]["additionalPrinterColumns"]
    default = [c["name"].upper() for c in columns if not c.get("priority")]
    assert default == ["STATE", "NODES", "STEP", "RESTARTS", "SPARES", "GOODPUT", "LAST-CKPT",
                       "AGE"]
    assert {c["name"].upper() for c in columns if c.get("priority") == 1} >= {
        "INSTANCE",
        "REASON",
        "LAST-INCIDENT",
    }


def test_every_field_has_a_description_and_every_string_list_and_map_a_bound() -> None:
    crd.check_standards(
        {"properties": {k: v for k, v in schema()["properties"].items() if k != "metadata"}}
    )
    for path, node in walk(schema()):
        if node.get("type") == "array":
            assert "maxItems" in node, path


def test_the_schema_is_structural_every_node_has_a_type_or_is_int_or_string() -> None:
    for path, node in walk(schema()):
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert "$ref" not in node and "allOf" not in node and "title" not in node, path
        if "anyOf" in node:
            assert node.get("x-kubernetes-int-or-string"), path


def test_crd_defaults_are_the_model_defaults() -> None:
    spec = schema()["properties"]["spec"]["properties"]
    assert spec["faultTolerance"]["default"] == spec_fault_tolerance.FaultTolerance().to_api()
    assert spec["instanceType"]["default"] == profiles.DEFAULT_INSTANCE_TYPE
    assert spec["checkpoint"]["properties"]["mountPath"]["default"] == "/checkpoints"
    assert spec["command"]["default"] == ["python", "-m", "rtj_trainer"]


def test_the_profile_rule_lists_exactly_the_built_in_profiles() -> None:
    rules = schema()["properties"]["spec"]["x-kubernetes-validations"]
    profile_rule = next(r for r in rules if r["fieldPath"] == ".resources")
    for instance_type in profiles.BUILT_IN_PROFILES:
        assert f"'{instance_type}'" in profile_rule["rule"]


def test_every_cel_rule_has_a_message_that_names_a_field() -> None:
    for path, node in walk(schema()):
        for rule in node.get("x-kubernetes-validations", []):
            leaf = rule.get("fieldPath", path).rsplit(".", 1)[-1]
            assert leaf and leaf in rule["message"], (path, rule)


def test_printing_to_stdout_is_the_default(capsys: pytest.CaptureFixture[str]) -> None:
    crd.main([])
    assert yaml.safe_load(capsys.readouterr().out)["kind"] == "CustomResourceDefinition"


def test_docs_api_md_mentions_every_spec_and_status_field() -> None:
    doc = (REPO / "docs" / "api.md").read_text()
    root = schema()["properties"]
    spec = root["spec"]["properties"]
    names = [
        *spec,
        *spec["checkpoint"]["properties"],
        *spec["faultTolerance"]["properties"],
        *spec["podTemplate"]["properties"],
        *root["status"]["properties"],
    ]
    missing = [name for name in names if name not in doc]
    assert not missing, f"docs/api.md does not mention {missing}"
