"""What the spec models (`models.py`) and the status models (`status.py`) share: the base class
of every API model and the one size limit both use.

It is a module of its own only so that `status.py` does not import `models.py`, which imports
the status models for `ResilientTrainingJob.status`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel

MAX_NODES = 8192
"""Most trainer pods (node indexes) of one job: spec.nodes and status.ranks are bounded by it
(16,384 H100s in p5 nodes are 2,048 nodes; docs/scale.md)."""


class ApiModel(BaseModel):
    """Base of every API model: camelCase aliases, snake_case attributes, unknown fields rejected.

    Strict like the API server: `"2"` is not an integer and `"yes"` is not a boolean. Timestamps
    are the exception (they arrive as RFC 3339 strings).
    """

    model_config = ConfigDict(
        populate_by_name=True, extra="forbid", alias_generator=to_camel, strict=True
    )

    def to_api(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase keys, JSON types, unset omitted."""
        return self.model_dump(by_alias=True, exclude_none=True, mode="json")

