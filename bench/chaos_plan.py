"""The fault campaign's plan (pure): the fault kinds, and which job injects which fault at which
step on which rank, for a new campaign, a shard of one, or a replay of recorded jobs
(`bench.chaos`).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Any

TRAINER_KINDS = ("exception", "sigkill", "hang")
"""Faults the trainer injects itself (TRAINER_FAULTS); the others the campaign injects."""
KINDS = (*TRAINER_KINDS, "pod-kill", "node-partition", "rendezvous-kill", "operator-kill",
         "writer-kill")
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


def plan_campaign(kinds: list[str], per_kind: int, faults_per_job: int, spacing: int,
                  seed: int) -> list[JobPlan]:
    """Every kind `per_kind` times, shuffled with `seed`, packed `faults_per_job` to a job: fault
    i of a job at step `spacing * (i + 1)`, the job `spacing` steps longer than its last fault."""
    if per_kind < 1:
        raise ValueError("per_kind >= 1, faults_per_job >= 1 and spacing >= 2 are needed")
    return plan_faults(dict.fromkeys(kinds, per_kind), faults_per_job, spacing, seed)


def plan_faults(counts: dict[str, int], faults_per_job: int, spacing: int, seed: int,
                prefix: str = "chaos") -> list[JobPlan]:
    """`counts[kind]` faults of each kind, shuffled with `seed`, packed `faults_per_job` to a
    job named `<prefix>-<n>` (see plan_campaign)."""
    if faults_per_job < 1 or spacing < 2 or any(n < 0 for n in counts.values()):
        raise ValueError("per_kind >= 1, faults_per_job >= 1 and spacing >= 2 are needed")
    unknown = [k for k in counts if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown fault kinds: {', '.join(unknown)}")
    rng = random.Random(seed)
    pool = [kind for kind, n in counts.items() for _ in range(n)]
    rng.shuffle(pool)
    jobs = []
    for number, start in enumerate(range(0, len(pool), faults_per_job)):
        chunk = pool[start:start + faults_per_job]
        faults = tuple(PlannedFault(kind, spacing * (i + 1), rng.randrange(RANKS))
                       for i, kind in enumerate(chunk))
        jobs.append(JobPlan(f"{prefix}-{number}", spacing * (len(chunk) + 1), faults))
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
