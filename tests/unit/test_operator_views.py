"""The records the operator observes (`rtj_operator.views`) and what they tell about a node."""

from __future__ import annotations

import pytest
from rtj_operator.views import NodeLiveness, RankSample

pytestmark = pytest.mark.unit


def test_a_node_is_known_only_when_every_rank_answered() -> None:
    one = RankSample(local_rank=0, heartbeat=10.0, step=5)
    two = RankSample(local_rank=1, heartbeat=12.0, step=4)
    assert NodeLiveness(node_index=0, pod_uid="u", samples=(one, two), expected_ranks=2).step == 4
    full = NodeLiveness(node_index=0, pod_uid="u", samples=(one, two), expected_ranks=2)
    assert full.heartbeat == 10.0
    half = NodeLiveness(node_index=0, pod_uid="u", samples=(one,), expected_ranks=2)
    assert half.heartbeat is None and half.step is None
