"""Patches 9 and 10 of ft_launcher's worker-group restart (rtj_trainer.nvrx.launcher declares
and installs them): the wait for freed GPU memory allows for the device keepers' (9), and the
stop of a dead group's leftover processes has no fixed 1 s sleep (10; upstream report R5 in
docs/nvrx.md)."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable, Collection
from typing import Any

from .guards import replace

log = logging.getLogger("rtj_trainer.launcher")

ORPHAN_GRACE_SECONDS = 1.0
"""How long leftover processes of the workers' groups get between SIGTERM and SIGKILL (NVRx's
fixed sleep, now an upper bound: the wait ends when the groups are empty)."""


def _group_alive(pgid: int) -> bool:
    """Whether process group `pgid` has a process that is not a zombie. The workers' children
    (the checkpoint writer, multiprocessing's resource tracker) are reparented to the
    container's PID 1 when the worker dies, and a PID 1 that reaps slowly leaves them zombies
    for seconds: `killpg(pgid, 0)` counts those, although they hold nothing any more."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    try:
        names = os.listdir("/proc")
    except OSError:
        return True
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] not in ("Z", "X"):
            return True
    return False


def terminate_leftover_groups(allowed_pgids: Collection[int],
                              grace: float = ORPHAN_GRACE_SECONDS) -> None:
    """Patch 10: NVRx's `terminate_mp_processes` (SIGTERM the workers' process groups, SIGKILL
    what is left) without its fixed 1 s sleep: the wait between the two ends as soon as no group
    has a process left, after `grace` seconds at most. Best effort, as NVRx's."""
    if 1 in allowed_pgids:  # NVRx's own exception (its simulated multi-node tests)
        return
    live = []
    for pgid in allowed_pgids:
        try:
            os.killpg(pgid, signal.SIGTERM)
            live.append(pgid)
        except ProcessLookupError:
            continue
        except OSError:
            log.warning("could not SIGTERM process group %s", pgid, exc_info=True)
    deadline = time.monotonic() + grace
    while (live := [pgid for pgid in live if _group_alive(pgid)]) and time.monotonic() < deadline:
        time.sleep(0.01)
    for pgid in live:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            continue
        except OSError:
            log.warning("could not SIGKILL process group %s", pgid, exc_info=True)


def _allow_keepers_in_reclaim(agent: Any, keeper_mb: Callable[[], float]) -> None:
    """Patch 9: the reclaim wait's tolerance grows by what the keepers hold, for that wait."""
    original = agent._wait_for_gpu_memory_reclaim

    def _wait_for_gpu_memory_reclaim(self: Any, num_gpus: int) -> None:
        held = keeper_mb()
        config = self._ft_cfg
        base = config.gpu_memory_tolerance_mb
        config.gpu_memory_tolerance_mb = base + held
        try:
            original(self, num_gpus)
        finally:
            config.gpu_memory_tolerance_mb = base

    replace(agent, "_wait_for_gpu_memory_reclaim", _wait_for_gpu_memory_reclaim)
