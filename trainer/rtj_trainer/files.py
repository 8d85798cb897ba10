"""Durable small files: the one tmp + fsync + rename helper that every JSON record goes through.

The checkpoint manifest and shard records, and the job ledger (`job-state.json`) are read by
other processes (and by a later attempt after a crash), so a reader must see either the old file
or the whole new one, never half of it, and a committed file must survive a power loss.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, data: Any) -> None:
    """tmp + fsync + rename + fsync(dir): readers see the old file or the whole new one."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        json.dump(data, handle, indent=1, sort_keys=True)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
