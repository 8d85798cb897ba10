"""bench.scale's simulated ranks: the `/ranks` document its pods serve reads, through the
operator's own parser, as the ranks the benchmark means (a hung rank's heartbeat frozen, the
others beating)."""

from __future__ import annotations

import json

import pytest
from rtj_operator.scraping import node_liveness_from_json

from bench.simnodes import SimPod, ranks_document

pytestmark = pytest.mark.unit


def test_the_operator_reads_the_simulated_ranks_with_one_hung() -> None:
    pod = SimPod(namespace="scale", name="job-000-2", uid="u-2", job="job-000", role="trainer",
                 index=2, attempt=0, node="sim-p5-00003", ip="127.9.0.1", started=1000.0)
    pod.hung[1] = 1004.0
    document = ranks_document(pod, procs=4, now=1010.7)
    liveness = node_liveness_from_json(json.dumps(document), node_index=2, pod_uid=pod.uid,
                                       procs=4)
    assert [s.local_rank for s in liveness.samples] == [0, 1, 2, 3]
    assert [s.rank for s in liveness.samples] == [8, 9, 10, 11]
    assert [s.heartbeat for s in liveness.samples] == [1010.0, 1004.0, 1010.0, 1010.0]
    assert {s.step for s in liveness.samples} == {10}
    assert not any(s.standby for s in liveness.samples) and not liveness.finished
