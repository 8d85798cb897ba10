"""The rendezvous store benchmark (`bench.rdzv_store`, issue #33) at a small size, for real:
nvrx-control with the operator's argv, 8 launchers making NVRx's rendezvous calls in two
processes, one of them lost and replaced, then 16 in-process wrapper ranks at their barriers."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.common import REPO_ROOT

pytestmark = pytest.mark.e2e

FIELDS = ("command", "launchers", "ranks_per_launcher", "ranks", "round_seconds",
          "restart_round_seconds", "rank_barrier_seconds", "server_cpu_seconds",
          "server_cpu_seconds_total", "server_peak_rss_mib", "client_errors", "round",
          "restart_round", "rank_barriers", "store_calls", "rank_store_calls", "server")


def test_eight_launchers_rendezvous_twice_and_their_ranks_pass_the_barriers(
        tmp_path: Path) -> None:
    out = tmp_path / "rdzv.json"
    run = subprocess.run(
        [sys.executable, "-m", "bench.rdzv_store", "--launchers", "8",
         "--ranks-per-launcher", "2", "--workers", "2", "--steady-seconds", "1",
         "--phase-timeout", "30", "--out", str(out), "--work-dir", str(tmp_path / "work")],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=55)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "[bench.rdzv_store] 8 launchers x 2 ranks" in run.stdout
    result = json.loads(out.read_text())
    assert all(name in result for name in FIELDS), sorted(set(FIELDS) - set(result))
    assert result["completed"] and result["client_errors"]["count"] == 0
    assert (result["launchers"], result["ranks_per_launcher"], result["ranks"]) == (8, 2, 16)
    assert result["server"]["argv"][0] == "nvrx-control"
    assert "--nnodes=8" in result["server"]["argv"]

    first, restart = result["round"], result["restart_round"]
    for round_ in (first, restart):  # every launcher got a distinct rank, 0..7, in a world of 8
        assert round_["completed"] == 8 and round_["assignment_ok"]
        assert round_["ranks_distinct"] and round_["ranks_are_0_to_n"]
        assert round_["world_sizes"] == [8] and round_["rank_is_pod_index"]
    assert first["rounds"] == [0] and restart["rounds"] == [1]
    assert restart["replacement_got_lost_rank"] and restart["lost_launcher"] == 4
    assert 0 < result["round_seconds"] < 30 and 0 < result["restart_round_seconds"] < 30
    closed = result["server"]["closed_round_seconds_after_its_start"]
    assert set(closed) == {"0", "1"}

    barriers = result["rank_barriers"]
    assert barriers["completed_clients"] == 16 and barriers["ranks_per_client"] == 1
    assert result["rank_barrier_seconds"] is not None and result["rank_barrier_seconds"] >= 0
    iteration = result["rank_store_calls"]["iteration_barrier"]
    # Each rank: the reentrant barrier's append and get, then get_terminated_ranks' append and
    # get; one wait per client.
    assert iteration["append"]["count"] == iteration["get"]["count"] == 2 * 16
    assert iteration["wait"]["count"] == 16

    joins = result["store_calls"]["round"]["add"]["count"]
    assert joins == 8  # one join_count add per launcher
    assert result["server_cpu_seconds"] >= 0 and result["server_cpu_seconds_total"] > 0
    assert result["server_peak_rss_mib"] > 0
    assert result["wrapper_store"]["peak_rss_mib"] > 0
