"""The collector reads its source on every scrape, and keeps the last values when let go."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest
from rtj_trainer.metrics import Snapshot, TrainerMetrics

pytestmark = pytest.mark.unit


def _heartbeat(metrics: TrainerMetrics) -> str:
    text = generate_latest(metrics.registry).decode()
    (line,) = [ln for ln in text.splitlines()
               if ln.startswith("rtj_trainer_heartbeat_timestamp_seconds{")]
    return line.rsplit(" ", 1)[1]


def test_every_scrape_reads_the_source_and_unwatch_keeps_the_last_values() -> None:
    metrics = TrainerMetrics(rank=0, local_rank=0, job="j", attempt=0)
    assert _heartbeat(metrics) == "0.0"
    beat = [1.0]
    metrics.watch(lambda: Snapshot(heartbeat_timestamp=beat[0]))
    beat[0] = 2.0  # e.g. a keepalive beat while a checkpoint wait blocks the step loop
    assert _heartbeat(metrics) == "2.0"
    metrics.unwatch()
    beat[0] = 3.0
    assert _heartbeat(metrics) == "2.0"
