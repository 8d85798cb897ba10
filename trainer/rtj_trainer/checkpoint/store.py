"""The checkpoint directory: validation, the commit (manifest), and the commit log.

Why this shape: **commit = manifest.** A writer fsyncs its shard, renames it into place, then
writes a shard record (size, chunk digests, its own timings). Rank 0's commit thread
(`CommitWorker`, off the step loop) lists the directory until every rank's record exists, reads
each record once, and writes `manifest.json` through tmp + fsync + rename (`commit`); a save with
an error record is abandoned instead, so it never blocks later ones. The other ranks learn the
outcome from `commit-progress.json` (`CommitProgressReader`), never from the manifest. Only
directories with a manifest count. Resume walks committed checkpoints newest first: rank 0
reads each manifest once and checks it (`manifest_problems`), then gives each rank its own
shard record (`resume_plans`), and each rank checks only its own shard (`shard_problems`: size,
chunk checksums); `validation_problems` is the single-process whole check (tools, tests).
Another job's checkpoints are refused (`refuse_foreign_checkpoints`). Pruning, and the owner
records it reads, are rtj_trainer.checkpoint.pruning; the directory itself is held by one job at a
time (rtj_trainer.checkpoint.lock).
Rank 0's commit thread and the other ranks' reader of its progress are in
rtj_trainer.checkpoint.committer.

Besides the checkpoints, the root holds files that other programs read: `commits.jsonl` (one
record per commit, for benchmarks and the summary: `read_commit_log`), `latest-committed-step`
(the format of ft_launcher's `--ft-checkpoint-iteration-file`, which is not passed:
docs/nvrx.md 2.2) and `commit-progress.json` (this attempt's recent commit outcomes, for the
other ranks).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ForeignCheckpointError, WorldSizeChangedError
from ..files import write_json_atomic
from .format import (
    MANIFEST,
    CheckpointError,
    Manifest,
    ShardRecord,
    checksum_problems,
    read_manifest,
    shard_record_name,
    step_of,
)

COMMIT_LOG = "commits.jsonl"
LATEST_COMMITTED_STEP = "latest-committed-step"


def manifest_problems(ckpt_dir: Path, manifest: Manifest, *, world_size: int) -> list[str]:
    """Rank 0's part of a resume check: why the manifest of `ckpt_dir` does not fit this job."""
    problems = []
    if manifest.world_size != world_size:
        problems.append(
            f"{ckpt_dir.name}: written by {manifest.world_size} ranks, this job has {world_size}"
        )
    if step_of(ckpt_dir.name) != manifest.step:
        problems.append(f"{ckpt_dir.name}: manifest says step {manifest.step}")
    return problems


def shard_problems(ckpt_dir: Path, shard: ShardRecord, *, verify_checksums: bool) -> list[str]:
    """One rank's part of a resume check: its own shard's size (one `stat`) and, if asked, its
    chunk sha256s, against the record rank 0 read from the manifest."""
    path = ckpt_dir / shard.file
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        return [f"{ckpt_dir.name}: shard {shard.file} is missing"]
    if size != shard.bytes:
        return [f"{ckpt_dir.name}: shard {shard.file} has {size} bytes, "
                f"manifest says {shard.bytes}"]
    if verify_checksums and (bad := checksum_problems(path, shard)):
        return [f"{ckpt_dir.name}: shard {shard.file} fails its sha256 "
                f"({len(bad)} of {len(shard.chunks)} chunks: {', '.join(bad[:3])})"]
    return []


def validation_problems(
    ckpt_dir: Path, *, world_size: int, verify_ranks: tuple[int, ...] | None, verify_checksums: bool
) -> list[str]:
    """Single-process view (tools, tests): why `ckpt_dir` cannot be resumed at `world_size`
    (empty list: it can), checking the shards of `verify_ranks` (None: all). A resume does not
    call this: rank 0 checks the manifest and each rank only its own shard (`resume_plan`)."""
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError as exc:
        return [str(exc)]
    problems = manifest_problems(ckpt_dir, manifest, world_size=world_size)
    for shard in manifest.shards:
        if verify_ranks is None or shard.rank in verify_ranks:
            problems.extend(shard_problems(ckpt_dir, shard, verify_checksums=verify_checksums))
    return problems


@dataclass(frozen=True, slots=True)
class ResumePlan:
    """What rank 0 sends each rank before a resume (one scatter): the committed candidates,
    newest first, each with rank 0's verdict on its manifest ("" when it fits), and for each
    candidate this rank's shard record (None where the manifest did not fit)."""

    candidates: tuple[tuple[str, str], ...]
    records: tuple[dict[str, Any] | None, ...]
    committed: tuple[int, float] | None
    """The newest commit at this world size (step, commit time), for the metrics."""


Committed = list[tuple[Path, Manifest | CheckpointError]]
"""The committed checkpoints, newest first, each with its manifest or why it cannot be read."""


def read_committed(root: Path) -> Committed:
    """List the committed checkpoints and read each manifest once (rank 0 before a resume: the
    foreign-job check, the world-size check and the resume plan all use this one pass)."""
    found: Committed = []
    for ckpt_dir in committed_checkpoints(root):
        try:
            found.append((ckpt_dir, read_manifest(ckpt_dir)))
        except CheckpointError as exc:
            found.append((ckpt_dir, exc))
    return found


def resume_plans(
    root: Path, *, world_size: int, committed: Committed | None = None
) -> list[ResumePlan]:
    """Rank 0: read each committed manifest once and split it into one plan per rank. The other
    ranks then touch nothing but their own shard files: the cost of a resume is O(checkpoints x
    world size) reads on rank 0 and O(1) per other rank, not a `stat` of every shard on every
    rank."""
    candidates: list[tuple[str, str]] = []
    per_rank: list[list[dict[str, Any] | None]] = [[] for _ in range(world_size)]
    newest: tuple[int, float] | None = None
    for ckpt_dir, read in read_committed(root) if committed is None else committed:
        manifest = read if isinstance(read, Manifest) else None
        problems = ([str(read)] if manifest is None
                    else manifest_problems(ckpt_dir, manifest, world_size=world_size))
        if manifest is None or problems:
            candidates.append((ckpt_dir.name, "; ".join(problems)))
            for records in per_rank:
                records.append(None)
            continue
        if newest is None:
            newest = (manifest.step, manifest.committed_at)
        candidates.append((ckpt_dir.name, ""))
        for shard in manifest.shards:
            per_rank[shard.rank].append(shard.to_json())
    return [ResumePlan(tuple(candidates), tuple(records), newest) for records in per_rank]


def committed_checkpoints(root: Path) -> list[Path]:
    """Directories with a manifest, newest step first (ties: newest manifest first)."""
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        step = step_of(entry.name)
        manifest = entry / MANIFEST
        if step is not None and manifest.is_file():
            found.append((step, manifest.stat().st_mtime, entry))
    found.sort(key=lambda item: (item[0], item[1]), reverse=True)
    return [entry for _, _, entry in found]


@dataclass(frozen=True, slots=True)
class ReshardPlan:
    """What rank 0 sends every rank when the committed checkpoints were all written at another
    world size: the newest one whose manifest fits its own world size, to be read resharded
    (rtj_trainer.checkpoint.reshard)."""

    name: str
    world_size: int
    records: tuple[dict[str, Any], ...]
    """Every old rank's shard record, by old rank."""
    committed: tuple[int, float]


def reshard_plan(root: Path, *, world_size: int, committed: Committed) -> ReshardPlan:
    """The plan to resume at `world_size` from the newest committed checkpoint of another world
    size; `WorldSizeChangedError` (fatal) when none can be read."""
    problems: list[str] = []
    for ckpt_dir, read in committed:
        if not isinstance(read, Manifest):
            problems.append(str(read))
            continue
        found = manifest_problems(ckpt_dir, read, world_size=read.world_size)
        if found:
            problems.extend(found)
            continue
        records = sorted(read.shards, key=lambda shard: shard.rank)
        return ReshardPlan(ckpt_dir.name, read.world_size,
                           tuple(shard.to_json() for shard in records),
                           (read.step, read.committed_at))
    raise WorldSizeChangedError(
        f"the committed checkpoints in {root} were written at another world size and none can "
        f"be read to reshard for {world_size} ranks: {'; '.join(problems) or 'none found'}")


def refuse_other_world_size(
    root: Path, *, world_size: int, committed: Committed | None = None
) -> None:
    """Raise `WorldSizeChangedError` (fatal) when committed checkpoints exist only at another
    world size: starting from step 0 instead would silently throw the training away."""
    others = other_world_sizes(root, world_size=world_size, committed=committed)
    if others:
        shown = " or ".join(str(n) for n in others)
        raise WorldSizeChangedError(
            f"the committed checkpoints in {root} were written by {shown} ranks, this job has "
            f"{world_size}: checkpoints are per-rank shards and are not resharded. Run with "
            f"{shown} ranks again, or move the checkpoints away to start from step 0"
        )


def refuse_foreign_checkpoints(
    root: Path, *, job: str, accepted: Collection[str] = (), committed: Committed | None = None
) -> None:
    """Raise `ForeignCheckpointError` (fatal) when a committed checkpoint under `root` was written
    by a job other than `job` and not in `accepted` (`spec.checkpoint.resumeFromJobs`): a job
    resumes only its own checkpoints unless its spec names the other job on purpose. The record is
    a guard against two jobs sharing a path by mistake, not a signature (docs/security.md).
    Manifests that cannot be read are left to validation (they are skipped there)."""
    foreign: dict[str, list[str]] = {}
    for ckpt_dir, read in read_committed(root) if committed is None else committed:
        if not isinstance(read, Manifest):
            continue
        owner = read.job
        if owner != job and owner not in accepted:
            foreign.setdefault(owner, []).append(ckpt_dir.name)
    if foreign:
        owners = ", ".join(f"{owner or '(no job recorded)'} ({', '.join(names[:3])})"
                           for owner, names in sorted(foreign.items()))
        raise ForeignCheckpointError(
            f"the committed checkpoints in {root} were written by another job: {owners}; this "
            f"job is {job or '(no job)'}. A job resumes only its own checkpoints: to start from "
            "another job's on purpose, name it in spec.checkpoint.resumeFromJobs "
            "(<namespace>/<name>); otherwise give this job its own checkpoint.path"
        )


def newest_valid_checkpoint(
    root: Path, *, world_size: int, verify_checksums: bool = True
) -> tuple[Path | None, list[str]]:
    """Single-process view (tools, tests): the checkpoint a resume would pick, and the rejects."""
    rejected: list[str] = []
    for ckpt_dir in committed_checkpoints(root):
        problems = validation_problems(
            ckpt_dir, world_size=world_size, verify_ranks=None, verify_checksums=verify_checksums
        )
        if not problems:
            return ckpt_dir, rejected
        rejected.extend(problems)
    return None, rejected


def other_world_sizes(
    root: Path, *, world_size: int, committed: Committed | None = None
) -> list[int]:
    """The world sizes of the committed checkpoints under `root` when none of them was written at
    `world_size` (then no checkpoint can be resumed: they are per-rank shards, never resharded);
    [] when one was, or when there is none. Unreadable manifests are left out."""
    sizes = set()
    for _, read in read_committed(root) if committed is None else committed:
        if isinstance(read, Manifest):
            sizes.add(read.world_size)
    return [] if not sizes or world_size in sizes else sorted(sizes)


ABANDONED = "abandoned"
"""Written by rank 0 into a checkpoint directory whose shard write failed on some rank: it will
never be committed, every rank skips it, and prune removes it like any uncommitted directory."""


def failed_writes(ckpt_dir: Path, *, world_size: int) -> list[str]:
    """The error records (`<record>.error`) that ranks left in `ckpt_dir` (writer.write_shard)."""
    errors = []
    for name in record_listing(ckpt_dir, world_size=world_size)[1]:
        rank = name.split("-", 2)[1] if name.count("-") >= 2 else "?"
        text = (ckpt_dir / name).read_text(errors="replace")[:200]
        errors.append(f"rank {int(rank) if rank.isdigit() else rank}: {text}")
    return errors


def abandon(ckpt_dir: Path, reason: str, *, job: str | None = None) -> None:
    """Rank 0: mark a checkpoint that can never be committed, so later ones can be (naming the
    job that gave it up, `job`, as the owner record does)."""
    record: dict[str, Any] = {"reason": reason[:2000], "at": time.time()}
    if job is not None:
        record["job"] = job
    write_json_atomic(ckpt_dir / ABANDONED, record)


def is_abandoned(ckpt_dir: Path) -> bool:
    return (ckpt_dir / ABANDONED).is_file()


def record_listing(ckpt_dir: Path, *, world_size: int) -> tuple[int, list[str]]:
    """One directory listing of `ckpt_dir`: how many shard records are missing, and the names of
    the error records (`<record>.error`, writer.write_shard) that ranks left. One `readdir`
    instead of a `stat` per rank."""
    try:
        names = set(os.listdir(ckpt_dir))
    except FileNotFoundError:
        return world_size, []
    missing = sum(1 for rank in range(world_size)
                  if shard_record_name(rank, world_size) not in names)
    errors = sorted(name for name in names if name.endswith(".json.error"))
    return missing, errors


def missing_records(ckpt_dir: Path, *, world_size: int) -> list[int]:
    """The ranks whose shard record is not in `ckpt_dir` (one `readdir`; all when it is gone)."""
    try:
        names = set(os.listdir(ckpt_dir))
    except OSError:
        return list(range(world_size))
    return [rank for rank in range(world_size)
            if shard_record_name(rank, world_size) not in names]


def commit(
    ckpt_dir: Path, *, step: int, world_size: int, identity: str, job: str = ""
) -> Manifest | None:
    """Rank 0: write the manifest (naming `job`, see `format.job_identity`) if every rank's shard
    record is there; else None. One listing while records are missing; once all are there, each
    record is read once (this runs on `CommitWorker`'s thread, off the step loop)."""
    missing, _ = record_listing(ckpt_dir, world_size=world_size)
    if missing:
        return None
    records = []
    for rank in range(world_size):
        path = ckpt_dir / shard_record_name(rank, world_size)
        record = ShardRecord.from_json(json.loads(path.read_text()))
        if record.rank != rank:
            raise CheckpointError(f"{path} is rank {record.rank}'s record")
        records.append(record)
    manifest = Manifest(step=step, world_size=world_size, shards=tuple(records),
                        committed_at=time.time(), identity=identity, job=job)
    write_json_atomic(ckpt_dir / MANIFEST, manifest.to_json())
    return manifest


def append_commit_log(root: Path, record: dict[str, Any]) -> None:
    """Rank 0, after each commit: one JSON line in `commits.jsonl`."""
    with open(root / COMMIT_LOG, "a") as handle:
        handle.write(json.dumps(record) + "\n")


def read_commit_log(root: Path) -> list[dict[str, Any]]:
    """The `commits.jsonl` records, oldest first ([] before the first commit).

    A line that is not JSON (torn by a process killed mid-append) reads as `{}`, so the length is
    still the number of commit lines."""
    try:
        lines = (root / COMMIT_LOG).read_text().splitlines()
    except FileNotFoundError:
        return []
    records: list[dict[str, Any]] = []
    for line in lines:
        if not line:
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = {}
        records.append(record if isinstance(record, dict) else {})
    return records


def write_latest_committed_step(root: Path, step: int) -> None:
    """The file ft_launcher's progress tracker reads (--ft-checkpoint-iteration-file)."""
    tmp = root / f".{LATEST_COMMITTED_STEP}.tmp-{os.getpid()}"
    tmp.write_text(f"{step}\n")
    os.replace(tmp, root / LATEST_COMMITTED_STEP)
