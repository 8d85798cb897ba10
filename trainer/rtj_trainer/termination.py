"""Writing the pod's termination message (its format: rtj_wire.termination).

Local rank 0 of each pod writes it once, when training ended well, stopped on SIGTERM after a
checkpoint, or on a `FatalError` (rtj_trainer.__main__); the launcher shim
(rtj_trainer.launcher.shim) writes one when a worker exited with a non-retryable code and no worker
wrote one. Imported by the worker and by the launcher shim.
"""

from __future__ import annotations

import os
from pathlib import Path

from rtj_wire import env as wire_env
from rtj_wire.termination import (
    FAILED,
    MAX_BYTES,
    STOPPED,
    SUCCEEDED,
    VERSION,
    TerminationMessage,
)

__all__ = ["FAILED", "MAX_BYTES", "PATH_ENV", "STOPPED", "SUCCEEDED", "VERSION",
           "TerminationMessage", "configured_path", "is_written", "write"]

PATH_ENV = wire_env.TERMINATION_MESSAGE_PATH
"""Where the operator tells the trainer to write it (unset: nothing is written)."""


def configured_path(env: dict[str, str] | None = None) -> Path | None:
    value = (os.environ if env is None else env).get(PATH_ENV, "")
    return Path(value) if value else None


def write(path: Path, message: TerminationMessage) -> None:
    """Write the message whole. Where the file exists already (the kubelet bind-mounts it into
    the container, and a mount point cannot be replaced by a rename) it is rewritten in place by
    one write of under 4 KiB, then fsynced; the kubelet reads it only after the container ended.
    Elsewhere (a local run, a test) it is written atomically: tmp + fsync + rename."""
    data = message.encode()
    if path.exists():
        with open(path, "r+b") as handle:
            handle.write(data)
            handle.truncate()
            handle.flush()
            os.fsync(handle.fileno())
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def is_written(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False
