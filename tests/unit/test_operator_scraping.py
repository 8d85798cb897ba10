"""The pure half of scraping: a rank's /metrics text into a `RankSample`."""

from __future__ import annotations

import pytest
from rtj_operator.observed import RankSample
from rtj_operator.scraping import rank_sample_from_text

pytestmark = pytest.mark.unit

METRICS = """\
# HELP rtj_trainer_heartbeat_timestamp_seconds unix time of the last heartbeat
# TYPE rtj_trainer_heartbeat_timestamp_seconds gauge
rtj_trainer_heartbeat_timestamp_seconds{local_rank="1",rank="3"} 1.7e+09
# TYPE rtj_trainer_step gauge
rtj_trainer_step{local_rank="1",rank="3"} 42.0
# TYPE rtj_trainer_checkpoint_committed_step gauge
rtj_trainer_checkpoint_committed_step{local_rank="1",rank="3"} 40.0
# TYPE rtj_trainer_checkpoint_committed_timestamp_seconds gauge
rtj_trainer_checkpoint_committed_timestamp_seconds{local_rank="1",rank="3"} 1.69999e+09
# TYPE rtj_trainer_goodput_ratio gauge
rtj_trainer_goodput_ratio{local_rank="1",rank="3"} 0.93
# TYPE rtj_trainer_restarts counter
rtj_trainer_restarts_total{kind="launcher",local_rank="1",rank="3"} 2.0
rtj_trainer_restarts_total{kind="inprocess",local_rank="1",rank="3"} 1.0
rtj_trainer_restarts_total{kind="pod",local_rank="1",rank="3"} 0.0
# TYPE python_gc_objects_collected counter
python_gc_objects_collected_total{generation="0"} 100.0
"""


def test_a_metrics_page_becomes_a_rank_sample() -> None:
    sample = rank_sample_from_text(METRICS, local_rank=1)
    assert sample == RankSample(
        local_rank=1, rank=3, heartbeat=1.7e9, step=42, committed_step=40,
        committed_time=1.69999e9, goodput_ratio=0.93,
        restarts={"launcher": 2, "inprocess": 1, "pod": 0},
    )


def test_no_checkpoint_and_no_heartbeat_yet_read_as_unknown() -> None:
    text = ('rtj_trainer_checkpoint_committed_step{local_rank="0",rank="0"} -1.0\n'
            'rtj_trainer_heartbeat_timestamp_seconds{local_rank="0",rank="0"} 0.0\n')
    sample = rank_sample_from_text(text, local_rank=0)
    assert sample.committed_step is None and sample.heartbeat is None and sample.step is None


def test_an_urgent_read_takes_a_shared_slot_while_one_is_free() -> None:
    """At 5,000 pods the reads at heartbeat deadlines are most of the reads; through the
    urgent slots alone (an eighth) they lagged 4.5 s behind their deadlines (bench.scale,
    2026-12-05). They keep slots of their own for when a sweep holds every shared one."""
    import asyncio

    from rtj_operator.scraping import Scraper

    async def slots() -> tuple[bool, bool, bool]:
        scraper = Scraper(concurrency=2, timeout_seconds=1.0)
        _, free = scraper._client(True)
        shared_first = free is scraper._slots
        _, sweep = scraper._client(False)
        async with sweep, sweep:  # a sweep holds both shared slots
            _, busy = scraper._client(True)
            own_when_busy = busy is scraper._urgent_slots
        _, normal = scraper._client(False)
        await scraper.close()
        return shared_first, own_when_busy, normal is scraper._slots

    assert asyncio.run(slots()) == (True, True, True)
