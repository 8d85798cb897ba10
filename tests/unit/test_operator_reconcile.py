"""The pure helpers of a reconcile pass (`rtj_operator.reconcile`)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.unit


def test_the_status_patch_holds_only_changed_fields_and_removals() -> None:
    from rtj_operator.reconcile import status_patch

    current = {"state": "Running", "step": 10, "startTime": "2026-11-29T12:00:00Z"}
    desired = {"state": "Running", "step": 11, "startTime": None, "nodes": "2/2"}
    assert status_patch(current, desired) == {"step": 11, "startTime": None, "nodes": "2/2"}
