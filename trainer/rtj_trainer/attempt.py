"""What every rank of a new attempt agrees on before it trains (collectives over the attempt's
process group): the attempt's name, which its checkpoint directories carry, with every pod's
attempt number, and the job's ledger (job-state.json), which rank 0 advances."""

from __future__ import annotations

import time
from typing import Any

import torch.distributed as dist

from . import parallel
from .config import Config
from .ledger import LEDGER_FILE, Ledger, advance_ledger
from .resiliency import Session


def agree_on_identity(cfg: Config, session: Session, ctx: parallel.DistributedContext) -> tuple[
    str, dict[str, int]
]:
    """Rank 0 names this attempt (checkpoint directories carry the name); all ranks report their
    pod's attempt number so restarts can be classified."""
    attempts: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(attempts, (str(cfg.job.node_index), cfg.job.attempt))
    pod_attempts = dict(attempts)
    name = [
        f"a{sum(pod_attempts.values())}-l{session.launch.launcher_restart_count}"
        f"-i{session.iteration}-{int(time.time() * 1000) % 10**8}"
    ]
    dist.broadcast_object_list(name, src=0)
    return str(name[0]), pod_attempts


def agree_on_ledger(
    cfg: Config,
    session: Session,
    pod_attempts: dict[str, int],
    resumed_step_completed_at: float | None,
    resumed_step: int | None,
    rank: int,
) -> Ledger:
    """Rank 0 advances job-state.json for this attempt; every rank gets the same ledger."""
    box: list[Any] = [None]
    if rank == 0:
        path = cfg.run_dir / LEDGER_FILE
        ledger = advance_ledger(
            Ledger.read(path),
            now=time.time(),
            pod_attempts=pod_attempts,
            launcher_restart_count=session.launch.launcher_restart_count,
            inprocess_iteration=session.iteration,
            resumed_step_completed_at=resumed_step_completed_at,
            resumed_step=resumed_step,
        )
        ledger.write(path)
        box[0] = ledger
    dist.broadcast_object_list(box, src=0)
    result: Ledger = box[0]
    return result
