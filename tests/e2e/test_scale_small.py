"""A small run of `bench.scale`: the real operator watching 100 simulated p5 nodes (800 ranks)
on the real kube-apiserver, one rank hung and one pod killed; no false alarms, detection within
the bound (docs/benchmarks.md, "Scale")."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from bench import scale

pytestmark = [pytest.mark.e2e]

RECONCILE_INTERVAL_SECONDS = 3.0
"""The operator's default pass interval: a hang is seen at most one pass after its threshold."""


def test_100_nodes_of_8_ranks_no_false_alarm_and_detection_within_the_bound(
    tmp_path: Path,
) -> None:
    args = scale.parse_args(["--nodes", "100", "--procs-per-node", "8", "--jobs", "1",
                             "--minutes", "1.4", "--seed", "3", "--start-timeout", "150",
                             "--work-dir", str(tmp_path / "run")])
    result = asyncio.run(scale.run(args))
    assert result["false_positives"] == 0, result["false_positive_pods"]
    assert result["missed_detections"] == []
    assert result["observation_degraded_jobs"] == []
    hangs, kills = result["hang_detection_excess_over_threshold_seconds"], \
        result["kill_detection_seconds"]
    assert hangs["n"] >= 1 and kills["n"] >= 1, result
    assert hangs["max"] <= RECONCILE_INTERVAL_SECONDS + 2, result
    assert kills["max"] <= 5, result
