"""parallel.barrier and parallel.wait_for_peers, on two real gloo processes: the end-of-training
barrier keeps beating while a peer is slow and still ends (with the backend's error) when a peer
never comes; a peer later than the collective timeout still joins the process group."""

from __future__ import annotations

import itertools
import json
import multiprocessing
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from rtj_trainer import parallel

pytestmark = pytest.mark.e2e  # two real worker processes that wait on each other


def _rank(rank: int, store_path: str, out: str, late_seconds: float, timeout: float) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store_path, 2), rank=rank, world_size=2,
                            timeout=timedelta(seconds=timeout))
    beats: list[float] = []
    began = time.monotonic()
    error = None
    try:
        if rank == 1:
            if late_seconds < 0:
                time.sleep(timeout + 3)  # never comes within the timeout
                return
            time.sleep(late_seconds)
        parallel.barrier(lambda: beats.append(time.monotonic() - began),
                         timeout=timedelta(seconds=timeout), every_seconds=0.2)
    except Exception as exc:  # the backend's timeout
        error = type(exc).__name__
    Path(out).write_text(json.dumps({"beats": beats, "waited": time.monotonic() - began,
                                     "error": error}))


def _run(tmp_path: Path, late_seconds: float, timeout: float) -> dict[str, object]:
    ctx = multiprocessing.get_context("fork")  # torch is imported already: no second import
    out = tmp_path / "rank0.json"
    procs = [ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), str(out) if r == 0
                                             else str(tmp_path / "rank1.json"), late_seconds,
                                             timeout))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    result: dict[str, object] = json.loads(out.read_text())
    return result


def test_a_rank_waiting_for_a_slow_peer_keeps_beating(tmp_path: Path) -> None:
    result = _run(tmp_path, late_seconds=1.5, timeout=30)
    beats = result["beats"]
    assert isinstance(beats, list)
    assert result["error"] is None
    assert float(result["waited"]) >= 1.4  # type: ignore[arg-type]
    # A beat at once, then one every 0.2 s while the peer was away: none missing for long.
    assert beats[0] < 0.2
    assert len(beats) >= 6
    assert max(b - a for a, b in itertools.pairwise(beats)) < 0.5


def test_a_peer_that_never_comes_ends_the_wait_with_the_backends_error(tmp_path: Path) -> None:
    result = _run(tmp_path, late_seconds=-1, timeout=2)
    assert result["error"] is not None
    assert 1.5 <= float(result["waited"]) < 10  # type: ignore[arg-type]
    assert len(result["beats"]) >= 5  # type: ignore[arg-type]


def _late_rank(rank: int, store_path: str, out: str, late_seconds: float, wait: bool) -> None:
    store = dist.FileStore(store_path, 2)
    if rank == 1:
        time.sleep(late_seconds)
    began = time.monotonic()
    error = None
    try:
        if wait:
            parallel.wait_for_peers(store, 2)
        # gloo's own set-up waits at most the process group's timeout for a late peer
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                                timeout=timedelta(seconds=2))
        dist.barrier()
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
    Path(out).write_text(json.dumps({"waited": time.monotonic() - began, "error": error}))


def _join_late(tmp_path: Path, wait: bool) -> list[dict[str, object]]:
    ctx = multiprocessing.get_context("fork")
    outs = [tmp_path / f"late{r}.json" for r in range(2)]
    procs = [ctx.Process(target=_late_rank,
                         args=(r, str(tmp_path / "late-store"), str(outs[r]), 4.0, wait))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    return [json.loads(out.read_text()) if out.exists() else {"error": "no result"}
            for out in outs]


def test_a_rank_later_than_the_collective_timeout_still_joins_the_process_group(
        tmp_path: Path) -> None:
    """In-process restart on CPU: the process group's timeout is 5 s, and a peer later than
    that to `init_process_group` made the ranks that came first fail (one more restart).
    Waiting for the peers first, in Python, lets the group form however late one of them is."""
    results = _join_late(tmp_path, wait=True)
    assert [r["error"] for r in results] == [None, None]
    assert float(results[0]["waited"]) >= 3.5  # type: ignore[arg-type]
    # The same without the wait: the rank that came first gives up.
    (tmp_path / "late-store").unlink()
    without = _join_late(tmp_path, wait=False)
    assert without[0]["error"] is not None, without
