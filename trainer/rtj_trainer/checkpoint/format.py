"""The on-disk format: names, shard files, shard records, the manifest, and their digests.

Why this shape:

- **A shard is a header plus raw bytes.** A small pickled header (skeleton, tensor layout) is
  followed by the raw bytes of the staged buffer, no `torch.save` copy; `read_shard` maps the file
  and returns views into it.
- **Per-chunk digests.** The writer splits a shard into `WRITE_CHUNK_BYTES` chunks and records a
  sha256 per chunk in the shard record and the manifest, so a resume verifies the chunks in
  parallel too (`digest_ranges`). The chunks must tile the file exactly, so no byte goes unchecked.
- **Commit = manifest.** Only directories with a `manifest.json` count as checkpoints; it lists
  every rank's shard record (rtj_trainer.checkpoint.store writes it).

A change of this format is an edit of this file (and `FORMAT_VERSION`).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .staging import TensorLayout, tensor_views, unflatten_state

FORMAT_VERSION = 2
"""2: raw shard file, per-chunk sha256 (1: one torch.save pickle, one whole-file sha256)."""
MANIFEST = "manifest.json"
_DIR_PATTERN = re.compile(r"^step-(\d{9})\.(.+)$")
_SHARD_MAGIC = b"RTJSHRD2"
_DATA_ALIGN = 4096
WRITE_CHUNK_BYTES = 256 << 20
"""Unit of hashing and parallel writing: an 11 GB shard is ~45 chunks over the writer threads."""
WRITE_THREADS = 8
"""Writer threads per rank (8 ranks per p5 node: 64 of its 192 vCPUs at most)."""
SLICE_BYTES = 8 << 20
"""Inside a chunk, hash then write this much at a time, so the write reads cache-warm bytes."""


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or no usable checkpoint could be loaded."""


def checkpoint_dir_name(step: int, identity: str) -> str:
    """`step-000000010.a0-l1-i0`: the step, then which attempt wrote it (never reused)."""
    return f"step-{step:09d}.{identity}"


def step_of(name: str) -> int | None:
    match = _DIR_PATTERN.match(name)
    return int(match.group(1)) if match else None


def shard_file_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.bin"


def shard_record_name(rank: int, world_size: int) -> str:
    return f"shard-{rank:05d}-of-{world_size:05d}.json"


@dataclass(frozen=True, slots=True)
class ChunkDigest:
    """sha256 of the bytes [offset, offset + bytes) of a shard file."""

    offset: int
    bytes: int
    sha256: str


@dataclass(frozen=True, slots=True)
class ShardRecord:
    rank: int
    file: str
    bytes: int
    chunks: tuple[ChunkDigest, ...]
    writer: dict[str, float] = field(default_factory=dict, compare=False)
    """The writer's own timings (seconds, write_seconds, fsync_seconds, threads); informative."""

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "file": self.file, "bytes": self.bytes,
                "chunks": [[c.offset, c.bytes, c.sha256] for c in self.chunks],
                "writer": dict(self.writer)}

    @classmethod
    def from_json(cls, data: Any) -> ShardRecord:
        """Raises KeyError/TypeError/ValueError on a malformed record."""
        chunks = tuple(ChunkDigest(int(o), int(n), str(h)) for o, n, h in data["chunks"])
        writer = {str(k): float(v) for k, v in dict(data.get("writer") or {}).items()}
        record = cls(int(data["rank"]), str(data["file"]), int(data["bytes"]), chunks, writer)
        if (problem := chunk_tiling_problem(record.chunks, record.bytes)) is not None:
            raise ValueError(f"shard {record.file}: {problem}")
        return record


def chunk_tiling_problem(chunks: Sequence[ChunkDigest], total: int) -> str | None:
    """The chunks must cover [0, total) exactly, in order, so that no byte goes unchecked."""
    offset = 0
    for chunk in chunks:
        if chunk.offset != offset or chunk.bytes <= 0:
            return f"chunk at offset {chunk.offset} ({chunk.bytes} bytes), expected offset {offset}"
        offset += chunk.bytes
    if offset != total:
        return f"chunks cover {offset} bytes of {total}"
    return None


@dataclass(frozen=True, slots=True)
class Manifest:
    step: int
    world_size: int
    shards: tuple[ShardRecord, ...]
    committed_at: float
    identity: str
    format: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "step": self.step,
            "world_size": self.world_size,
            "committed_at": self.committed_at,
            "identity": self.identity,
            "shards": [shard.to_json() for shard in self.shards],
        }

    @classmethod
    def from_json(cls, data: Any) -> Manifest:
        """Parse and check the structure; raises CheckpointError naming what is wrong."""
        try:
            if int(data.get("format", 0)) != FORMAT_VERSION:
                raise CheckpointError(
                    f"manifest format {data.get('format', 0)}, expected {FORMAT_VERSION}")
            shards = tuple(ShardRecord.from_json(s) for s in data["shards"])
            manifest = cls(
                step=int(data["step"]),
                world_size=int(data["world_size"]),
                shards=shards,
                committed_at=float(data["committed_at"]),
                identity=str(data.get("identity", "")),
                format=int(data.get("format", 0)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"malformed manifest: {exc!r}") from None
        if sorted(s.rank for s in shards) != list(range(manifest.world_size)):
            raise CheckpointError(
                f"manifest lists ranks {sorted(s.rank for s in shards)} "
                f"for world size {manifest.world_size}"
            )
        return manifest


def read_manifest(ckpt_dir: Path) -> Manifest:
    try:
        data = json.loads((ckpt_dir / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{ckpt_dir.name}: no manifest (never committed)") from None
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{ckpt_dir.name}: unreadable manifest: {exc}") from None
    return Manifest.from_json(data)


def _digest_range(fd: int, offset: int, nbytes: int) -> str:
    digest = hashlib.sha256()
    buffer = bytearray(min(SLICE_BYTES, max(nbytes, 1)))
    view = memoryview(buffer)
    done = 0
    while done < nbytes:
        want = min(len(buffer), nbytes - done)
        got = os.preadv(fd, [view[:want]], offset + done)
        if got <= 0:
            break  # the file is shorter than the range: the digest will not match
        digest.update(view[:got])
        done += got
    return digest.hexdigest()


def digest_ranges(path: Path, ranges: Sequence[tuple[int, int]],
                  threads: int = WRITE_THREADS) -> list[str]:
    """sha256 of each (offset, bytes) range of `path`, several ranges at a time."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if len(ranges) <= 1 or threads <= 1:
            return [_digest_range(fd, offset, nbytes) for offset, nbytes in ranges]
        with ThreadPoolExecutor(max_workers=min(threads, len(ranges))) as pool:
            return list(pool.map(lambda r: _digest_range(fd, r[0], r[1]), ranges))
    finally:
        os.close(fd)


def checksum_problems(path: Path, shard: ShardRecord) -> list[str]:
    """Which chunks of `path` do not match the digests recorded for `shard`."""
    actual = digest_ranges(path, [(c.offset, c.bytes) for c in shard.chunks])
    return [f"chunk {i} at offset {c.offset}" for i, (c, got) in
            enumerate(zip(shard.chunks, actual, strict=True)) if got != c.sha256]


def encode_header(skeleton: Any, layout: list[TensorLayout], blob_bytes: int) -> bytes:
    """Magic, pickled (skeleton, layout) and zero padding up to the page-aligned data offset."""
    meta = pickle.dumps({"format": FORMAT_VERSION, "skeleton": skeleton, "layout": layout,
                         "blob_bytes": blob_bytes}, protocol=5)
    head = _SHARD_MAGIC + struct.pack("<Q", len(meta)) + meta
    return head + bytes(-len(head) % _DATA_ALIGN)


def read_shard(path: Path) -> Any:
    """The state saved by `write_shard`; tensors are views of a private memory map of the file."""
    with open(path, "rb") as handle:
        head = handle.read(len(_SHARD_MAGIC) + 8)
        if len(head) < len(_SHARD_MAGIC) + 8 or head[: len(_SHARD_MAGIC)] != _SHARD_MAGIC:
            raise CheckpointError(f"{path}: not a format-{FORMAT_VERSION} shard")
        (meta_bytes,) = struct.unpack("<Q", head[len(_SHARD_MAGIC) :])
        meta = pickle.loads(handle.read(meta_bytes))
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: shard format {meta.get('format')}")
    data_offset = len(head) + meta_bytes
    data_offset += -data_offset % _DATA_ALIGN
    blob_bytes = int(meta["blob_bytes"])
    size = path.stat().st_size
    if size != data_offset + blob_bytes:
        raise CheckpointError(f"{path}: {size} bytes, expected {data_offset + blob_bytes}")
    whole = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    blob = whole[data_offset:]
    return unflatten_state(meta["skeleton"], tensor_views(blob, meta["layout"]))

