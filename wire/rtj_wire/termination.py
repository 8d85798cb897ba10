"""The termination message: how a trainer pod tells the operator how it ended.

Kubernetes copies the file at the container's `terminationMessagePath` (the operator sets
`/dev/termination-log` and passes the path in `env.TERMINATION_MESSAGE_PATH`) into
`status.containerStatuses[].state.terminated.message`, at most 4096 bytes. The trainer writes it
(rtj_trainer.termination: local rank 0 when training ended, stopped on SIGTERM after a checkpoint,
or on a fatal error; the launcher shim when a worker exited with a non-retryable code); the
operator reads it back with `parse` (rtj_operator.observe).

The format, one JSON object (`VERSION` 1; keys the reader does not know are ignored):

- `v`: 1;
- `outcome`: `Succeeded` (the job reached its last step), `Failed` (restarting cannot help) or
  `Stopped` (asked to stop, it committed a checkpoint of `step` first);
- `step`: the last step the worker completed;
- `committedStep`, `committedTime`: the newest committed checkpoint (unix seconds), or null;
- `checkpoint`: the directory of that checkpoint as the pod sees it, or null;
- `reason`: a CamelCase word (`Completed`, `ConfigurationError`, `NonRetryableExitCode`, ...),
  `message`: a sentence for a person;
- `exitCode`: the worker's exit code (what `faultTolerance.nonRetryableExitCodes` matches), not
  the launcher's.

A message that is not such an object (the log tail `FallbackToLogsOnError` puts there, a truncated
file) is ignored by the reader, with the reason kept.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Final, Literal

VERSION: Final = 1
MAX_BYTES: Final = 4096
"""Kubernetes keeps at most this much of a container's termination message."""
SUCCEEDED: Final = "Succeeded"
FAILED: Final = "Failed"
STOPPED: Final = "Stopped"
OUTCOMES: Final = (SUCCEEDED, FAILED, STOPPED)
MAX_CHECKPOINT_PATH: Final = 1024
"""Longest checkpoint path the reader keeps (the status field's bound)."""
MAX_MESSAGE: Final = 1024
_WORD = re.compile(r"^[A-Za-z][A-Za-z0-9]{0,63}$")


@dataclass(frozen=True, slots=True, kw_only=True)
class TerminationMessage:
    outcome: Literal["Succeeded", "Failed", "Stopped"]
    step: int | None = None
    committed_step: int | None = None
    committed_time: float | None = None
    checkpoint: str | None = None
    reason: str = ""
    message: str = ""
    exit_code: int | None = None

    @property
    def failed(self) -> bool:
        return self.outcome == FAILED

    @property
    def stopped(self) -> bool:
        """Asked to stop, it checkpointed `committed_step` and exited on purpose."""
        return self.outcome == STOPPED

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


def _optional_int(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} is {value!r}, not a non-negative integer")
    return int(value)


def parse(text: str | None) -> tuple[TerminationMessage | None, str | None]:
    """(the message, None) for a valid message; (None, why it was ignored) otherwise; (None,
    None) when there is no message at all."""
    if not text or not text.strip():
        return None, None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"termination message is not JSON ({exc.msg} at {exc.pos})"
    if not isinstance(data, dict):
        return None, "termination message is not a JSON object"
    outcome = data.get("outcome")
    if outcome not in OUTCOMES:
        return None, f"termination message: outcome {outcome!r} is not one of {OUTCOMES}"
    try:
        step = _optional_int(data, "step")
        committed_step = _optional_int(data, "committedStep")
        exit_code = data.get("exitCode")
        if exit_code is not None and (isinstance(exit_code, bool)
                                      or not isinstance(exit_code, int)):
            raise ValueError(f"exitCode is {exit_code!r}, not an integer")
        committed_time = data.get("committedTime")
        if committed_time is not None and (isinstance(committed_time, bool)
                                           or not isinstance(committed_time, int | float)
                                           or committed_time < 0):
            raise ValueError(f"committedTime is {committed_time!r}, not unix seconds")
    except ValueError as exc:
        return None, f"termination message: {exc}"
    reason = data.get("reason")
    checkpoint = data.get("checkpoint")
    message = data.get("message")
    return TerminationMessage(
        outcome=outcome,
        step=step,
        committed_step=committed_step,
        committed_time=float(committed_time) if committed_time is not None else None,
        checkpoint=(checkpoint[:MAX_CHECKPOINT_PATH]
                    if isinstance(checkpoint, str) and checkpoint else None),
        reason=reason if isinstance(reason, str) and _WORD.match(reason) else "",
        message=message[:MAX_MESSAGE] if isinstance(message, str) else "",
        exit_code=exit_code,
    ), None
