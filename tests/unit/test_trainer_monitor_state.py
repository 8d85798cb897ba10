"""The heartbeats of a script that sends NVRx heartbeats and serves no metrics page, on their way to
the operator: each rank monitor writes what it receives to a small file
(rtj_trainer.nvrx.monitorstate: `export_rank_monitor_state`, `_StateFile`, `read_monitor_state`),
the pod endpoint lists such a rank from it (`PodRanks(monitor=...)`, `"source": "nvrx"`), and the
operator reads the document back (`rtj_operator.scraping.node_liveness_from_json`)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import json
import logging
import os
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from nvidia_resiliency_ext.fault_tolerance.data import (
    HeartbeatMsg,
    InitMsg,
    OkMsg,
    RankInfo,
    SectionAction,
    SectionMsg,
)
from nvidia_resiliency_ext.fault_tolerance.rank_monitor_server import RankMonitorServer
from nvidia_resiliency_ext.fault_tolerance.rank_monitor_state_machine import (
    RankMonitorStateMachine,
)
from prometheus_client.exposition import generate_latest
from rtj_operator.scraping import node_liveness_from_json
from rtj_trainer.launcher.podmetrics import PodRanks
from rtj_trainer.metrics import Snapshot, TrainerMetrics
from rtj_trainer.nvrx import monitorstate as launcher
from rtj_trainer.nvrx.monitorstate import (
    MONITOR_STATE_BYTES,
    MONITOR_STATE_DIR_ENV,
    MonitorState,
    _StateFile,
    export_rank_monitor_state,
    read_monitor_state,
)

pytestmark = pytest.mark.unit

HANDLERS = ("_handle_init_msg", "_handle_heartbeat_msg", "_handle_section_msg",
            "_handle_ipc_connection_lost")


def _state_file(directory: Path, local_rank: int, monkeypatch: pytest.MonkeyPatch) -> _StateFile:
    """A rank monitor's file as the monitor process of `local_rank` opens it (env from the
    shim and from ft_launcher)."""
    monkeypatch.setenv(MONITOR_STATE_DIR_ENV, str(directory))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    return _StateFile()


@pytest.fixture
def files() -> Iterator[list[_StateFile]]:
    """State files a test opens; their descriptors are closed after it."""
    opened: list[_StateFile] = []
    yield opened
    for file in opened:
        if file.fd is not None:
            os.close(file.fd)


def test_the_state_file_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    files: list[_StateFile]) -> None:
    """What a monitor writes for its local rank reads back equal, each record replacing the
    last in place (a shorter one too), the file always MONITOR_STATE_BYTES long."""
    file = _state_file(tmp_path, 2, monkeypatch)
    files.append(file)
    full = MonitorState(connected=True, heartbeat=1_712_345_678.123456, rank=4095,
                        connected_at=1_712_345_600.5)
    file.write(full)
    assert read_monitor_state(str(tmp_path), 2) == full == file.state
    assert read_monitor_state(str(tmp_path), 1) is None  # another local rank: none yet
    file.write(MonitorState(connected=False))
    assert read_monitor_state(str(tmp_path), 2) == MonitorState(connected=False)
    assert (tmp_path / "rank-2.json").stat().st_size == MONITOR_STATE_BYTES


def test_without_the_directory_the_state_is_kept_but_nothing_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside the shim (no RTJ_RANK_MONITOR_STATE_DIR) a monitor writes no file and goes on."""
    monkeypatch.delenv(MONITOR_STATE_DIR_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    file = _StateFile()
    file.write(MonitorState(connected=True, rank=1))
    assert file.state == MonitorState(connected=True, rank=1) and file.fd is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", [
    pytest.param(b"", id="empty"),
    pytest.param(b'{"connected":true,"heartbeat":17', id="torn"),
    pytest.param(b"\x00" * MONITOR_STATE_BYTES, id="zeros"),
    pytest.param(b"garbage", id="garbage"),
    pytest.param(b'{"connected":true,"pid":7}', id="unknown-key"),
    pytest.param(b"[true]", id="a-list"),
    pytest.param(b"\xff\xfe{", id="not-utf8"),
])
def test_a_torn_or_garbage_file_reads_as_none(tmp_path: Path, content: bytes) -> None:
    """A reader that catches a record half written, or a file of anything else, sees no state
    (the next read retries), never an exception."""
    (tmp_path / "rank-0.json").write_bytes(content)
    assert read_monitor_state(str(tmp_path), 0) is None


class _MonitorLog:
    """NVRx's RankMonitorLogger as the handlers use it."""

    def __init__(self) -> None:
        self.connected: list[int | None] = []

    def set_connected_rank(self, rank: int | None) -> None:
        self.connected.append(rank)

    def log_restarter_event(self, text: str) -> None:
        pass


class _Writer:
    """The worker's end of the IPC stream: what the monitor answers."""

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data

    async def drain(self) -> None:
        pass

    def answers(self) -> list[Any]:
        found, at = [], 0
        while at < len(self.data):
            size = int.from_bytes(self.data[at:at + 4], "big")
            found.append(pickle.loads(self.data[at + 4:at + 4 + size]))
            at += 4 + size
        return found


def _monitor() -> SimpleNamespace:
    """The parts of a RankMonitorServer that NVRx's four handlers read and write."""
    log = _MonitorLog()
    return SimpleNamespace(
        cfg=SimpleNamespace(skip_section_response=False, num_warmup_iterations=0),
        logger=logging.getLogger("test-rank-monitor"), rmlogger=log,
        state_machine=RankMonitorStateMachine(log), nic_health_checker=None,
        rank_info=None, start_time=None, out_of_section_time=None, last_hb_time=None,
        open_sections={}, _periodic_restart_task=None, _current_iteration=None,
        _initial_iteration=None, _step_section_seen_this_cycle=False,
        connection_lock=threading.Lock(), start_periodic_restart_check=lambda: None)


@pytest.fixture
def exported(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
             files: list[_StateFile]) -> Iterator[_StateFile]:
    """Patch 8 applied (the class restored afterwards), this process's state file a fresh one
    for local rank 1 in tmp_path, and launcher time a clock of 1000, 1001, ... s."""
    for name in HANDLERS:
        monkeypatch.setattr(RankMonitorServer, name, getattr(RankMonitorServer, name))
    export_rank_monitor_state()
    export_rank_monitor_state()  # idempotent
    file = _state_file(tmp_path, 1, monkeypatch)
    files.append(file)
    monkeypatch.setattr(launcher, "_STATE_FILE", file)
    clock = itertools.count(1000.0)
    monkeypatch.setattr(launcher, "time", SimpleNamespace(time=lambda: next(clock)))
    yield file


def _init(monitor: SimpleNamespace, writer: _Writer, rank: int) -> None:
    info = RankInfo(global_rank=rank, local_rank=1, host="node-1", pid=os.getpid())
    asyncio.run(RankMonitorServer._handle_init_msg(monitor, InitMsg(rank_info=info), writer))


def test_the_patched_handlers_write_connected_heartbeat_and_disconnected_states(
        exported: _StateFile, tmp_path: Path) -> None:
    """Driven as NVRx drives them (the originals run first: the worker still gets its answers),
    the patched handlers write: connected with the worker's rank and connection time and no
    heartbeat yet; the heartbeat's time; a section message's time; then, when the worker's
    connection is lost, disconnected with the last heartbeat kept (so it goes stale)."""
    monitor, writer = _monitor(), _Writer()
    read = functools.partial(read_monitor_state, str(tmp_path), 1)
    _init(monitor, writer, rank=9)
    assert monitor.rank_info.global_rank == 9 and monitor.rmlogger.connected == [9]
    assert read() == MonitorState(connected=True, rank=9, connected_at=1000.0)
    asyncio.run(RankMonitorServer._handle_heartbeat_msg(monitor, HeartbeatMsg(rank=9), writer))
    assert monitor.last_hb_time is not None
    assert read() == MonitorState(connected=True, heartbeat=1001.0, rank=9, connected_at=1000.0)
    section = SectionMsg(rank=9, section="step", action=SectionAction.OPEN, iteration=3)
    asyncio.run(RankMonitorServer._handle_section_msg(monitor, section, writer))
    assert "step" in monitor.open_sections
    assert read() == MonitorState(connected=True, heartbeat=1002.0, rank=9, connected_at=1000.0)
    RankMonitorServer._handle_ipc_connection_lost(monitor)
    assert monitor.rank_info is None and monitor.rmlogger.connected == [9, None]
    assert read() == MonitorState(connected=False, heartbeat=1002.0, rank=9, connected_at=1000.0)
    assert [type(answer) for answer in writer.answers()] == [OkMsg, OkMsg, OkMsg]
    _init(monitor, writer, rank=9)  # the restarted worker connects: a fresh record
    assert read() == MonitorState(connected=True, rank=9, connected_at=1003.0)


def _page(rank: int, local_rank: int, heartbeat: float) -> str:
    metrics = TrainerMetrics(rank=rank, local_rank=local_rank, job="j", attempt=0)
    snapshot = Snapshot(heartbeat_timestamp=heartbeat, step=12)
    metrics.watch(lambda: snapshot)
    return generate_latest(metrics.registry).decode()


def test_the_pod_endpoint_lists_a_rank_known_only_from_its_monitor(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: list[_StateFile]) -> None:
    """With no metrics page answering, a rank whose monitor saw its worker connect is listed
    with `source: nvrx`, its rank and connection time (no heartbeat before the first), then its
    heartbeat; `answered` turns False when the worker disconnects, the heartbeat kept; a rank
    whose monitor wrote nothing is not listed."""
    file = _state_file(tmp_path, 0, monkeypatch)
    files.append(file)
    ranks = PodRanks(host="127.0.0.1", metrics_port=9400, procs=2, fetch=lambda url: None,
                     monitor=functools.partial(read_monitor_state, str(tmp_path)))
    assert ranks.read() == {"ranks": []}
    file.write(MonitorState(connected=True, rank=4, connected_at=500.0))
    assert ranks.read() == {"ranks": [
        {"localRank": 0, "rank": 4, "restarts": {}, "standby": False, "answered": True,
         "source": "nvrx", "connectedTime": 500.0}]}
    file.write(MonitorState(connected=True, heartbeat=530.0, rank=4, connected_at=500.0))
    assert ranks.read()["ranks"][0]["heartbeat"] == 530.0
    file.write(MonitorState(connected=False, heartbeat=530.0, rank=4, connected_at=500.0))
    record = ranks.read()["ranks"][0]
    assert record["answered"] is False and record["heartbeat"] == 530.0
    assert record["source"] == "nvrx" and record["connectedTime"] == 500.0


def test_a_rank_whose_page_answers_is_listed_from_the_page_and_the_operator_reads_both(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, files: list[_StateFile]) -> None:
    """Local rank 0 serves a metrics page (the library's script) and is listed from it even
    though its monitor also wrote a state; local rank 1 serves none and is listed from its
    monitor. The operator's reading keeps each one's heartbeat, and the monitor's connection
    time arrives in its RankSample as `connected_time`."""
    for local_rank, state in ((0, MonitorState(connected=True, heartbeat=1.0, rank=0,
                                               connected_at=0.5)),
                              (1, MonitorState(connected=True, heartbeat=1_700_000_030.0,
                                               rank=1, connected_at=1_700_000_000.0))):
        file = _state_file(tmp_path, local_rank, monkeypatch)
        files.append(file)
        file.write(state)
    pages = {"http://127.0.0.1:9400/metrics": _page(0, 0, heartbeat=1_700_000_040.0)}
    ranks = PodRanks(host="127.0.0.1", metrics_port=9400, procs=2, fetch=pages.get,
                     monitor=functools.partial(read_monitor_state, str(tmp_path)))
    document = ranks.read()
    first, second = document["ranks"]
    assert (first["source"], first["heartbeat"], first["step"]) == ("metrics",
                                                                   1_700_000_040.0, 12)
    assert "connectedTime" not in first
    assert (second["source"], second["heartbeat"]) == ("nvrx", 1_700_000_030.0)
    node = node_liveness_from_json(json.dumps(document), node_index=2, pod_uid="uid-2", procs=2)
    assert node.complete and node.node_index == 2
    page, monitor = node.samples
    assert (page.local_rank, page.rank, page.heartbeat, page.step) == (0, 0, 1_700_000_040.0, 12)
    assert page.connected_time is None
    assert (monitor.local_rank, monitor.rank, monitor.heartbeat, monitor.step) == (
        1, 1, 1_700_000_030.0, None)
    assert monitor.connected_time == 1_700_000_000.0
