"""The termination message: how a trainer pod tells the operator how it ended.

Kubernetes copies the file at the container's `terminationMessagePath` (the operator sets
`/dev/termination-log` and passes the path in RTJ_TERMINATION_MESSAGE_PATH) into
`status.containerStatuses[].state.terminated.message`, at most 4096 bytes. Local rank 0 of each pod
writes it (atomically: tmp + rename) once, when training ended well, stopped on SIGTERM after a
checkpoint, or on a `FatalError`; the
launcher shim (rtj_trainer.ftlaunch) writes one when a worker exited with a non-retryable code and
no worker wrote one. The operator reads it back (rtj_operator.termination, which must agree with
this module: tests/unit/test_contract_operator_trainer.py).

The format, one JSON object (`VERSION` 1; keys the reader does not know are ignored):

- `v`: 1;
- `outcome`: `Succeeded` (the job reached its last step), `Failed` (restarting cannot help) or
  `Stopped` (asked to stop by SIGTERM, it committed a checkpoint of `step` first:
  rtj_trainer.stop);
- `step`: the last step the worker completed;
- `committedStep`, `committedTime`: the newest committed checkpoint (unix seconds), or null;
- `checkpoint`: the directory of that checkpoint as the pod sees it, when the worker's own attempt
  committed it (a stop always does), or null;
- `reason`: a CamelCase word (`Completed`, `ConfigurationError`, `DataMismatch`,
  `WorldSizeChanged`, `NonRetryableExitCode`, ...), `message`: a sentence for a person;
- `exitCode`: the worker's exit code (0, `FATAL_EXIT_CODE`, or the non-retryable code it exited
  with), not the launcher's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

VERSION = 1
MAX_BYTES = 4096
"""Kubernetes keeps at most this much of a container's termination message."""
PATH_ENV = "RTJ_TERMINATION_MESSAGE_PATH"
"""Where the operator tells the trainer to write it (unset: nothing is written)."""
SUCCEEDED: Final = "Succeeded"
FAILED: Final = "Failed"
STOPPED: Final = "Stopped"


@dataclass(frozen=True, slots=True, kw_only=True)
class TerminationMessage:
    outcome: Literal["Succeeded", "Failed", "Stopped"]
    step: int | None = None
    committed_step: int | None = None
    committed_time: float | None = None
    checkpoint: str | None = None
    reason: str = ""
    message: str = ""
    exit_code: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "v": VERSION,
            "outcome": self.outcome,
            "step": self.step,
            "committedStep": self.committed_step,
            "committedTime": self.committed_time,
            "checkpoint": self.checkpoint,
            "reason": self.reason,
            "message": self.message,
            "exitCode": self.exit_code,
        }

    def encode(self) -> bytes:
        """The JSON bytes, under MAX_BYTES: the message is shortened if need be."""
        data = self.to_json()
        text = json.dumps(data, separators=(",", ":"))
        while len(text.encode()) > MAX_BYTES:
            over = len(text.encode()) - MAX_BYTES
            message = str(data["message"])
            data["message"] = message[: max(0, len(message) - over - 8)] + "..."
            text = json.dumps(data, separators=(",", ":"))
        return text.encode()


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
