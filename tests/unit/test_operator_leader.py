"""The leader-election rule (`rtj_operator.leader.may_acquire`), table-tested without a clock."""

from __future__ import annotations

import pytest
from rtj_operator.leader import Seen, may_acquire

pytestmark = pytest.mark.unit


def seen(holder: str, at: float = 100.0, duration: float = 15.0) -> Seen:
    return Seen(holder=holder, resource_version="1", lease_duration_seconds=duration, seen_at=at)


@pytest.mark.parametrize(
    ("record", "now", "allowed", "why"),
    [
        (None, 0.0, True, "no Lease yet: create it"),
        (seen(""), 100.0, True, "released: no holder"),
        (seen("me"), 100.0, True, "ours: renew"),
        (seen("other"), 100.0, False, "just seen changing"),
        (seen("other"), 114.9, False, "changed less than a lease duration ago"),
        (seen("other"), 115.0, True, "unchanged for a lease duration: the holder is gone"),
        (seen("other", duration=1.0), 101.0, True, "the holder's own (short) duration counts"),
    ],
)
def test_may_acquire(record: Seen | None, now: float, allowed: bool, why: str) -> None:
    assert may_acquire(record, "me", now) is allowed, why
