"""Who gets the checkpoint-and-stop signal when a pod ends: a worker that handles it registers
(rtj_trainer.stop `register`, a file `local-rank-<r>` in RTJ_STOP_SIGNAL_DIR), the launcher
shim reads the registrations (`registered_local_ranks`) and its patched shutdown signals only
those workers (rtj_trainer.nvrx.launcher `ask_workers_to_stop(only=...)`); every other worker
(a team's own script) keeps the torchrun convention, SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from rtj_trainer.nvrx import launcher
from rtj_trainer.stop import register, registered_local_ranks
from rtj_wire.env import STOP_SIGNAL_DIR

pytestmark = pytest.mark.unit

STOP_EXIT_CODE = 7
CHILD = f"""
import signal, sys
signal.signal(signal.SIGUSR2, lambda *_: sys.exit({STOP_EXIT_CODE}))
print("ready", flush=True)
while True:
    signal.pause()
"""
"""A worker that checkpoints and stops on SIGUSR2 (exit 7 here), and dies of SIGTERM."""


def test_register_writes_a_file_named_for_the_local_rank(tmp_path: Path) -> None:
    """Under the shim (RTJ_STOP_SIGNAL_DIR set) a worker registers as `local-rank-<r>`, the
    file holding its pid."""
    assert STOP_SIGNAL_DIR == "RTJ_STOP_SIGNAL_DIR"
    assert register(env={STOP_SIGNAL_DIR: str(tmp_path), "LOCAL_RANK": "3"}) is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["local-rank-3"]
    assert (tmp_path / "local-rank-3").read_text() == f"{os.getpid()}\n"


@pytest.mark.parametrize("env", [
    pytest.param({"LOCAL_RANK": "0"}, id="no-directory"),
    pytest.param({STOP_SIGNAL_DIR: "", "LOCAL_RANK": "0"}, id="empty-directory"),
    pytest.param({STOP_SIGNAL_DIR: "{dir}"}, id="no-local-rank"),
    pytest.param({STOP_SIGNAL_DIR: "{dir}", "LOCAL_RANK": "one"}, id="word"),
    pytest.param({STOP_SIGNAL_DIR: "{dir}", "LOCAL_RANK": "-1"}, id="negative"),
    pytest.param({STOP_SIGNAL_DIR: "{dir}", "LOCAL_RANK": ""}, id="empty-local-rank"),
    pytest.param({STOP_SIGNAL_DIR: "{dir}/gone", "LOCAL_RANK": "0"}, id="directory-gone"),
])
def test_register_returns_false_outside_the_shim_or_with_a_bad_local_rank(
        tmp_path: Path, env: dict[str, str]) -> None:
    """No directory, no usable LOCAL_RANK, or a directory that is gone: the worker is not
    registered (it then gets SIGTERM, as under torchrun), and nothing is written."""
    env = {k: v.format(dir=tmp_path) for k, v in env.items()}
    assert register(env=env) is False
    assert list(tmp_path.iterdir()) == []


def test_register_returns_false_for_a_local_rank_int_cannot_read(tmp_path: Path) -> None:
    """A LOCAL_RANK of Unicode digits that are not decimal ('²') is no local rank either (found
    by this test: str.isdigit() let them through to int())."""
    assert register(env={STOP_SIGNAL_DIR: str(tmp_path), "LOCAL_RANK": "²"}) is False


def test_registered_local_ranks_lists_the_registered_workers_and_nothing_else(
        tmp_path: Path) -> None:
    """The shim's side: the ranks of `local-rank-<digits>` files; every other name (a prefix
    alone, a word, another file, a directory) is ignored; a missing directory lists none."""
    for rank in ("0", "2", "7"):
        assert register(env={STOP_SIGNAL_DIR: str(tmp_path), "LOCAL_RANK": rank})
    for name in ("local-rank-", "local-rank-x", "local-rank--1", "rank-5", "notes.txt"):
        (tmp_path / name).write_text("")
    (tmp_path / "local-rank-sub").mkdir()
    assert registered_local_ranks(str(tmp_path)) == {0, 2, 7}
    assert registered_local_ranks(str(tmp_path / "missing")) == set()


def test_registered_local_ranks_ignores_a_name_int_cannot_read(tmp_path: Path) -> None:
    """A stray `local-rank-²` is another file to ignore, like `local-rank-x` (before the fix it
    made the launcher's shutdown raise before any worker was signalled)."""
    (tmp_path / "local-rank-1").write_text("")
    (tmp_path / "local-rank-²").write_text("")
    assert registered_local_ranks(str(tmp_path)) == {1}


@pytest.fixture
def workers() -> Iterator[list[subprocess.Popen[str]]]:
    """Two worker processes, local ranks 0 and 1, each ready (its SIGUSR2 handler set)."""
    procs = [subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        yield procs
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(5)
            assert proc.stdout is not None
            proc.stdout.close()


def _context(procs: list[subprocess.Popen[str]]) -> SimpleNamespace:
    """What ask_workers_to_stop reads of torchelastic's process context."""
    return SimpleNamespace(subprocess_handlers={
        rank: SimpleNamespace(proc=proc) for rank, proc in enumerate(procs)})


@pytest.fixture
def kills(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Every os.kill the test makes, recorded (and still made)."""
    made: list[tuple[int, int]] = []
    real = os.kill

    def kill(pid: int, sig: int) -> None:
        made.append((pid, sig))
        real(pid, sig)

    monkeypatch.setattr(os, "kill", kill)
    return made


def test_only_the_registered_local_rank_gets_the_stop_signal(
        workers: list[subprocess.Popen[str]], kills: list[tuple[int, int]]) -> None:
    """With only={1}: SIGUSR2 goes to local rank 1's process alone, which stops (exit 7), and
    the call returns when it exited, with time left; local rank 0 runs on, for ft_launcher's
    own SIGTERM."""
    rank0, rank1 = workers
    left = launcher.ask_workers_to_stop(_context(workers), 10.0, signal.SIGUSR2, only={1})
    assert kills == [(rank1.pid, signal.SIGUSR2)]
    assert rank1.returncode == STOP_EXIT_CODE
    assert 0.0 < left <= 10.0
    assert rank0.poll() is None
    rank0.terminate()
    assert rank0.wait(5) == -signal.SIGTERM


def test_no_registered_rank_means_no_signal_and_the_whole_timeout_back(
        workers: list[subprocess.Popen[str]], kills: list[tuple[int, int]]) -> None:
    """With only=set() (no worker registered: a team's own script) nothing is sent and the
    whole timeout is returned at once, for ft_launcher's SIGTERM."""
    assert launcher.ask_workers_to_stop(_context(workers), 10.0, signal.SIGUSR2,
                                        only=set()) == 10.0
    assert kills == []
    assert all(proc.poll() is None for proc in workers)


def test_without_only_every_live_worker_gets_the_stop_signal(
        workers: list[subprocess.Popen[str]], kills: list[tuple[int, int]]) -> None:
    """only=None (the built-in trainer, which always handles it): every worker is signalled,
    and both stop."""
    launcher.ask_workers_to_stop(_context(workers), 10.0, signal.SIGUSR2, only=None)
    assert sorted(kills) == sorted((proc.pid, signal.SIGUSR2) for proc in workers)
    assert [proc.returncode for proc in workers] == [STOP_EXIT_CODE, STOP_EXIT_CODE]
