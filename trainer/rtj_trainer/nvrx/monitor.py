"""The rank-monitor client: how a training worker sends NVRx heartbeats and timed sections.

Runs in the training worker (rtj_trainer.resiliency). Under ft_launcher every worker has a rank
monitor process (FT_RANK_MONITOR_IPC_SOCKET names its socket); `client()` returns NVRx's
`RankMonitorClient`, used through its public API only (connect, heartbeat, sections, learned
timeouts and their state).
"""

from __future__ import annotations

from typing import Any


def client() -> Any:
    """A new, unconnected `RankMonitorClient`."""
    from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

    return RankMonitorClient()
