"""Generates the ResilientTrainingJob CustomResourceDefinition from the pydantic models.

`python -m rtj_operator.api.crd` prints the CRD as YAML (`make crds` writes it to `crds/` and the
Helm chart). The OpenAPI v3 schema is derived from `ResilientTrainingJob.model_json_schema()` and
made *structural* as the API server requires: references inlined, `Optional` unwrapped (absence
means unset), `Literal`s as string enums, untyped maps as `x-kubernetes-preserve-unknown-fields`.
The generator refuses to emit a schema in which a field lacks a description, or a string, list or
map lacks a maximum size (the API server's CEL cost estimator needs those bounds).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from rtj_operator import api
from rtj_operator.api import models

Schema = dict[str, Any]

PRINTER_COLUMNS: list[dict[str, Any]] = [
    {
        "name": "State",
        "type": "string",
        "jsonPath": ".status.state",
        "description": "One-word summary of the job's state.",
    },
    {
        "name": "Nodes",
        "type": "string",
        "jsonPath": ".status.nodes",
        "description": "Trainer pods ready/desired.",
    },
    {
        "name": "Step",
        "type": "integer",
        "jsonPath": ".status.step",
        "description": "Last step completed by every rank.",
    },
    {
        "name": "Restarts",
        "type": "integer",
        "jsonPath": ".status.restarts.total",
        "description": "Restarts of any kind.",
    },
    {
        "name": "Spares",
        "type": "integer",
        "jsonPath": ".status.spares.ready",
        "description": "Warm spare pods ready to take over.",
    },
    {
        "name": "Goodput",
        "type": "string",
        "jsonPath": ".status.goodput",
        "description": "Share of wall time spent in steps that were kept.",
    },
    {
        "name": "Last-Ckpt",
        "type": "integer",
        "jsonPath": ".status.lastCheckpoint.step",
        "description": "Step of the newest committed checkpoint.",
    },
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
    {
        "name": "Instance",
        "type": "string",
        "jsonPath": ".spec.instanceType",
        "priority": 1,
        "description": "EC2 instance type of the nodes.",
    },
    {
        "name": "Reason",
        "type": "string",
        "jsonPath": ".status.reason",
        "priority": 1,
        "description": "Reason of the current state.",
    },
    {
        "name": "Last-Incident",
        "type": "string",
        "jsonPath": ".status.incidents[-1:].cause",
        "priority": 1,
        "description": "Cause of the newest incident.",
    },
    {
        "name": "Message",
        "type": "string",
        "jsonPath": ".status.message",
        "priority": 1,
        "description": "The current state explained.",
    },
]

_DROPPED_KEYS = ("title", "propertyNames")


class SchemaError(ValueError):
    """The models cannot be turned into a schema the API server accepts with our standards."""


def _resolve(node: Schema, defs: dict[str, Schema]) -> Schema:
    """Turn one pydantic JSON-schema node into a structural OpenAPI v3 node."""
    node = dict(node)
    for key in _DROPPED_KEYS:
        node.pop(key, None)
    if "$ref" in node:
        target = _resolve(defs[node.pop("$ref").rsplit("/", 1)[-1]], defs)
        return _overlay(target, node)
    if "anyOf" in node and not node.get("x-kubernetes-int-or-string"):
        branches = [b for b in node.pop("anyOf") if b.get("type") != "null"]
        if len(branches) != 1:
            raise SchemaError(f"unions are not structural: {branches}")
        if node.get("default", ...) is None:
            node.pop("default")
        return _overlay(_resolve(branches[0], defs), node)
    if "const" in node:
        node["enum"] = [node.pop("const")]
        node.setdefault("type", "string")
    if node.get("type") == "object":
        if "properties" in node:
            node["properties"] = {k: _resolve(v, defs) for k, v in node["properties"].items()}
        extra = node.get("additionalProperties")
        if extra is False:
            del node["additionalProperties"]
        elif extra is True or node.get("x-kubernetes-preserve-unknown-fields"):
            node.pop("additionalProperties", None)
            node["x-kubernetes-preserve-unknown-fields"] = True
        elif isinstance(extra, dict):
            node["additionalProperties"] = _resolve(extra, defs)
    if node.get("type") == "array":
        node["items"] = _resolve(node["items"], defs)
    if node.get("type") == "integer":
        low, high = node.get("minimum"), node.get("maximum")
        int32 = low is not None and high is not None and low >= -(2**31) and high < 2**31
        node["format"] = "int32" if int32 else "int64"
    if node.get("default", ...) is None:
        node.pop("default")
    return node


def _overlay(target: Schema, outer: Schema) -> Schema:
    """Put a field's own keywords over the schema of its type (field description first)."""
    merged = dict(target)
    for key, value in outer.items():
        if key == "description" and "description" in target and value != target["description"]:
            merged[key] = f"{value}\n\n{target['description']}"
        elif key == "x-kubernetes-validations":
            merged[key] = [*target.get(key, []), *value]
        else:
            merged[key] = value
    return merged


_KEY_ORDER = ("description", "type", "format", "enum", "default")
_KEY_ORDER_LAST = ("properties", "required", "additionalProperties", "items")


def _unwrap_paragraphs(text: str) -> str:
    """Docstrings wrap lines at 100 columns; kubectl explain wraps by itself."""
    paragraphs = [" ".join(p.split()) for p in text.split("\n\n")]
    return "\n\n".join(p for p in paragraphs if p)


def _default_note(node: Schema) -> str:
    """kubectl explain does not print defaults; say them in the description of scalars/lists."""
    if "default" not in node or node.get("type") == "object":
        return ""
    value = node["default"]
    shown = value if isinstance(value, str) else json.dumps(value)
    return f" Default: `{shown}`."


def _tidy(node: Schema) -> Schema:
    """Stable, readable key order; unwrapped descriptions."""
    first = [k for k in _KEY_ORDER if k in node]
    last = [k for k in _KEY_ORDER_LAST if k in node]
    middle = sorted(k for k in node if k not in first and k not in last)
    tidy: Schema = {}
    for key in [*first, *middle, *last]:
        value = node[key]
        if key == "description":
            value = _unwrap_paragraphs(value) + _default_note(node)
        elif key == "properties":
            value = {name: _tidy(child) for name, child in value.items()}
        elif key in ("items", "additionalProperties") and isinstance(value, dict):
            value = _tidy(value)
        tidy[key] = value
    return tidy


def _walk(node: Schema, path: str) -> Iterator[tuple[str, Schema]]:
    yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _walk(child, f"{path}.{name}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{path}.*")
    if "items" in node:
        yield from _walk(node["items"], f"{path}[*]")


def check_standards(schema: Schema) -> None:
    """Every field described; every string, list and map bounded."""
    problems: list[str] = []
    for path, node in _walk(schema, ""):
        named_field = not path.endswith(("*", "[*]")) and path != ""
        if named_field and not node.get("description"):
            problems.append(f"{path}: no description")
        kind = node.get("type")
        bounded_string = "maxLength" in node or "enum" in node or "format" in node
        if kind == "string" and not bounded_string:
            problems.append(f"{path}: string without maxLength")
        if kind == "array" and "maxItems" not in node:
            problems.append(f"{path}: list without maxItems")
        if kind == "object" and "additionalProperties" in node and "maxProperties" not in node:
            problems.append(f"{path}: map without maxProperties")
    if problems:
        raise SchemaError("schema below our standards:\n  " + "\n  ".join(problems))


def openapi_schema() -> Schema:
    """The structural openAPIV3Schema of the CRD's only version."""
    raw = models.ResilientTrainingJob.model_json_schema(by_alias=True, mode="validation")
    defs = raw.pop("$defs", {})
    root = _resolve(raw, defs)
    props = root["properties"]
    # The API server owns metadata, apiVersion and kind; only name rules go in CEL at the root.
    props["metadata"] = {
        "type": "object",
        "properties": {
            "name": {
                "type": "string",
                "description": "Name of the job; see the rule on metadata.name below.",
            }
        },
    }
    for key in ("apiVersion", "kind"):
        props[key] = {
            "type": "string",
            "description": props[key]["description"],
            "maxLength": 253,
        }
    root["required"] = ["spec"]
    props["status"].pop("default", None)
    check_standards(
        {k: v for k, v in root.items() if k != "properties"}
        | {"properties": {k: v for k, v in props.items() if k != "metadata"}}
    )
    return _tidy(root)


def custom_resource_definition() -> dict[str, Any]:
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{api.PLURAL}.{api.GROUP}"},
        "spec": {
            "group": api.GROUP,
            "names": {
                "kind": api.KIND,
                "listKind": f"{api.KIND}List",
                "plural": api.PLURAL,
                "singular": api.SINGULAR,
                "shortNames": list(api.SHORT_NAMES),
                "categories": list(api.CATEGORIES),
            },
            "scope": "Namespaced",
            "versions": [
                {
                    "name": api.VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": PRINTER_COLUMNS,
                    "schema": {"openAPIV3Schema": openapi_schema()},
                }
            ],
        },
    }


class _Dumper(yaml.SafeDumper):
    """Block style for multi-line strings, no anchors, keys in model order."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str_representer(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str_representer)

HEADER = (
    "# Generated by `make crds` (python -m rtj_operator.api.crd) from\n"
    "# operator/rtj_operator/api/models.py. Do not edit by hand.\n"
)


def render() -> str:
    """The CRD as the YAML text committed in crds/ and the Helm chart."""
    body = yaml.dump(
        custom_resource_definition(),
        Dumper=_Dumper,
        sort_keys=False,
        width=100,
        allow_unicode=True,
    )
    return HEADER + body


CRD_FILE_NAME = f"{api.GROUP}_{api.PLURAL}.yaml"
REPO_ROOT = Path(__file__).resolve().parents[3]
CRD_PATHS = (
    Path("crds") / CRD_FILE_NAME,
    Path("charts") / "rtj-operator" / "crds" / CRD_FILE_NAME,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--write",
        action="store_true",
        help="write " + " and ".join(map(str, CRD_PATHS)) + " under the repository root "
        "instead of printing",
    )
    args = parser.parse_args(argv)
    text = render()
    if not args.write:
        sys.stdout.write(text)
        return
    for relative in CRD_PATHS:
        path = REPO_ROOT / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {relative}", file=sys.stderr)


if __name__ == "__main__":
    main()
