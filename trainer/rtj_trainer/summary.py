"""The summary JSON of a finished job: rank 0 prints it as its last line (docs/trainer.md,
"Summary"); the benchmarks read it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from .checkpoint.store import read_commit_log
from .trainer import Trainer


def job_summary(trainer: Trainer, loop_seconds: float) -> dict[str, Any]:
    """The job's figures from its ledger (wall, productive and lost seconds, restarts) and the
    last attempt's (`attempt_*`: `loop_seconds` is its step loop's), after `Trainer.finish`."""
    ledger = trainer.current_ledger()
    checkpointer = trainer.checkpointer
    wall = time.time() - ledger.started_at
    return {
        "event": "summary",
        "steps": trainer.cfg.train.steps,
        "final_loss": trainer.loss,
        "wall_seconds": round(wall, 3),
        "productive_seconds": round(trainer.productive_seconds, 3),
        "goodput": round(trainer.productive_seconds / max(1e-9, wall), 4),
        "restarts": dict(ledger.restarts),
        "lost_seconds": round(ledger.lost_seconds, 3),
        "checkpoints_committed": len(read_commit_log(Path(trainer.cfg.checkpoint.dir))),
        "last_committed_step": checkpointer.stats.committed_step,
        "attempt_steps": trainer.steps_this_attempt,
        "attempt_loop_seconds": round(loop_seconds, 3),
        "attempt_between_steps_seconds": round(loop_seconds - trainer.attempt_step_seconds, 3),
        "attempt_prepare": trainer.prepare_seconds | checkpointer.staging_seconds(),
        "attempt_checkpoint_stall_seconds_total": round(trainer.stall_seconds_total, 4),
        "attempt_checkpoint_stall_seconds_max": round(trainer.stall_seconds_max, 4),
        "attempt_saves_through_device_copy": checkpointer.stats.saves_through_device_copy,
        "attempt_snapshots": {k: round(v, 4) for k, v in (
            trainer.snapshots | checkpointer.snapshot_copies()).items()},
        "learned_hang_timeout": trainer.session.learned_hang_timeout(),
        "final_save": trainer.final_save,
    }
