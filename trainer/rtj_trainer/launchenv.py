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

    @property
    def app_store_port(self) -> int:
        """Port of the application store that worker rank 0 hosts for the in-process restart's
        process groups (rtj_trainer.resiliency); `side_store_ports`."""
        return side_store_ports(self.master_port)[0]

    @property
    def wrapper_store_port(self) -> int:
        """Port of the in-process wrapper's own store, hosted by worker rank 0 too
        (rtj_trainer.nvrx.inprocess); `side_store_ports`."""
        return side_store_ports(self.master_port)[1]


EPHEMERAL_FIRST = 32768
"""The first port of Linux's default `net.ipv4.ip_local_port_range` (32768-60999)."""
SIDE_PORTS_FIRST = 20000
SIDE_PORTS_COUNT = 12000
"""`side_store_ports` maps a launcher port into [20000, 32000): below the ephemeral range, above
the well-known services' ports and the trainer's metrics ports (9399-9407 by default)."""


def side_store_ports(master_port: int) -> tuple[int, int]:
    """The two ports worker rank 0 listens on beside the launcher's store at `master_port`: the
    application store and the in-process wrapper's store. Every rank derives them the same way,
    from MASTER_PORT alone.

    The launcher picks MASTER_PORT as a free port of the ephemeral range (32768-60999), and the
    ports next to it are exactly the ones the kernel hands out to outgoing connections of any
    process of the host at about that time: rank 0 once failed to listen on MASTER_PORT + 1
    (EADDRINUSE) and the attempt never trained (docs/development.md, "A known intermittent
    failure"). So a MASTER_PORT in that range is mapped to two adjacent ports below it, where no
    outgoing connection gets its port; a MASTER_PORT set by hand below the range (e.g. 29500)
    keeps the two ports after it."""
    if master_port + 2 < EPHEMERAL_FIRST:
        return master_port + 1, master_port + 2
    first = SIDE_PORTS_FIRST + ((master_port - EPHEMERAL_FIRST) * 2) % SIDE_PORTS_COUNT
    return first, first + 1


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
