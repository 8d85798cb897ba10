"""Which snapshot a device keeper's buffer holds (rtj_trainer.keeper): a small record beside the
rank's node-local copies, `device-copy.json`.

The record is the only proof that the buffer is whole: a snapshot removes it before its copy into
the buffer is launched and writes it (to a temporary, then renamed) once the copy finished on the
device, so a worker killed in between leaves no record and the next one does not trust the
buffer. It names the keeper's allocation (`generation`): a keeper that reallocated or restarted
holds other memory. The record carries the shard's header (`format.encode_header`), so a resume
rebuilds the state as from a node-local copy, and its `total_bytes` are the size the same
save's shard has on the store (a committed step is checked against its manifest as a copy is).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .format import CheckpointError, decode_header
from .local import DEVICE_COPY_RECORD
from .staging import TensorLayout

RECORD_NAME = DEVICE_COPY_RECORD


@dataclass(frozen=True, slots=True)
class DeviceCopy:
    step: int
    identity: str
    generation: str
    nbytes: int
    total_bytes: int
    skeleton: Any
    layout: list[TensorLayout]
    live: bool = False
    """The training state an in-process restart interrupted (`Checkpointer.stage_live`), not a
    snapshot: no copy of it exists anywhere else."""

    @property
    def key(self) -> tuple[int, str]:
        return self.step, self.identity


def record_path(folder: Path) -> Path:
    return folder / RECORD_NAME


def forget(folder: Path) -> None:
    """The buffer is about to be written: it holds no snapshot from now on."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(record_path(folder))


def publish(folder: Path, step: int, identity: str, generation: str, nbytes: int,
            header: bytes, *, live: bool = False) -> None:
    """The buffer holds the snapshot of `step` (its copy finished on the device)."""
    path = record_path(folder)
    tmp = path.with_name(f".{RECORD_NAME}.tmp-{os.getpid()}")
    data = {"step": step, "identity": identity, "generation": generation, "nbytes": nbytes,
            "total_bytes": len(header) + nbytes, "header": base64.b64encode(header).decode(),
            "live": live}
    folder.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(data, separators=(",", ":")))
    os.replace(tmp, path)


def read(folder: Path) -> DeviceCopy | None:
    """The record, or None when there is none or it is unreadable."""
    path = record_path(folder)
    try:
        data = json.loads(path.read_text())
        skeleton, layout, blob_bytes = decode_header(base64.b64decode(data["header"]), str(path))
        nbytes = int(data["nbytes"])
        if blob_bytes != nbytes:
            return None
        return DeviceCopy(int(data["step"]), str(data["identity"]), str(data["generation"]),
                          nbytes, int(data["total_bytes"]), skeleton, layout,
                          bool(data.get("live", False)))
    except (OSError, ValueError, KeyError, TypeError, CheckpointError):
        return None
