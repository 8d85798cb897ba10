"""The trainer's termination message, read back: how a trainer pod says it ended.

The trainer writes it (rtj_trainer.termination owns the format; the two modules are tied by
tests/unit/test_contract_operator_trainer.py, as the packages never import each other) into the
file at the container's `terminationMessagePath`; the kubelet copies it into
`containerStatuses[].state.terminated.message`. The operator reads only these keys:

- `outcome`: `Succeeded`, `Failed` (restarting cannot help: the job fails at once) or `Stopped`
  (the trainer was asked to stop by SIGTERM and committed a checkpoint of `step` first; a pod
  that says so is neither a success nor a failure);
- `step`, `committedStep`, `committedTime`: where training ended and its newest committed
  checkpoint (unix seconds); the final `status.step` and `status.lastCheckpoint` come from them;
- `checkpoint`: that checkpoint's directory as the pod sees it (`status.lastStop.checkpoint`);
- `reason`, `message`: why, for the job's condition and Event;
- `exitCode`: the worker's exit code (what `faultTolerance.nonRetryableExitCodes` matches,
  besides the container's own code).

A message that is not such a JSON object (the log tail `FallbackToLogsOnError` puts there, a
truncated file) is ignored, with the reason kept for the pod's view.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Literal

OUTCOMES = ("Succeeded", "Failed", "Stopped")
MAX_CHECKPOINT_PATH = 1024
"""Longest checkpoint path kept (the status field's bound)."""
_WORD = re.compile(r"^[A-Za-z][A-Za-z0-9]{0,63}$")


@dataclass(frozen=True, kw_only=True)
class TrainerOutcome:
    """A trainer pod's termination message, checked."""

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
        return self.outcome == "Failed"

    @property
    def stopped(self) -> bool:
        """Asked to stop, it checkpointed `committed_step` and exited on purpose."""
        return self.outcome == "Stopped"


def _optional_int(data: dict[str, Any], key: str) -> int | None:
    value = data.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key} is {value!r}, not a non-negative integer")
    return int(value)


def parse(text: str | None) -> tuple[TrainerOutcome | None, str | None]:
    """(the outcome, None) for a valid message; (None, why it was ignored) otherwise; (None,
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
                                           or not isinstance(committed_time, (int, float))
                                           or committed_time < 0):
            raise ValueError(f"committedTime is {committed_time!r}, not unix seconds")
    except ValueError as exc:
        return None, f"termination message: {exc}"
    reason = data.get("reason")
    reason = reason if isinstance(reason, str) and _WORD.match(reason) else ""
    checkpoint = data.get("checkpoint")
    message = data.get("message")
    return TrainerOutcome(
        outcome=outcome,
        step=step,
        committed_step=committed_step,
        committed_time=float(committed_time) if committed_time is not None else None,
        checkpoint=(checkpoint[:MAX_CHECKPOINT_PATH]
                    if isinstance(checkpoint, str) and checkpoint else None),
        reason=reason,
        message=message[:1024] if isinstance(message, str) else "",
        exit_code=exit_code,
    ), None
