"""What the spec sections (`spec_*.py`) and the resource (`models.py`) share: the size limits and
patterns of fields, the bounded string and quantity types, and the helpers that write CEL rules
(`x-kubernetes-validations`) next to the fields they guard.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Field, WithJsonSchema

# --- limits -----------------------------------------------------------------------------------

INT32_MAX = 2**31 - 1
DNS_LABEL_1035 = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
    r"(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)
RESERVED_ENV_PREFIX = "RTJ_"
JOB_REFERENCE = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?/[a-z]([-a-z0-9]*[a-z0-9])?$"
"""`<namespace>/<name>` of a job."""
JobReference = Annotated[str, Field(pattern=JOB_REFERENCE, max_length=317)]

# --- shared types -----------------------------------------------------------------------------


def _number_to_quantity_string(value: object) -> object:
    """YAML `cpu: 4` arrives as an int; Kubernetes quantities are int-or-string."""
    if isinstance(value, bool):
        return value  # let the str validator reject it
    if isinstance(value, int | float):
        return str(value)
    return value


Quantity = Annotated[
    str,
    BeforeValidator(_number_to_quantity_string),
    Field(pattern=QUANTITY_PATTERN, max_length=64),
    WithJsonSchema(
        {
            "anyOf": [{"type": "integer"}, {"type": "string"}],
            "x-kubernetes-int-or-string": True,
            "pattern": QUANTITY_PATTERN,
        }
    ),
]
"""A Kubernetes resource quantity such as `4`, `500m`, `1800Gi`."""

ShortString = Annotated[str, Field(max_length=253)]
LabelValue = Annotated[str, Field(max_length=63)]
LabelKey = Annotated[str, Field(max_length=317)]  # prefix (253) + "/" + name (63)
AnnotationValue = Annotated[str, Field(max_length=4096)]
Argument = Annotated[str, Field(max_length=4096)]


def cel(
    rule: str,
    message: str,
    *,
    field_path: str | None = None,
    reason: str | None = None,
) -> dict[str, str]:
    """One `x-kubernetes-validations` entry."""
    entry = {"rule": rule, "message": message}
    if field_path is not None:
        entry["fieldPath"] = field_path
    if reason is not None:
        entry["reason"] = reason
    return entry


def validations(*rules: dict[str, str]) -> dict[str, Any]:
    return {"x-kubernetes-validations": list(rules)}


def immutable(field_name: str) -> dict[str, Any]:
    return validations(cel("self == oldSelf", f"{field_name} is immutable"))


def same_optional(field_name: str, path: str) -> dict[str, str]:
    """Immutability of an optional field: it may not be added, removed or changed."""
    return cel(
        f"has(self.{field_name}) == has(oldSelf.{field_name}) && "
        f"(!has(self.{field_name}) || self.{field_name} == oldSelf.{field_name})",
        f"{path} is immutable",
        field_path=f".{field_name}",
    )
