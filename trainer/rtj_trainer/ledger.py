"""The job ledger (`job-state.json`): job-wide facts that make the metrics' counters cumulative.

Rank 0 advances it once per attempt (tmp + rename, rtj_trainer.files). It holds when the job
started, restarts by kind, and lost seconds. Lost seconds at a resume are "now minus the moment
the resumed step first completed": the recomputed steps, failure detection, restart and reload.
Which restart brought an attempt up is read from the change of the attempt's identity (pod
attempts, ft_launcher's restart count, the in-process iteration).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .files import write_json_atomic

RESTART_KINDS = ("inprocess", "launcher", "pod")
LEDGER_FILE = "job-state.json"


@dataclass(slots=True)
class Ledger:
    """Job-wide facts shared by every attempt (persisted as job-state.json)."""

    started_at: float
    restarts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(RESTART_KINDS, 0))
    lost_seconds: float = 0.0
    pod_attempts: dict[str, int] = field(default_factory=dict)
    launcher_restart_count: int = 0
    inprocess_iteration: int = 0
    stopped_step: int | None = None
    """The whole job stopped on purpose (SIGTERM to every rank: a suspend, preemption or
    deletion) after committing this step (rtj_trainer.stop); the next attempt that resumes from
    it is a resume, not a restart: no restart and no lost seconds are counted for it."""

    @classmethod
    def read(cls, path: Path) -> Ledger | None:
        try:
            data = json.loads(path.read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            return None
        return cls(**data)

    def write(self, path: Path) -> None:
        write_json_atomic(path, asdict(self))


def classify_restart(
    previous: Ledger | None,
    *,
    pod_attempts: dict[str, int],
    launcher_restart_count: int,
    inprocess_iteration: int,
) -> str | None:
    """Which restart (if any) brought this attempt up, from the last attempt's identity."""
    if previous is None:
        return None
    if any(a > previous.pod_attempts.get(node, 0) for node, a in pod_attempts.items()):
        return "pod"
    if launcher_restart_count != previous.launcher_restart_count:
        return "launcher"
    if inprocess_iteration != previous.inprocess_iteration:
        return "inprocess"
    return "launcher"  # a new worker with an unchanged identity: count it, do not hide it


def advance_ledger(
    previous: Ledger | None,
    *,
    now: float,
    pod_attempts: dict[str, int],
    launcher_restart_count: int,
    inprocess_iteration: int,
    resumed_step_completed_at: float | None,
    resumed_step: int | None = None,
) -> Ledger:
    """The ledger for a new attempt: count its restart and the seconds the fault cost (none
    when it resumes from the checkpoint the whole job committed before it was stopped)."""
    ledger = Ledger(started_at=now) if previous is None else Ledger(**asdict(previous))
    kind = classify_restart(previous, pod_attempts=pod_attempts,
                            launcher_restart_count=launcher_restart_count,
                            inprocess_iteration=inprocess_iteration)
    if (previous is not None and previous.stopped_step is not None
            and resumed_step == previous.stopped_step):
        kind = None
    ledger.stopped_step = None
    if kind is not None:
        ledger.restarts[kind] = ledger.restarts.get(kind, 0) + 1
        since = resumed_step_completed_at if resumed_step_completed_at else ledger.started_at
        ledger.lost_seconds += max(0.0, now - since)
    ledger.pod_attempts = {**ledger.pod_attempts, **pod_attempts}
    ledger.launcher_restart_count = launcher_restart_count
    ledger.inprocess_iteration = inprocess_iteration
    return ledger
