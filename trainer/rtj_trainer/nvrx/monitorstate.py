"""Patch 8 of the launcher's NVRx (rtj_trainer.nvrx.launcher): the rank monitors' view of their
workers, written where the launcher shim can read it.

Runs in the rank monitor processes (ft_launcher forks them from the launcher, so the patch made
there reaches them) and, for `read_monitor_state`, in the launcher shim.

`RankMonitorServer._handle_init_msg`, `_handle_heartbeat_msg`, `_handle_section_msg` and
`_handle_ipc_connection_lost` (NVRx 0.7.0): what a rank monitor receives from its worker stays
inside that process, so the operator could not see the heartbeats of a script that sends NVRx
heartbeats and nothing else → each monitor also writes its rank's state (connected, newest
heartbeat or section message) to a small file the shim reads for its pod endpoint
(`read_monitor_state`). One `pwrite` of 192 bytes per message.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from typing import Any

from .guards import Patch, Target, replace

MONITOR_STATE_DIR_ENV = "RTJ_RANK_MONITOR_STATE_DIR"
"""Set by the shim before ft_launcher forks its rank monitors: where each writes its rank's state.
Pod-local; not part of the wire."""
MONITOR_STATE_BYTES = 192

_RMS = "nvidia_resiliency_ext.fault_tolerance.rank_monitor_server:RankMonitorServer"
PATCHES = (
    Patch("rank monitor state for the pod endpoint",
          "what a rank monitor receives never leaves its process",
          (Target(f"{_RMS}._handle_init_msg", "92d1ba899399b2c3"),
           Target(f"{_RMS}._handle_heartbeat_msg", "7518a5b10cd1635e"),
           Target(f"{_RMS}._handle_section_msg", "5ef3ab2949bf54c0"),
           Target(f"{_RMS}._handle_ipc_connection_lost", "0e6620b73499bcc8"))),
)




@dataclass(frozen=True, slots=True)
class MonitorState:
    """What a rank monitor last received from its worker (patch 8)."""

    connected: bool
    """A worker is connected to the monitor (it called `init_workload_monitoring`)."""
    heartbeat: float | None = None
    """Unix time of the newest heartbeat or section message of the connected worker (None
    before its first); kept after it disconnects, so that it goes stale."""
    rank: int | None = None
    """The worker's global rank, from its init message."""
    connected_at: float | None = None


class _StateFile:
    """The monitor process's file for its local rank, rewritten in place by one `pwrite` of a
    fixed-size record (a reader sees the old record or the new one; a torn read does not parse
    and is retried by the next read)."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.state = MonitorState(connected=False)

    def write(self, state: MonitorState) -> None:
        self.state = state
        directory = os.environ.get(MONITOR_STATE_DIR_ENV)
        if not directory:
            return
        try:
            if self.fd is None:
                path = os.path.join(directory, f"rank-{os.environ.get('LOCAL_RANK', '0')}.json")
                self.fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
            record = json.dumps(dataclasses.asdict(state), separators=(",", ":")).encode()
            os.pwrite(self.fd, record.ljust(MONITOR_STATE_BYTES), 0)
        except OSError:
            pass  # the pod endpoint then shows less; the monitor itself goes on


_STATE_FILE = _StateFile()
"""The rank monitor process's own file (one monitor process per local rank)."""


def read_monitor_state(directory: str, local_rank: int) -> MonitorState | None:
    """The state a rank monitor wrote for `local_rank` (None: none yet, or a torn read)."""
    try:
        with open(os.path.join(directory, f"rank-{local_rank}.json"), "rb") as handle:
            data = json.loads(handle.read(MONITOR_STATE_BYTES))
        return MonitorState(**data)
    except (OSError, ValueError, TypeError):
        return None


def export_rank_monitor_state() -> None:
    """Patch 8 (idempotent; the monitors are forked from this process and inherit it)."""
    from nvidia_resiliency_ext.fault_tolerance import rank_monitor_server

    server = rank_monitor_server.RankMonitorServer
    init, beat = server._handle_init_msg, server._handle_heartbeat_msg
    section, lost = server._handle_section_msg, server._handle_ipc_connection_lost

    async def _handle_init_msg(self: Any, msg: Any, writer: Any) -> None:
        await init(self, msg, writer)
        rank = getattr(getattr(msg, "rank_info", None), "global_rank", None)
        _STATE_FILE.write(MonitorState(connected=True, rank=rank, connected_at=time.time()))

    async def _handle_heartbeat_msg(self: Any, msg: Any, writer: Any) -> None:
        await beat(self, msg, writer)
        _STATE_FILE.write(dataclasses.replace(_STATE_FILE.state, heartbeat=time.time()))

    async def _handle_section_msg(self: Any, msg: Any, writer: Any) -> None:
        await section(self, msg, writer)
        _STATE_FILE.write(dataclasses.replace(_STATE_FILE.state, heartbeat=time.time()))

    def _handle_ipc_connection_lost(self: Any) -> None:
        lost(self)
        _STATE_FILE.write(dataclasses.replace(_STATE_FILE.state, connected=False))

    replace(server, "_handle_init_msg", _handle_init_msg)
    replace(server, "_handle_heartbeat_msg", _handle_heartbeat_msg)
    replace(server, "_handle_section_msg", _handle_section_msg)
    replace(server, "_handle_ipc_connection_lost", _handle_ipc_connection_lost)
