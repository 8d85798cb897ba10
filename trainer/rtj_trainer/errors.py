"""Errors that restarting cannot fix: the `FatalError` family.

A worker that raises one of these writes a termination message (rtj_trainer.termination) and
exits with `FATAL_EXIT_CODE`; the launcher shim (rtj_trainer.launcher) then stops ft_launcher's
restarts for the whole job (every launcher exits with ft_launcher's no-restart code, 93) and the
operator ends the job `Failed` with the trainer's reason (`TrainerFatalError`). Every other
exception stays an ordinary fault: ft_launcher restarts the workers, the operator climbs its
ladder.

Which errors belong here: a bad configuration (`ConfigError`, rtj_trainer.config), a checkpoint
written for other data (`DataMismatchError`), committed checkpoints that exist only at another
world size (`WorldSizeChangedError`), committed checkpoints of another job in the job's
checkpoint directory (`ForeignCheckpointError`). A corrupt or half-written checkpoint does not:
resume falls back to an older one, and a restart may well succeed.
"""

from __future__ import annotations

from rtj_wire import pod

FATAL_EXIT_CODE = pod.FATAL_EXIT_CODE
"""A worker's exit code for a `FatalError` (ft_launcher's own no-restart code is 93)."""


class FatalError(Exception):
    """An error that the same job would hit again after any restart."""

    reason = "TrainerFatalError"
    """A CamelCase word for the termination message (the operator shows it in the condition)."""


class DataMismatchError(FatalError):
    """The newest checkpoint was written for other data (fingerprint mismatch)."""

    reason = "DataMismatch"


class WorldSizeChangedError(FatalError):
    """Committed checkpoints exist, but none at this world size (checkpoints are per-rank
    shards and are not resharded)."""

    reason = "WorldSizeChanged"


class ForeignCheckpointError(FatalError):
    """The checkpoint directory holds committed checkpoints that another job wrote, and the
    spec does not name that job in `checkpoint.resumeFromJobs`."""

    reason = "ForeignCheckpoint"
