"""The fault campaign's results (pure): what one fault cost (recovered, seconds, steps lost beyond
the last commit), a summary by kind and its table, and the campaign file that the shards of one
campaign add up in (`bench.chaos`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rtj_trainer.checkpoint.format import step_of

from .chaos_plan import CHECKPOINT_KINDS, CONTROL_PLANE_KINDS
from .common import describe_spread, format_spread, format_table
from .localrun import StepRecord


@dataclass
class FaultResult:
    job: str
    kind: str
    step: int
    rank: int
    injected_at: float | None = None
    recovered: bool = False
    seconds: float | None = None
    """Fault -> the first step completed after it; a storage fault (CHECKPOINT_KINDS): fault ->
    the first later commit; a control-plane fault: the server back -> the job's status moving
    again."""
    resumed_step: int | None = None
    """The step training resumed from (the first step after the fault, minus one)."""
    committed_at_fault: int | None = None
    """The newest checkpoint committed when the fault happened (-1: none yet)."""
    steps_lost_beyond_commit: int | None = None
    detail: dict[str, Any] = field(default_factory=dict)


def analyse_fault(result: FaultResult, records: list[StepRecord],
                  commits: dict[int, float]) -> FaultResult:
    """Fill the recovery fields from rank 0's step records and when each checkpoint step was
    first seen committed (step -> unix time).

    Recovered means a new training attempt (another attempt identity: a new process group after
    an in-process, launcher, pod or full restart) completed a step after the fault. A fault that
    needed no restart (the job went on in the same attempt to its end, as when a writer died
    between saves) is recovered and `absorbed`, with no seconds."""
    if result.injected_at is None:
        return result
    committed = [step for step, at in commits.items() if at <= result.injected_at]
    result.committed_at_fault = max(committed, default=-1)
    before = [r for r in records if r.at <= result.injected_at]
    running = max(before, key=lambda r: r.at).attempt if before else None
    after = [r for r in records if r.at > result.injected_at and r.attempt != running]
    if result.kind in CHECKPOINT_KINDS:
        return _analyse_checkpoint_fault(result, after, commits)
    if result.kind in CONTROL_PLANE_KINDS:
        return _analyse_control_plane_fault(result, after)
    if not after:
        if result.detail.get("job_ended"):
            result.recovered = True
            result.detail["absorbed"] = True
            result.steps_lost_beyond_commit = 0
        return result
    first = min(after, key=lambda r: r.at)
    result.recovered = True
    result.seconds = round(first.at - result.injected_at, 3)
    result.resumed_step = first.step - 1
    result.steps_lost_beyond_commit = max(0, result.committed_at_fault - result.resumed_step)
    return result


def _resumed(result: FaultResult, after: list[StepRecord]) -> None:
    """The resume of the first new attempt in `after` (none: nothing lost)."""
    if not after:
        result.steps_lost_beyond_commit = 0
        return
    first = min(after, key=lambda r: r.at)
    result.resumed_step = first.step - 1
    assert result.committed_at_fault is not None
    result.steps_lost_beyond_commit = max(0, result.committed_at_fault - result.resumed_step)


def _analyse_checkpoint_fault(result: FaultResult, after: list[StepRecord],
                              commits: dict[int, float]) -> FaultResult:
    """A storage fault (CHECKPOINT_KINDS) is recovered when the job commits a checkpoint of a
    later step after it (seconds: fault -> that commit); a write fault also needs no restart
    before that commit (the trainer abandons the failed save and goes on); a removed directory
    may cost one. `detail["removed_step"]`: the step whose directory the campaign removed (its
    commit, if any, already dropped from `commits`)."""
    assert result.injected_at is not None
    injected = result.injected_at
    hit = int(result.detail.get("removed_step", result.step))
    later = sorted((at, step) for step, at in commits.items() if step > hit and at > injected)
    until = later[0][0] if later else float("inf")
    restarts = [r for r in after if r.at <= until]
    result.detail["restarted"] = bool(restarts)
    _resumed(result, restarts)
    if not later:
        return result
    at, step = later[0]
    result.detail["later_commit_step"] = step
    result.seconds = round(at - injected, 3)
    result.recovered = result.kind == "checkpoint-dir-removed" or not restarts
    return result


def _analyse_control_plane_fault(result: FaultResult, after: list[StepRecord]) -> FaultResult:
    """A control-plane fault (CONTROL_PLANE_KINDS; alone in its job) is recovered when the job
    ended Succeeded (`detail["final_state"]`) with no restart from the fault on
    (`detail["restarts_before"]`, `["restarts_after"]`: status.restarts.total), seconds: from the
    server's return to the job's status moving again (`detail["status_caught_up_seconds"]`)."""
    _resumed(result, after)
    before, later = result.detail.get("restarts_before"), result.detail.get("restarts_after")
    caused = (later - before) if isinstance(before, int) and isinstance(later, int) else None
    result.detail["restarts_caused"] = caused
    result.seconds = result.detail.get("status_caught_up_seconds")
    result.recovered = result.detail.get("final_state") == "Succeeded" and caused == 0
    return result


def newest_checkpoint_dir(directory: Path, at_least: int) -> Path | None:
    """The job's newest checkpoint directory (`step-<9 digits>.<attempt>`, committed or still
    being written) of step `at_least` or later; None when there is none yet."""
    found = [(step, path.name, path) for path in directory.glob("step-*")
             if (step := step_of(path.name)) is not None and step >= at_least and path.is_dir()]
    return max(found)[2] if found else None


def read_commits(directory: Path, commits: dict[int, float]) -> dict[int, float]:
    """Add to `commits` (step -> unix time of the commit) every checkpoint committed under the
    job's checkpoint directory: a `step-<9 digits>.<attempt>/manifest.json` (named by
    rtj_trainer.checkpoint.format), read for its `step` and `committed_at`. A step already known
    keeps its time (the campaign polls, so that is its first commit; a later attempt may commit
    the same step again); a manifest being replaced or unreadable is skipped this time."""
    for manifest in directory.glob("step-*/manifest.json"):
        step = step_of(manifest.parent.name)
        if step is None or step in commits:
            continue
        try:
            data = json.loads(manifest.read_text())
            commits[int(data["step"])] = float(data["committed_at"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return commits


def final_loss(records: list[StepRecord], steps: int) -> float | None:
    """The loss of the last step as the last attempt computed it."""
    finals = [r for r in records if r.step == steps]
    return max(finals, key=lambda r: r.at).loss if finals else None


def summarise(faults: list[FaultResult], jobs: list[dict[str, Any]]) -> dict[str, Any]:
    by_kind: dict[str, Any] = {}
    for kind in sorted({f.kind for f in faults}):
        mine = [f for f in faults if f.kind == kind]
        by_kind[kind] = {
            "faults": len(mine),
            "recovered": sum(1 for f in mine if f.recovered),
            "seconds": describe_spread([f.seconds for f in mine]),
            "max_steps_lost_beyond_commit": max(
                (f.steps_lost_beyond_commit or 0 for f in mine), default=0),
        }
    return {
        "faults": len(faults),
        "recovered": sum(1 for f in faults if f.recovered),
        "steps_lost_beyond_commit": sum(f.steps_lost_beyond_commit or 0 for f in faults),
        "jobs": len(jobs),
        "jobs_succeeded": sum(1 for j in jobs if j.get("final_state") == "Succeeded"),
        "jobs_final_loss_identical": sum(1 for j in jobs if j.get("final_loss_identical")),
        "by_kind": by_kind,
    }


def render(summary: dict[str, Any]) -> str:
    rows = [[kind, str(k["faults"]), str(k["recovered"]), format_spread(k["seconds"]),
             str(k["max_steps_lost_beyond_commit"])] for kind, k in summary["by_kind"].items()]
    code = ""
    if "commits" in summary:
        code = (f"code: commit {', '.join(summary['commits'])}; operator and trainer sources "
                f"{', '.join(summary['sources'])}\n")
    return code + "\n".join([
        f"jobs Succeeded {summary['jobs_succeeded']}/{summary['jobs']}, final loss identical to "
        f"the fault-free run {summary['jobs_final_loss_identical']}/{summary['jobs']}; faults "
        f"recovered {summary['recovered']}/{summary['faults']}, steps lost beyond the last "
        f"commit {summary['steps_lost_beyond_commit']}",
        "",
        format_table(["kind", "faults", "recovered", "recovery (s)",
                      "max steps lost beyond commit"], rows),
    ])


def read_campaign(path: Path) -> dict[str, Any]:
    """The campaign file's content, or a new campaign when there is no file yet."""
    if not path.exists():
        return {"benchmark": "chaos-campaign", "shards": []}
    data: dict[str, Any] = json.loads(path.read_text())
    if data.get("benchmark") != "chaos-campaign" or not isinstance(data.get("shards"), list):
        raise ValueError(f"{path} is not a bench.chaos campaign file")
    return data


def campaign_summary(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """summarise() over every shard's faults and jobs."""
    faults = [FaultResult(**f) for shard in shards for f in shard.get("faults", [])]
    jobs = [job for shard in shards for job in shard.get("jobs", [])]
    summary = summarise(faults, jobs)
    # Which code ran: a campaign "at one commit" has one entry in each (issue #31).
    summary["commits"] = sorted({str(shard.get("commit")) for shard in shards})
    summary["sources"] = sorted({str(shard.get("operator_and_trainer_source"))
                                 for shard in shards})
    return summary


def passed(summary: dict[str, Any]) -> bool:
    """Issue 11's targets: every job Succeeded with the fault-free run's final loss, every fault
    recovered, no step lost beyond the last commit."""
    return bool(summary["jobs_succeeded"] == summary["jobs"] == summary["jobs_final_loss_identical"]
                and summary["steps_lost_beyond_commit"] == 0
                and summary["recovered"] == summary["faults"])
