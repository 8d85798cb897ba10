"""What the launcher (ft_launcher/torchrun, or the in-process wrapper) tells a worker: RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_* and the ft_launcher variables, read by `launch_environment()`.

In-process restart rewrites RANK and WORLD_SIZE for each restart iteration, so callers read them
at the start of every iteration, not once per process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict

from .config import ConfigError


class LaunchEnvironment(BaseModel):
    """What the launcher (ft_launcher/torchrun, or the in-process wrapper) tells a worker."""

    model_config = ConfigDict(frozen=True)

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    """LOCAL_WORLD_SIZE: ranks of this launcher (pod)."""
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher_restart_count: int = 0
    """TORCHELASTIC_RESTART_COUNT: ft_launcher's cycle number inside this pod."""
    under_rank_monitor: bool = False
    """True when an NVRx rank monitor is listening (FT_RANK_MONITOR_IPC_SOCKET is set)."""


def launch_environment(env: Mapping[str, str] | None = None) -> LaunchEnvironment:
    """Read RANK, LOCAL_RANK, WORLD_SIZE, MASTER_* and the ft_launcher variables."""
    source = os.environ if env is None else env
    try:
        return LaunchEnvironment(
            rank=int(source.get("RANK", "0")),
            local_rank=int(source.get("LOCAL_RANK", "0") or 0),
            world_size=int(source.get("WORLD_SIZE", "1")),
            local_world_size=int(source.get("LOCAL_WORLD_SIZE", "1")),
            master_addr=source.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(source.get("MASTER_PORT", "29500")),
            launcher_restart_count=int(source.get("TORCHELASTIC_RESTART_COUNT", "0")),
            under_rank_monitor=bool(source.get("FT_RANK_MONITOR_IPC_SOCKET")),
        )
    except ValueError as exc:
        raise ConfigError(f"launcher environment: {exc}") from None
