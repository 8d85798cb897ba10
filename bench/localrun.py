"""Run the tiny CPU trainer locally (2 ranks under ft_launcher, `trainer/scripts/train-local.sh`)
and read back what happened: launcher events, resumes, per-step losses, fault timestamps and the
summary. The parsing functions are pure so they can be checked against recorded output.

Where each timestamp comes from:

- the fault: the trainer's fault injector writes `time.time()` into its marker file
  (`<run dir>/faults/step<S>-rank<R>-<kind>`) once the marker is durable, just before it fires;
- launcher events (`failure_detected`, `worker_start_completed`, ...): ft_launcher's own
  `Cycle: N Event: E ... Time: <UTC>` log lines;
- in-process detection: the NVRx wrapper's `fn_ex:` log line (arrival time);
- process group ready: the attempt identity the trainer puts in every loss record
  (`a0-l1-i0-<unix ms mod 1e8>`, taken right after `init_process_group`);
- resume done: the arrival of rank 0's `resumed from ... (step N)` line (printed after the
  checkpoint is verified and loaded);
- a step completed: the `time` field of rank 0's record in `losses.jsonl`;
- the exact split of a worker's start and set-up: every rank's `timeline {...}` line (absolute
  times it passed process start, imports, process group, checkpoint chosen, model built, state
  loaded, first step; rtj_trainer.timeline), shown per recovery as seconds after the fault.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .common import REPO_ROOT, TRAINER_SOURCES, StampedLine, StampedProcess, source_fingerprint

TRAIN_LOCAL = REPO_ROOT / "trainer" / "scripts" / "train-local.sh"
BASELINE_TRAINER = REPO_ROOT / "bench" / "baseline_trainer.py"
_LAUNCHER_EVENT = re.compile(
    r"Cycle: (\d+) Event: (\w+) .*Time: (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?) UTC"
)
_RESUMED = re.compile(r"\[rtj-trainer\] resumed from (\S+) \(step (\d+)\)")
_IDENTITY_CLOCK = re.compile(r"-(\d+)$")
_TIMELINE = re.compile(r"\[rtj-trainer rank (\d+)\] timeline (\{.*\})")
_INPROCESS_DETECTED = re.compile(r"rank=\d+ fn_ex:|RankShouldRestart")


@dataclass(frozen=True, slots=True)
class LauncherEvent:
    cycle: int
    name: str
    at: float


@dataclass(frozen=True, slots=True)
class Resume:
    at: float
    checkpoint: str
    step: int


@dataclass(frozen=True, slots=True)
class StepRecord:
    step: int
    attempt: str
    at: float
    loss: float


@dataclass(frozen=True, slots=True)
class Attempt:
    """One training attempt (a process group lifetime) as seen in losses.jsonl."""

    identity: str
    first_step: int
    first_step_at: float
    last_step: int
    last_step_at: float
    process_group_ready_at: float | None


def parse_launcher_events(lines: Sequence[StampedLine]) -> list[LauncherEvent]:
    events = []
    for line in lines:
        match = _LAUNCHER_EVENT.search(line.text)
        if match:
            moment = datetime.strptime(match.group(3), "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC)
            events.append(LauncherEvent(int(match.group(1)), match.group(2), moment.timestamp()))
    return events


def parse_resumes(lines: Sequence[StampedLine]) -> list[Resume]:
    resumes = []
    for line in lines:
        match = _RESUMED.search(line.text)
        if match:
            resumes.append(Resume(line.at, match.group(1), int(match.group(2))))
    return resumes


def parse_timelines(lines: Sequence[StampedLine]) -> list[tuple[int, dict[str, float]]]:
    """Every `[rtj-trainer rank N] timeline {...}` line: (rank, mark -> Unix time)."""
    found = []
    for line in lines:
        match = _TIMELINE.search(line.text)
        if match:
            with contextlib.suppress(json.JSONDecodeError, TypeError, ValueError):
                marks = {str(k): float(v) for k, v in json.loads(match.group(2)).items()}
                found.append((int(match.group(1)), marks))
    return found


def timelines_after(timelines: Sequence[tuple[int, dict[str, float]]], after: float,
                    ) -> dict[str, dict[str, float]]:
    """Per rank, the first attempt's marks that began after `after`, as seconds after it (marks
    from before it, e.g. a surviving process's start, are left out)."""
    result: dict[str, dict[str, float]] = {}
    for rank, marks in sorted(timelines, key=lambda item: item[1].get("attempt", 0.0)):
        if str(rank) in result or marks.get("attempt", 0.0) <= after:
            continue
        result[str(rank)] = {name: round(at - after, 3) for name, at in marks.items()
                             if at > after}
    return result


def parse_inprocess_detections(lines: Sequence[StampedLine]) -> list[float]:
    return [line.at for line in lines if _INPROCESS_DETECTED.search(line.text)]


_LOGGED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")
_WRAPPER_EVENTS = {"detected": re.compile(r"rank=\d+ (?:fn_ex|term_ex):"),
                   "reassigned": re.compile(r"Rank reassigned \(rank changed from")}


def parse_wrapper_events(lines: Sequence[StampedLine]) -> dict[str, list[float]]:
    """NVRx in-process wrapper lines by the time they were logged (their own `asctime`, this
    machine's local time; for logs without arrival stamps, e.g. the harness's pod logs):
    `detected` (a rank's training function failed or was interrupted: `fn_ex`/`term_ex`) and
    `reassigned` (FillGaps moved a spare into a lost rank: the wrapper's barrier has passed)."""
    found: dict[str, list[float]] = {name: [] for name in _WRAPPER_EVENTS}
    for line in lines:
        logged = _LOGGED.match(line.text)
        if logged is None:
            continue
        for name, pattern in _WRAPPER_EVENTS.items():
            if pattern.search(line.text):
                moment = datetime.strptime(logged.group(1), "%Y-%m-%d %H:%M:%S,%f")
                found[name].append(moment.timestamp())  # naive: local time, as logged
    return found


def parse_summary(lines: Sequence[StampedLine]) -> tuple[dict[str, Any], float] | None:
    """The trainer's final summary JSON and when it arrived, or None."""
    for line in reversed(lines):
        text = line.text.strip()
        if text.startswith("{") and '"summary"' in text:
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                continue
            if isinstance(data, dict) and data.get("event") == "summary":
                return data, line.at
    return None


def read_losses(path: Path) -> list[StepRecord]:
    records: list[StepRecord] = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return records
    for row in text.splitlines():
        try:
            data = json.loads(row)
            records.append(StepRecord(int(data["step"]), str(data["attempt"]),
                                      float(data["time"]), float(data["loss"])))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError):
            continue  # a torn last line of a killed run
    return records


def read_fault_times(run_dir: Path) -> dict[str, float]:
    """Marker name (`step12-rank1-sigkill`) -> unix time the fault fired."""
    times = {}
    marker_dir = run_dir / "faults"
    if marker_dir.is_dir():
        for marker in marker_dir.iterdir():
            try:
                times[marker.name] = float(marker.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return times


def identity_clock(identity: str, near: float) -> float | None:
    """Unix time encoded in an attempt identity (`...-<ms mod 1e8>`), resolved to the 1e8 ms
    (27.7 h) period nearest `near`; None if the identity carries no clock."""
    match = _IDENTITY_CLOCK.search(identity)
    if not match:
        return None
    residue = int(match.group(1))
    near_ms = near * 1000.0
    periods = round((near_ms - residue) / 1e8)
    return (residue + periods * 1e8) / 1000.0


def group_attempts(records: Sequence[StepRecord]) -> list[Attempt]:
    """Attempts in order of their first step record."""
    attempts: dict[str, list[StepRecord]] = {}
    for record in records:
        attempts.setdefault(record.attempt, []).append(record)
    result = []
    for identity, rows in attempts.items():
        rows.sort(key=lambda r: r.at)
        ready = identity_clock(identity, rows[0].at)
        if ready is not None and ready > rows[0].at:
            ready = None  # not a clock after all
        result.append(Attempt(identity, rows[0].step, rows[0].at, rows[-1].step, rows[-1].at,
                              ready))
    result.sort(key=lambda a: a.first_step_at)
    return result


# Milestones of one recovery, in order; each phase ends at its milestone.
PHASES = (
    ("detect", "fault fired -> failure seen (launcher event or in-process wrapper)"),
    ("restart", "failure seen -> new workers started (stop, rendezvous, spawn); in-process: "
                "the wrapper's barrier passed, a spare moved in (when the logs show it)"),
    ("init", "workers started -> process group ready (imports, NVRx client, gloo)"),
    ("load", "process group ready -> resumed (model build, verify + load ckpt)"),
    ("first_step", "resumed -> first step of the new attempt completed"),
)


@dataclass(slots=True)
class Recovery:
    fault: str
    fault_step: int
    fault_at: float
    milestones: dict[str, float | None] = field(default_factory=dict)
    phases: dict[str, float | None] = field(default_factory=dict)
    total_seconds: float | None = None
    """fault fired -> first completed step of the next attempt."""
    back_to_fault_step_seconds: float | None = None
    """fault fired -> the faulted step completed (includes recomputing steps since the ckpt)."""
    resumed_from_step: int | None = None
    timelines: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per rank of the next attempt, its `timeline` marks as seconds after the fault (exact)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "fault": self.fault, "fault_step": self.fault_step, "fault_at": self.fault_at,
            "milestones": self.milestones, "phases": self.phases,
            "total_seconds": self.total_seconds,
            "back_to_fault_step_seconds": self.back_to_fault_step_seconds,
            "resumed_from_step": self.resumed_from_step,
            "timelines": self.timelines,
        }


def _first_after(times: Sequence[float], after: float, before: float | None = None) -> float | None:
    candidates = [t for t in times if t > after and (before is None or t <= before)]
    return min(candidates) if candidates else None


def analyse_recovery(
    fault: str,
    fault_at: float,
    *,
    events: Sequence[LauncherEvent],
    inprocess_detections: Sequence[float],
    resumes: Sequence[Resume],
    records: Sequence[StepRecord],
    timelines: Sequence[tuple[int, dict[str, float]]] = (),
    inprocess_restarts: Sequence[float] = (),
) -> Recovery:
    """Split the recovery from one fault into phases using whatever milestones the logs hold."""
    step_match = re.match(r"step(\d+)-", fault)
    fault_step = int(step_match.group(1)) if step_match else -1
    recovery = Recovery(fault, fault_step, fault_at)
    next_attempt = next((a for a in group_attempts(records) if a.first_step_at > fault_at), None)
    end = next_attempt.first_step_at if next_attempt else None
    detected = _first_after(
        [e.at for e in events if e.name == "failure_detected"] + list(inprocess_detections),
        fault_at, end,
    )
    started = None
    if detected is not None:
        started = _first_after([e.at for e in events if e.name == "worker_start_completed"]
                               + list(inprocess_restarts), detected, end)
    ready = next_attempt.process_group_ready_at if next_attempt else None
    resume = next((r for r in resumes if r.at > fault_at and (end is None or r.at <= end)), None)
    milestones: dict[str, float | None] = {
        "detect": detected,
        "restart": started,
        "init": ready,
        "load": resume.at if resume else None,
        "first_step": end,
    }
    recovery.milestones = {k: (round(v, 3) if v is not None else None)
                           for k, v in milestones.items()}
    previous = fault_at
    for name, _ in PHASES:
        moment = milestones[name]
        if moment is None or moment < previous:
            recovery.phases[name] = None
            continue
        recovery.phases[name] = round(moment - previous, 3)
        previous = moment
    if end is not None:
        recovery.total_seconds = round(end - fault_at, 3)
        done = [r.at for r in records
                if r.attempt == next_attempt.identity and r.step >= fault_step]  # type: ignore[union-attr]
        if done:
            recovery.back_to_fault_step_seconds = round(min(done) - fault_at, 3)
    if resume is not None:
        recovery.resumed_from_step = resume.step
    recovery.timelines = timelines_after(timelines, fault_at)
    return recovery


@dataclass(slots=True)
class LocalRun:
    """Everything one local trainer run left behind."""

    run_dir: Path
    log_path: Path
    command: list[str]
    settings: dict[str, Any]
    rc: int | None
    started_at: float
    ended_at: float
    lines: list[StampedLine]
    summary: dict[str, Any] | None
    summary_at: float | None
    records: list[StepRecord]
    fault_times: dict[str, float]
    events: list[LauncherEvent]
    resumes: list[Resume]
    inprocess_detections: list[float]
    timelines: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    trainer_source: str = ""
    """Fingerprint of the trainer's sources at the start of the run."""
    trainer_source_changed: bool = False
    """The trainer's sources changed while the run was going (the numbers mix two versions)."""

    def recoveries(self) -> list[Recovery]:
        return [
            analyse_recovery(name, at, events=self.events,
                             inprocess_detections=self.inprocess_detections,
                             resumes=self.resumes, records=self.records,
                             timelines=self.timelines)
            for name, at in sorted(self.fault_times.items(), key=lambda item: item[1])
        ]

    def cold_start_seconds(self) -> float | None:
        """Launcher started -> first step completed (imports, rendezvous, build, first step)."""
        attempts = group_attempts(self.records)
        return round(attempts[0].first_step_at - self.started_at, 3) if attempts else None

    def as_dict(self) -> dict[str, Any]:
        return {
            "run_dir": str(self.run_dir),
            "log": str(self.log_path),
            "command": " ".join(self.command),
            "settings": self.settings,
            "rc": self.rc,
            "launcher_wall_seconds": round(self.ended_at - self.started_at, 3),
            "launch_to_summary_seconds": (round(self.summary_at - self.started_at, 3)
                                          if self.summary_at else None),
            "cold_start_seconds": self.cold_start_seconds(),
            "cold_start_timelines": timelines_after(self.timelines, self.started_at),
            "summary": self.summary,
            "recoveries": [r.as_dict() for r in self.recoveries()],
            "attempts": [a.identity for a in group_attempts(self.records)],
            "trainer_source": self.trainer_source,
            "trainer_source_changed_during_run": self.trainer_source_changed,
        }


def run_local_trainer(
    run_dir: Path,
    *,
    faults: str = "",
    sets: Sequence[str] = (),
    inprocess: bool = False,
    heartbeat_timeout_seconds: float = 5.0,
    max_restarts: int = 3,
    timeout_seconds: float = 600.0,
    extra_env: Mapping[str, str] | None = None,
    baseline: bool = False,
    collective_timeout_seconds: float = 600.0,
) -> LocalRun:
    """One run of train-local.sh in a fresh `run_dir`; waits for the summary and the launcher's
    exit (ending everything it started in any case). `baseline`: instead, the plain torchrun
    script a PyTorchJob user runs (bench/baseline_trainer.py: DCP async saves, `torchrun
    --max-restarts`, no heartbeats; its hang protection the collective timeout), with the same
    ranks (`RTJ_NPROC_PER_NODE`, default 2), faults and settings."""
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in run_dir.iterdir():
        raise FileExistsError(f"run directory {run_dir} is not empty ({stale.name})")
    env = dict(os.environ)
    env.update({
        "RTJ_RUN_DIR": str(run_dir),
        "TRAINER_FAULTS": faults,
        "RTJ_INPROCESS_RESTART": "1" if inprocess else "0",
        "RTJ_HEARTBEAT_TIMEOUT_SECONDS": f"{heartbeat_timeout_seconds:g}",
        "RTJ_MAX_RESTARTS": str(max_restarts),
        **(extra_env or {}),
    })
    command = ["bash", str(TRAIN_LOCAL), *[part for s in sets for part in ("--set", s)]]
    settings = {"faults": faults, "sets": list(sets), "inprocess": inprocess,
                "heartbeat_timeout_seconds": heartbeat_timeout_seconds,
                "max_restarts": max_restarts}
    if baseline:
        venv = Path(os.environ.get("RTJ_VENV", REPO_ROOT / ".venv"))
        env.update({"RTJ_CHECKPOINT_DIR": str(run_dir), "RTJ_FAULT_INJECTION": "1",
                    "PYTHONUNBUFFERED": "1"})
        command = [str(venv / "bin" / "python"), "-m", "torch.distributed.run", "--standalone",
                   "--nnodes=1", f"--nproc-per-node={env.get('RTJ_NPROC_PER_NODE', '2')}",
                   f"--max-restarts={max_restarts}", str(BASELINE_TRAINER),
                   f"--collective-timeout={collective_timeout_seconds:g}", "--preset", "tiny",
                   *[part for s in sets for part in ("--set", s)]]
        settings = {"faults": faults, "sets": list(sets), "baseline": True,
                    "max_restarts": max_restarts,
                    "collective_timeout_seconds": collective_timeout_seconds}
    log_path = run_dir.parent / f"{run_dir.name}.log"
    source_before = source_fingerprint(*TRAINER_SOURCES)
    process = StampedProcess(command, log_path=log_path, env=env)
    rc: int | None = None
    try:
        summary_line = process.wait_for_line(
            lambda text: text.startswith('{"event": "summary"'), timeout_seconds)
        rc = process.wait(15.0 if summary_line else 5.0)
    finally:
        process.stop()
        ended_at = time.time()
    lines = list(process.lines)
    parsed = parse_summary(lines)
    return LocalRun(
        run_dir=run_dir,
        log_path=log_path,
        command=command,
        settings=settings,
        rc=rc,
        started_at=process.started_at,
        ended_at=ended_at,
        lines=lines,
        summary=parsed[0] if parsed else None,
        summary_at=parsed[1] if parsed else None,
        records=read_losses(run_dir / "losses.jsonl"),
        fault_times=read_fault_times(run_dir),
        events=parse_launcher_events(lines),
        resumes=parse_resumes(lines),
        inprocess_detections=parse_inprocess_detections(lines),
        timelines=parse_timelines(lines),
        trainer_source=source_before,
        trainer_source_changed=source_fingerprint(*TRAINER_SOURCES) != source_before,
    )
