"""The fault campaign's plan (pure): the fault kinds, and which job injects which fault at which
step on which rank, for a new campaign, a shard of one, or a replay of recorded jobs
(`bench.chaos`).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

WRITE_KINDS = ("write-error", "write-lost")
"""Storage faults the trainer injects into the shard write of a checkpoint step (TRAINER_FAULTS):
the write fails with EIO and leaves an `.error` record, or fails and leaves nothing (as when the
store fails for the small file too: EIO, ENOSPC, ESTALE), which only the commit deadline
(`checkpoint.commit_timeout_seconds`) resolves."""
TRAINER_KINDS = ("exception", "sigkill", "hang", *WRITE_KINDS)
"""Faults the trainer injects itself (TRAINER_FAULTS); the others the campaign injects."""
CHECKPOINT_KINDS = (*WRITE_KINDS, "checkpoint-dir-removed")
"""Faults that hit a checkpoint save: planned on a checkpoint step (`checkpoint_step`)."""
HOLDING_KINDS = ("write-lost", "checkpoint-dir-removed")
"""Faults that can hold the job's later commits back for its commit deadline (a save missing a
rank's record, a directory gone): meanwhile the job may train to its end, so such a fault is the
last of its job, and a job has one (a second one gets a job of its own)."""
CONTROL_PLANE_KINDS = ("apiserver-stop", "etcd-restart", "operator-conn-reset")
"""Faults of the control plane, which every job of the cluster shares: each runs alone, in a
job of control-plane faults only (`--control-plane-per-job` of them, one by default) paced at
`CONTROL_PLANE_STEP_SECONDS` a step, so that whatever the job's status and restarts do around
it is the outages' doing, and each outage falls mid-training."""
CONTROL_PLANE_STEP_SECONDS = 2.0
KINDS = ("exception", "sigkill", "hang", "pod-kill", "node-partition", "rendezvous-kill",
         "operator-kill", "writer-kill", *CHECKPOINT_KINDS, *CONTROL_PLANE_KINDS)
RANKS = 4
"""2 pods x 2 ranks."""


@dataclass(frozen=True)
class PlannedFault:
    kind: str
    step: int
    """The fault happens once the job has completed step - 1 (trainer faults: at step's start)."""
    rank: int
    """The rank a trainer fault fires on (the writer kill's rank); 0..RANKS-1."""


@dataclass(frozen=True)
class JobPlan:
    name: str
    steps: int
    faults: tuple[PlannedFault, ...]

    def trainer_faults(self) -> str:
        """TRAINER_FAULTS for the trainer-injected faults (`STEP:RANK:KIND,...`)."""
        return ",".join(f"{f.step}:{f.rank}:{f.kind}" for f in self.faults
                        if f.kind in TRAINER_KINDS)

    def step_seconds(self) -> float:
        """`train.min_step_seconds` for this job: a control-plane fault's job is paced."""
        if any(f.kind in CONTROL_PLANE_KINDS for f in self.faults):
            return CONTROL_PLANE_STEP_SECONDS
        return 0.0


def checkpoint_step(step: int, interval: int, last: int) -> int:
    """The checkpoint step (a multiple of `interval`) nearest `step`, ties upward, at least
    `interval` and below the job's `last` step: the trainer's write faults only bite in a save,
    and the save of the last step must not fail (an abandoned last save fails the attempt).
    ValueError when the job has no such step."""
    if interval < 1:
        raise ValueError("the checkpoint interval must be >= 1")
    nearest = max(interval, (step + interval // 2) // interval * interval)
    while nearest >= last and nearest > interval:
        nearest -= interval
    if nearest >= last:
        raise ValueError(f"a job of {last} steps has no checkpoint step before its last "
                         f"(interval {interval})")
    return nearest


def plan_campaign(kinds: list[str], per_kind: int, faults_per_job: int, spacing: int,
                  seed: int, interval: int | None = None,
                  control_plane_per_job: int = 1) -> list[JobPlan]:
    """Every kind `per_kind` times, shuffled with `seed`, packed `faults_per_job` to a job: fault
    i of a job at step `spacing * (i + 1)` (a checkpoint fault: the checkpoint step nearest it,
    with checkpoints every `interval` steps), the job `spacing` steps longer than its last
    fault. Control-plane faults (CONTROL_PLANE_KINDS) get jobs of their own,
    `control_plane_per_job` to a job (1: at step `spacing` of `2 * spacing`)."""
    if per_kind < 1:
        raise ValueError("per_kind >= 1, faults_per_job >= 1 and spacing >= 2 are needed")
    return plan_faults(dict.fromkeys(kinds, per_kind), faults_per_job, spacing, seed,
                       interval=interval, control_plane_per_job=control_plane_per_job)


def plan_faults(counts: dict[str, int], faults_per_job: int, spacing: int, seed: int,
                prefix: str = "chaos", interval: int | None = None,
                control_plane_per_job: int = 1) -> list[JobPlan]:
    """`counts[kind]` faults of each kind, shuffled with `seed`, packed `faults_per_job` to a
    job named `<prefix>-<n>` (see plan_campaign): a HOLDING_KINDS fault last in its job and one a
    job (the others get jobs of their own after the packed ones); the control-plane faults' jobs
    come last, `control_plane_per_job` to a job and nothing else in it (the control plane is
    every job's: only one job runs at a time, so the outage is that job's alone). Checkpoint
    faults need `interval`; two faults of a job on one step are a ValueError."""
    if (faults_per_job < 1 or spacing < 2 or control_plane_per_job < 1
            or any(n < 0 for n in counts.values())):
        raise ValueError("per_kind >= 1, faults_per_job >= 1 and spacing >= 2 are needed")
    unknown = [k for k in counts if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown fault kinds: {', '.join(unknown)}")
    if interval is None and any(counts.get(k) for k in CHECKPOINT_KINDS):
        raise ValueError("checkpoint faults need the checkpoint interval")
    rng = random.Random(seed)
    pool = [kind for kind, n in counts.items() for _ in range(n)
            if kind not in CONTROL_PLANE_KINDS]
    rng.shuffle(pool)
    chunks: list[list[str]] = []
    held: list[list[str]] = []
    for start in range(0, len(pool), faults_per_job):
        chunk = pool[start:start + faults_per_job]
        holding = [kind for kind in chunk if kind in HOLDING_KINDS]
        chunks.append([kind for kind in chunk if kind not in HOLDING_KINDS] + holding[:1])
        held += [[kind] for kind in holding[1:]]
    chunks += held
    alone = [kind for kind, n in counts.items() for _ in range(n) if kind in CONTROL_PLANE_KINDS]
    rng.shuffle(alone)
    chunks += [alone[start:start + control_plane_per_job]
               for start in range(0, len(alone), control_plane_per_job)]
    jobs = []
    for number, chunk in enumerate(chunks):
        steps = spacing * (len(chunk) + 1)
        faults = []
        for i, kind in enumerate(chunk):
            step = spacing * (i + 1)
            if kind in CHECKPOINT_KINDS:
                assert interval is not None
                step = checkpoint_step(step, interval, steps)
            faults.append(PlannedFault(kind, step, rng.randrange(RANKS)))
        clashes = sorted(s for s, n in Counter(f.step for f in faults).items() if n > 1)
        if clashes:
            raise ValueError(f"two faults of one job on step {clashes[0]}: make --spacing at "
                             "least the checkpoint interval")
        jobs.append(JobPlan(f"{prefix}-{number}", steps, tuple(faults)))
    return jobs


def replay_plans(campaign: dict[str, Any], names: list[str]) -> list[JobPlan]:
    """The recorded fault plans (steps, kinds, steps of the faults, ranks) of these jobs of a
    campaign, to run again under the name `<job>-replay`. An unknown job name is a ValueError
    that names it."""
    recorded = {job["job"]: job for shard in campaign.get("shards", [])
                for job in shard.get("jobs", [])}
    unknown = [name for name in names if name not in recorded]
    if unknown:
        raise ValueError(f"--replay: no job named {', '.join(unknown)} in the campaign file")
    plans = []
    for name in names:
        job = recorded[name]
        faults = tuple(PlannedFault(f["kind"], int(f["step"]), int(f["rank"]))
                       for f in job["faults"])
        unknown_kinds = sorted({f.kind for f in faults} - set(KINDS))
        if unknown_kinds:
            raise ValueError(f"--replay: job {name} has unknown fault kinds "
                             f"{', '.join(unknown_kinds)}")
        plans.append(JobPlan(f"{name}-replay", int(job["steps"]), faults))
    return plans


def still_to_run(kinds: list[str], per_kind: int, done: list[dict[str, Any]]) -> dict[str, int]:
    """What a new shard of a campaign of `per_kind` faults of every kind must still inject:
    `per_kind` minus the faults of that kind the earlier shards injected (`done`: their fault
    records), never below 0."""
    counted = Counter(f["kind"] for f in done)
    return {kind: max(0, per_kind - counted[kind]) for kind in kinds}
