"""The soak's arithmetic (`bench.soak`) and its PNG charts (`bench.pngplot`), without a cluster."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from bench import pngplot
from bench.soak import parse_args, recovered, soak_job, summarize

pytestmark = pytest.mark.unit


def samples(rss: list[float], requests_per_minute: float, jobs: int) -> list[dict[str, float]]:
    """One sample a minute, the API requests growing by `requests_per_minute` per job."""
    return [{"t": 60.0 * i, "rss_mib": value, "cpu_seconds": 6.0 * i,
             "api_requests": requests_per_minute * jobs * i, "running": jobs}
            for i, value in enumerate(rss)]


def test_the_summary_compares_the_last_fifth_with_the_first_and_rates_per_job_minute() -> None:
    result = summarize(samples([100.0] * 5 + [105.0] * 5 + [110.0] * 5, 12.0, 4), jobs=4)
    assert result["rss_mib_first_fifth"] == 100.0 and result["rss_mib_last_fifth"] == 110.0
    assert result["rss_growth_percent"] == 10.0
    assert result["api_requests_per_job_minute_first_third"] == 12.0
    assert result["api_requests_per_job_minute_last_third"] == 12.0
    assert result["operator_cores_average"] == 0.1  # 6 CPU seconds a minute
    assert summarize(samples([1.0] * 3, 1.0, 1), jobs=1) == {"error": "only 3 samples"}


def test_every_fault_is_recovered_only_when_each_jobs_restarts_match_its_faults() -> None:
    faults = [{"t": 10.0, "job": "a"}, {"t": 20.0, "job": "b"}, {"t": 30.0, "job": "a"}]
    healthy = {"a": {"state": "Running", "restarts": {"rank": 2},
                     "incidents": [{"cause": "PodFailed"}] * 2},
               "b": {"state": "Running", "restarts": {"rank": 1},
                     "incidents": [{"cause": "PodFailed"}]}}
    result = recovered(healthy, faults, {})
    assert result["every_fault_recovered"] and result["false_alarms"] == 0
    assert result["faults_injected"] == 3
    lagging = healthy | {"b": {"state": "Running", "restarts": {"rank": 0}, "incidents": []}}
    assert not recovered(lagging, faults, {})["every_fault_recovered"]
    alarmed = recovered(healthy | {"b": {**healthy["b"], "incidents": [
        {"cause": "PodFailed"}, {"cause": "HeartbeatTimeout"}]}}, faults, {"a": 1})
    assert alarmed["false_alarms"] == 2  # an incident of another cause, a HeartbeatStale Event


def test_a_soak_job_has_a_rank_budget_its_faults_fit_in() -> None:
    args = parse_args(["--jobs", "10", "--minutes", "120", "--fault-every", "120"])
    body = soak_job(args, "soak-3")
    assert body["metadata"] == {"name": "soak-3"}
    assert body["spec"]["faultTolerance"]["rankRestartBudget"] == {"max": 9,
                                                                 "windowSeconds": 3600}
    with pytest.raises(SystemExit):
        parse_args(["--jobs", "0"])


def test_the_chart_is_a_valid_png_with_the_series_drawn(tmp_path: Path) -> None:
    path = tmp_path / "chart.png"
    panel = pngplot.Panel([([(0.0, 0.0), (10.0, 5.0)], pngplot.BLUE)], marks=[5.0])
    pngplot.draw([panel, panel], (0.0, 10.0), path, width=200, panel_height=100, margin=10)
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (200, 2 * 110 + 10)
    length = struct.unpack(">I", data[33:37])[0]
    assert data[37:41] == b"IDAT"
    rows = zlib.decompress(data[41:41 + length])
    assert len(rows) == height * (1 + 3 * width)
    pixels = {bytes(rows[at:at + 3]) for row in range(height)
              for at in range(row * (1 + 3 * width) + 1, (row + 1) * (1 + 3 * width), 3)}
    assert {bytes(pngplot.BLUE), bytes(pngplot.RED), b"\xff\xff\xff"} <= pixels
