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


def test_no_trainer_metric_uses_a_label_prometheus_reserves_for_the_scrape() -> None:
    # review-2: `rtj_trainer_info{job=...}` clashed with the scrape's own `job` (and `instance`)
    # labels; the job is `job_name`, as on the operator's metrics.
    import re

    text = generate_latest(TrainerMetrics(rank=0, local_rank=0, job="ns/j", attempt=2)
                           .registry).decode()
    samples = [ln for ln in text.splitlines() if ln.startswith("rtj_")]
    labels = {name for ln in samples for name in re.findall(r'[{,](\w+)="', ln)}
    assert labels and not labels & {"job", "instance"}, labels
    assert any(ln.startswith("rtj_trainer_info{") and 'job_name="ns/j"' in ln
               and 'attempt="2"' in ln for ln in samples)
    for ln in samples:  # one prefix, snake case
        name = ln.split("{", 1)[0].split(" ", 1)[0]
        assert re.fullmatch(r"rtj_trainer_[a-z0-9_]+", name), name
