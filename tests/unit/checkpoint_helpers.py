"""Shared by the checkpoint tests: stage a state on CPU and write a checkpoint the way the
trainer does, without processes or sleeps (shards are written inline)."""

from __future__ import annotations

from pathlib import Path

import torch
from rtj_trainer import checkpoint as ck


def stage(state: dict[str, object]) -> tuple[object, list[ck.TensorLayout], torch.Tensor]:
    """`stage_to_host` on CPU: (skeleton, layout, one flat byte buffer)."""
    return ck.stage_to_host(state, torch.device("cpu"), ck.HostStaging())


def save_checkpoint(
    root: Path, step: int, world_size: int = 2, commit: bool = True, job: str = ""
) -> Path:
    """Write every rank's shard the way the NVRx writer does (several chunks and threads, as
    an 11 GB shard would be), then (optionally) commit."""
    directory = root / ck.checkpoint_dir_name(step, "a0-l0-i0-1")
    directory.mkdir(parents=True)
    for rank in range(world_size):
        state = {"w": torch.full((4, 3), float(step * 10 + rank)), "step": step,
                 "nested": [torch.arange(3), {"rng": torch.zeros(5, dtype=torch.uint8)}]}
        skeleton, layout, blob = stage(state)
        ck.write_shard(str(directory / ck.shard_file_name(rank, world_size)),
                       str(directory / ck.shard_record_name(rank, world_size)),
                       skeleton, layout, blob, rank, False, 0.0, chunk_bytes=64, threads=3)
    if commit:
        assert ck.commit(directory, step=step, world_size=world_size, identity="a0",
                         job=job) is not None
    return directory
