"""A stop's wait for its checkpoint is bounded by the pod's termination budget (review-2 F5): a
rank SIGKILLed in the middle of a stop, before it wrote its shard, no longer holds the others for
the commit deadline (10 minutes); they give up together, claim no committed step, and exit."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from checkpoint_helpers import save_checkpoint
from rtj_trainer import checkpoint as ck
from rtj_trainer import lib as rtj
from rtj_trainer.checkpoint.tracking import PendingSave
from rtj_trainer.config import CheckpointConfig
from rtj_trainer.configload import build_config
from rtj_trainer.stop import STOP, StopAgreement
from test_trainer_stop import Ranks

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def no_stop_requested() -> Iterator[None]:
    STOP.reset()
    yield None
    STOP.disarm()
    STOP.reset()


def _ranks_with_a_lost_shard(root: Path, **cfg: object) -> list[ck.Checkpointer]:
    """Rank 0 and rank 1 of a 2-rank job: step 90 is complete, the stop's save of step 100 lacks
    rank 1's shard and record and has no error record (rank 1's pod was SIGKILLed first)."""
    directories = {step: save_checkpoint(root, step, commit=False) for step in (90, 100)}
    for name in (ck.shard_file_name(1, 2), ck.shard_record_name(1, 2)):
        (directories[100] / name).unlink()
    made = []
    for rank in (0, 1):
        one = ck.Checkpointer(CheckpointConfig(dir=str(root), interval_steps=0, **cfg),
                              root=root, rank=rank, world_size=2, device=torch.device("cpu"),
                              identity="a0-l0-i0-1")
        one._pending = [PendingSave(step, directory, time.time(), 0.0)
                        for step, directory in sorted(directories.items())]
        made.append(one)
    return made


def test_the_stop_budget_counts_from_the_signal_and_keeps_a_margin_to_leave() -> None:
    from rtj_trainer.stop import stop_budget

    assert stop_budget(108.0, requested_at=None, now=1000.0) == 103.0  # a peer's stop
    assert stop_budget(108.0, requested_at=980.0, now=1000.0) == 83.0  # signalled 20 s ago
    assert stop_budget(10.0, requested_at=None, now=1000.0) == 9.0  # a tenth when less than 5 s
    assert stop_budget(108.0, requested_at=800.0, now=1000.0) == 1.0  # spent: at least a second


def test_every_rank_gives_up_at_the_same_moment() -> None:
    ranks, found = Ranks(3), {}

    def rank_main(rank: int) -> None:
        agreement = StopAgreement(ranks.reduce_for(rank))
        found[rank] = agreement.common_budget([103.0, 83.5, 97.0][rank])

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert found == {0: 83.5, 1: 83.5, 2: 83.5}


def test_a_stop_whose_peer_never_wrote_its_shard_gives_up_within_its_budget(
        tmp_path: Path) -> None:
    leader, follower = _ranks_with_a_lost_shard(tmp_path)  # commit deadline: 600 s
    began = time.monotonic()
    assert not leader.wait_for_stop(100, began + 1.0)
    assert not follower.wait_for_stop(100, time.monotonic() + 0.5)
    assert time.monotonic() - began < 10
    assert leader.stats.committed_step == 90 and follower.stats.committed_step == 90
    leader.close(abort=True)


def test_the_trainers_stop_gives_up_within_its_budget_and_joins_no_more_collectives(
        tmp_path: Path) -> None:
    from rtj_trainer.trainer import Trainer

    leader, _ = _ranks_with_a_lost_shard(tmp_path)
    trainer = Trainer.__new__(Trainer)  # only what `stop` touches
    trainer.cfg = build_config(overrides=[f"checkpoint.dir={tmp_path}",
                                          "checkpoint.stop_timeout_seconds=2"])
    trainer.session = SimpleNamespace(section=lambda name: contextlib.nullcontext())
    trainer.rank, trainer.checkpointer, trainer.saved_step = 0, leader, 100
    trainer._losses, trainer.stop_committed = None, True
    calls: list[tuple[int, int]] = []

    def reduce(any_flag: int, all_flag: int) -> tuple[int, int]:
        calls.append((any_flag, all_flag))
        return any_flag, all_flag

    began = time.monotonic()
    assert trainer.stop(100, StopAgreement(reduce)) is False
    assert time.monotonic() - began < 10  # before: the commit deadline (600 s + 60 s)
    assert trainer.stop_committed is False and leader.stats.committed_step == 90
    assert len(calls) == 1  # the budget's all-reduce only: no verdict, no barrier after it
    leader.close(abort=True)


@pytest.fixture
def one_rank(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("RTJ_CHECKPOINT_DIR", str(tmp_path / "ckpt"))
    monkeypatch.setenv("RTJ_CHECKPOINT_INTERVAL_STEPS", "5")
    monkeypatch.setenv("RTJ_CHECKPOINT_MODE", "sync")
    monkeypatch.setenv("RTJ_TERMINATION_MESSAGE_PATH", str(tmp_path / "termination-log"))
    monkeypatch.setenv("RTJ_TERM_TIMEOUT_SECONDS", "2")  # as the launcher shim sets it
    for name in ("RTJ_METRICS_PORT", "FT_RANK_MONITOR_IPC_SOCKET", "RTJ_STOP_SIGNAL_DIR"):
        monkeypatch.delenv(name, raising=False)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield tmp_path
    dist.destroy_process_group()


def test_a_library_stop_whose_checkpoint_never_commits_ends_within_its_budget(
        one_rank: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rtj_trainer.checkpoint import checkpointer
    from rtj_trainer.lib import run as lib_run
    from rtj_trainer.stop import STOP_NOT_COMMITTED

    model = torch.nn.Linear(2, 2)
    run = rtj.init({"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)})
    assert run.cfg.stop_timeout_seconds == 2.0
    for step in range(1, 7):
        assert not run.step(step, 1.0)  # step 5 is saved and committed
    monkeypatch.setattr(checkpointer, "write_shard", lambda *args, **kwargs: None)  # lost
    exits: list[int] = []
    monkeypatch.setattr(lib_run, "exit_now", exits.append)
    STOP.request()
    began = time.monotonic()
    assert run.step(7, 1.0)  # every rank agreed to stop after step 7
    run.finish()
    assert time.monotonic() - began < 10  # before: the commit deadline (600 s + 60 s)
    assert exits == [0]
    said = json.loads((one_rank / "termination-log").read_text())
    assert said["outcome"] == "Stopped" and said["committedStep"] is None
    assert said["reason"] == STOP_NOT_COMMITTED and "newest commit is step 5" in said["message"]


def test_a_stop_without_its_checkpoint_claims_no_committed_step(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rtj_trainer import __main__ as main
    from rtj_trainer import termination
    from rtj_trainer.stop import STOP_NOT_COMMITTED
    from rtj_trainer.train import Finished

    monkeypatch.setenv(termination.PATH_ENV, str(tmp_path / "termination-log"))
    monkeypatch.setattr(main, "exit_soon", lambda code: None)
    STOP.request()
    assert main.stopped(Finished(summary=None, step=100, committed_step=90,
                                 committed_time=1.0, stopped=True,
                                 stop_committed=False)) == 0
    said = json.loads((tmp_path / "termination-log").read_text())
    assert said["outcome"] == "Stopped" and said["reason"] == STOP_NOT_COMMITTED
    assert said["committedStep"] is None and said["checkpoint"] is None  # no stop recorded


def test_the_launcher_shim_tells_its_workers_its_term_timeout() -> None:
    from rtj_trainer.launcher.shim import term_timeout

    assert term_timeout(["--nnodes=1", "--term-timeout=108", "--no-python", "x"]) == "108.0"
    assert term_timeout(["--term_timeout", "10", "x"]) == "10.0"
    assert term_timeout(["--nnodes=1", "x"]) is None
    cfg = build_config(env={"RTJ_TERM_TIMEOUT_SECONDS": "108.0"})
    assert cfg.checkpoint.stop_timeout_seconds == 108.0
    assert build_config(env={}).checkpoint.stop_timeout_seconds == 120.0


SYNC_BARRIER = '''
import os, sys, time, datetime
import torch.distributed as dist
rank = int(sys.argv[1])
store = dist.FileStore(sys.argv[2], 2)
dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=60))
if rank == 1:
    time.sleep(30)  # alive, never at the barrier: a peer the stop's SIGKILL is about to end
    sys.exit(0)
from rtj_trainer.checkpoint import CommitTimeoutError
from rtj_trainer.checkpoint.committer import barrier_until
began = time.monotonic()
try:
    barrier_until(time.monotonic() + 1.0, 7)
except CommitTimeoutError as exc:
    print(f"gave up after {time.monotonic() - began:.1f} s: {exc}", flush=True)
    os._exit(0)
os._exit(3)
'''


def test_a_synchronous_stop_save_gives_up_at_the_stops_deadline(tmp_path: Path) -> None:
    """review-2 F5, the Sync-mode gap: the synchronous save's barrier waited for a peer that
    never came until the collective timeout (60 s here, 600 s by default); with the stop's
    deadline it gives up at the deadline, as the async path does. Two real gloo ranks."""
    import subprocess
    import sys

    store = tmp_path / "store"
    ranks = [subprocess.Popen([sys.executable, "-c", SYNC_BARRIER, str(rank), str(store)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (0, 1)]
    try:
        out, err = ranks[0].communicate(timeout=45)
    finally:
        ranks[1].kill()
        ranks[1].communicate(timeout=30)  # reaped, its pipes closed
    assert ranks[0].returncode == 0, err[-2000:]
    assert "within the stop's budget" in out
    waited = float(out.split("gave up after ")[1].split(" s")[0])
    assert 1.0 <= waited < 30  # at the deadline, not at the 60 s collective timeout
