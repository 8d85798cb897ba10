"""The on-disk format: names, shard files, shard records, the manifest, and their digests.

Why this shape:

- **A shard is a header plus raw bytes.** A small JSON header (skeleton, tensor layout) is
  followed by the raw bytes of the staged buffer, no `torch.save` copy; `read_shard` maps the file
  and returns views into it.
- **Loading never runs code.** The header is JSON, not a pickle: the skeleton holds plain data
  only (None, bool, int, float, str, bytes, lists, tuples, sets, dicts, dtypes and tensor slots,
  each container tagged), and the layout names dtypes from a fixed table. A planted shard can
  hold wrong numbers, never code (docs/security.md). A state holding anything else cannot be
  saved (`encode_skeleton` names the key).
- **The manifest names its job** (`job`: `<namespace>/<name>`), so a reader can refuse another
  job's checkpoints (rtj_trainer.checkpoint.store.refuse_foreign_checkpoints).
- **Per-chunk digests.** The writer splits a shard into `WRITE_CHUNK_BYTES` chunks and records a
  sha256 per chunk in the shard record and the manifest, so a resume verifies the chunks in
  parallel too (`digest_ranges`). The chunks must tile the file exactly, so no byte goes unchecked.
- **Commit = manifest.** Only directories with a `manifest.json` count as checkpoints; it lists
  every rank's shard record (rtj_trainer.checkpoint.store writes it).

A change of this format is an edit of this file (and `FORMAT_VERSION`).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import logging
import math
import os
import re
import struct
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .staging import TensorLayout, TensorSlot, tensor_views, unflatten_state

log = logging.getLogger(__name__)

FORMAT_VERSION = 3
"""3: JSON shard header, the manifest names the job (2: pickled header; 1: one torch.save
pickle). Older checkpoints are not loaded: resume skips them (their manifest's format)."""
MANIFEST = "manifest.json"
_DIR_PATTERN = re.compile(r"^step-(\d{9})\.(.+)$")
_SHARD_MAGIC = b"RTJSHRD3"
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
    job: str = ""
    """The job that wrote it, `<namespace>/<name>` (`job_identity`); "" outside a cluster."""
    format: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "step": self.step,
            "world_size": self.world_size,
            "committed_at": self.committed_at,
            "identity": self.identity,
            "job": self.job,
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
                job=str(data.get("job", "")),
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


def job_identity(namespace: str, name: str) -> str:
    """How a manifest names the job that wrote it: `<namespace>/<name>` (the name alone outside
    a namespace). Not the UID: a job deleted and applied again resumes its own checkpoints."""
    return f"{namespace}/{name}" if namespace else name


_DTYPES: dict[str, torch.dtype] = {
    str(value).removeprefix("torch."): value
    for value in vars(torch).values() if isinstance(value, torch.dtype)
}
"""The dtypes a shard may name (by name, never through an import)."""
_NONFINITE = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf}


def _dtype(name: Any) -> torch.dtype:
    if not isinstance(name, str) or name not in _DTYPES:
        raise CheckpointError(f"unknown dtype {name!r} in a shard header")
    return _DTYPES[name]


def _encode(value: Any, where: str) -> Any:
    """One skeleton node as JSON; containers and non-JSON scalars are tagged {tag: payload}."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value) if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, TensorSlot):
        return {"tensor": value.index}
    if isinstance(value, dict):
        return {"dict": [[_encode(k, f"{where} (a key)"), _encode(v, f"{where}.{k}")]
                         for k, v in value.items()]}
    for kind, tag in ((list, "list"), (tuple, "tuple"), (set, "set"), (frozenset, "frozenset")):
        if isinstance(value, kind):
            return {tag: [_encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, bytes):
        return {"bytes": base64.b64encode(value).decode("ascii")}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    raise CheckpointError(
        f"cannot checkpoint {where or 'the state'}: a {type(value).__module__}."
        f"{type(value).__qualname__}; a checkpoint holds tensors and plain data only (None, bool, "
        "int, float, str, bytes, dtypes, and lists, tuples, sets and dicts of them)")


def _decode(node: Any) -> Any:
    if node is None or isinstance(node, bool | str | int | float):
        return node
    if not isinstance(node, dict) or len(node) != 1:
        raise CheckpointError(f"malformed shard header node {str(node)[:80]!r}")
    ((tag, payload),) = node.items()
    if tag in ("list", "tuple", "set", "frozenset", "dict") and not isinstance(payload, list):
        raise CheckpointError(f"malformed shard header: {tag} of {type(payload).__name__}")
    if tag == "list":
        return [_decode(v) for v in payload]
    if tag == "tuple":
        return tuple(_decode(v) for v in payload)
    if tag in ("set", "frozenset"):
        try:
            items = [_decode(v) for v in payload]
            return set(items) if tag == "set" else frozenset(items)
        except TypeError as exc:  # an unhashable member
            raise CheckpointError(f"malformed shard header: {exc}") from None
    if tag == "dict":
        try:
            return {_decode(k): _decode(v) for k, v in payload}
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"malformed shard header: {exc}") from None
    if tag == "tensor" and isinstance(payload, int) and not isinstance(payload, bool) \
            and payload >= 0:
        return TensorSlot(payload)
    if tag == "float" and payload in _NONFINITE:
        return _NONFINITE[payload]
    if tag == "bytes" and isinstance(payload, str):
        return base64.b64decode(payload, validate=True)
    if tag == "dtype":
        return _dtype(payload)
    raise CheckpointError(f"malformed shard header node {str(node)[:80]!r}")


def encode_skeleton(skeleton: Any) -> Any:
    """The skeleton as JSON data; raises CheckpointError naming a value that is not plain data
    (the trainer checks its state with it before the first save, see `Checkpointer.prepare`)."""
    return _encode(skeleton, "")


def encode_header(skeleton: Any, layout: list[TensorLayout], blob_bytes: int) -> bytes:
    """Magic, the JSON header (skeleton, layout) and zero padding up to the page-aligned data
    offset."""
    meta = json.dumps({
        "format": FORMAT_VERSION,
        "skeleton": encode_skeleton(skeleton),
        "layout": [[t.offset, t.nbytes, str(t.dtype).removeprefix("torch."), list(t.shape)]
                   for t in layout],
        "blob_bytes": blob_bytes,
    }, allow_nan=False, separators=(",", ":")).encode()
    head = _SHARD_MAGIC + struct.pack("<Q", len(meta)) + meta
    return head + bytes(-len(head) % _DATA_ALIGN)


def _reject_constant(name: str) -> Any:
    raise CheckpointError(f"malformed shard header: {name}")


def _decode_layout(entries: Any) -> list[TensorLayout]:
    try:
        return [TensorLayout(int(offset), int(nbytes), _dtype(dtype), tuple(int(d) for d in shape))
                for offset, nbytes, dtype, shape in entries]
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"malformed shard layout: {exc}") from None


def _decode_meta(meta: dict[str, Any], where: str) -> tuple[Any, list[TensorLayout], int]:
    try:
        blob_bytes = int(meta["blob_bytes"])
        layout = _decode_layout(meta["layout"])
        skeleton = _decode(meta["skeleton"])
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: malformed shard header: {exc!r}") from None
    return skeleton, layout, blob_bytes


def decode_header(header: bytes, where: str) -> tuple[Any, list[TensorLayout], int]:
    """`encode_header` undone: (skeleton, layout, the data's bytes)."""
    start = len(_SHARD_MAGIC) + 8
    if len(header) < start or header[: len(_SHARD_MAGIC)] != _SHARD_MAGIC:
        raise CheckpointError(f"{where}: not a format-{FORMAT_VERSION} header")
    (meta_bytes,) = struct.unpack("<Q", header[len(_SHARD_MAGIC) : start])
    try:
        meta = json.loads(header[start : start + meta_bytes], parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{where}: unreadable header: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{where}: not a format-{FORMAT_VERSION} header")
    return _decode_meta(meta, where)


def read_shard(path: Path, *, device: torch.device | None = None) -> Any:
    """The state saved by `write_shard`; tensors are views of a private memory map of the file.
    Only data is read: the header is JSON (see the module docstring), never unpickled.

    With a CUDA `device` and room for the data there (`upload_room`), the data is read into
    one buffer on the device first (`upload`) and every tensor of at least `DEVICE_VIEW_BYTES`
    is a view of that buffer instead: loading it into the model is then a device-to-device
    copy. Copying the model's tensors one by one from the map's pageable pages ran at about
    3-4 GB/s (a node-local copy of a 1B model, 11.3 GB: 2.8-3.7 s of a SIGKILL's recovery,
    docs/benchmarks.md). Smaller tensors (a random generator's state, Adam's `step`, which
    must stay on the host) stay views of the map."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(len(_SHARD_MAGIC) + 8)
        if len(head) < len(_SHARD_MAGIC) + 8 or head[: len(_SHARD_MAGIC)] != _SHARD_MAGIC:
            raise CheckpointError(f"{path}: not a format-{FORMAT_VERSION} shard")
        (meta_bytes,) = struct.unpack("<Q", head[len(_SHARD_MAGIC) :])
        if meta_bytes > size:
            raise CheckpointError(f"{path}: header of {meta_bytes} bytes in a {size}-byte file")
        try:
            meta = json.loads(handle.read(meta_bytes), parse_constant=_reject_constant)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{path}: unreadable shard header: {exc}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        got = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"{path}: shard format {got}")
    data_offset = len(head) + meta_bytes
    data_offset += -data_offset % _DATA_ALIGN
    skeleton, layout, blob_bytes = _decode_meta(meta, str(path))
    if size != data_offset + blob_bytes:
        raise CheckpointError(f"{path}: {size} bytes, expected {data_offset + blob_bytes}")
    for item in layout:
        if item.offset < 0 or item.nbytes < 0 or item.offset + item.nbytes > blob_bytes:
            raise CheckpointError(f"{path}: a tensor at [{item.offset}, +{item.nbytes}) lies "
                                  f"outside the {blob_bytes}-byte data")
    whole = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    blob = whole[data_offset:]
    try:
        tensors = tensor_views(blob, layout)
        state = unflatten_state(skeleton, tensors)
    except (IndexError, RuntimeError) as exc:  # a slot past the layout, a shape that misfits
        raise CheckpointError(f"{path}: shard header does not fit its data: {exc}") from None
    if device is None or not upload_room(device, blob_bytes):
        return state
    try:
        data = upload(path, data_offset, blob_bytes, device)
    except torch.OutOfMemoryError as exc:  # taken meanwhile: the map serves, only slower
        log.warning("%s: read through its memory map (no room on %s: %s)", path.name, device,
                    str(exc).splitlines()[0])
        return state
    on_device = tensor_views(data, layout)
    return unflatten_state(skeleton, [near if item.nbytes >= DEVICE_VIEW_BYTES else far
                                      for item, near, far in zip(layout, on_device, tensors,
                                                                 strict=True)])


DEVICE_VIEW_BYTES = 1 << 20
"""`read_shard(device=...)`: tensors this large or larger are views of the device buffer."""
UPLOAD_HEADROOM_BYTES = 2 << 30
"""Device memory left free after `read_shard` allocates its buffer; else the map is used."""
UPLOAD_CHUNK_BYTES = 64 << 20
UPLOAD_THREADS = 4


def upload_room(device: torch.device, nbytes: int) -> bool:
    """Whether `read_shard` reads `nbytes` into a buffer on `device` (a CUDA device with that
    much free plus `UPLOAD_HEADROOM_BYTES`)."""
    if device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return bool(free >= nbytes + UPLOAD_HEADROOM_BYTES)


def upload(path: Path, offset: int, nbytes: int, device: torch.device, *,
           threads: int = UPLOAD_THREADS, chunk_bytes: int = UPLOAD_CHUNK_BYTES) -> torch.Tensor:
    """The `nbytes` of `path` from `offset`, in one new uint8 tensor on `device`.

    `threads` threads each read their chunks (`chunk_bytes`) with `os.preadv` into a buffer of
    their own (page-locked on CUDA) and copy it on to the device on a stream of their own, so
    the reads of some threads overlap the others' copies; a thread waits for its previous
    copy before reading into its buffer again. Any device works (the CPU too: the tests)."""
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    cuda = device.type == "cuda"
    starts = list(range(0, nbytes, chunk_bytes))
    count = max(1, min(threads, len(starts)))

    def run(index: int) -> None:
        bounce = torch.empty(min(chunk_bytes, nbytes), dtype=torch.uint8, pin_memory=cuda)
        view = memoryview(bounce.numpy())
        stream = torch.cuda.Stream(device) if cuda else None  # type: ignore[no-untyped-call]
        done: Any = None
        with contextlib.ExitStack() as scope, open(path, "rb", buffering=0) as handle:
            if stream is not None:
                scope.enter_context(torch.cuda.stream(stream))
            for start in starts[index::count]:
                length = min(chunk_bytes, nbytes - start)
                if done is not None:
                    done.synchronize()
                got = 0
                while got < length:
                    read = os.preadv(handle.fileno(), [view[got:length]], offset + start + got)
                    if read == 0:
                        raise CheckpointError(f"{path}: ends before byte {offset + start + got}")
                    got += read
                target[start : start + length].copy_(bounce[:length], non_blocking=cuda)
                if stream is not None:
                    done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    done.record(stream)
            if done is not None:
                done.synchronize()

    with ThreadPoolExecutor(max_workers=count) as pool:
        list(pool.map(run, range(count)))
    return target
