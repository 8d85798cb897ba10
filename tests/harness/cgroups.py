"""Per-pod cgroups (cgroup v2, no controllers needed) to freeze and kill a pod's whole process tree.

A pod's processes may leave its process group (torch elastic starts workers in new sessions), so
signalling the group is not enough. A cgroup holds every descendant: `cgroup.freeze` stops them
all (like a hung node), `cgroup.kill` SIGKILLs them all (like a container runtime). When no
writable cgroup2 hierarchy exists the harness falls back to process groups.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def find_cgroup2_root() -> Path | None:
    """The mount point of a cgroup2 hierarchy we can create groups in, if any."""
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    for line in mounts:
        fields = line.split()
        if len(fields) >= 3 and fields[2] == "cgroup2":
            root = Path(fields[1])
            if os.access(root, os.W_OK) and (root / "cgroup.procs").exists():
                return root
    return None


class CgroupTree:
    """`<root>/<instance>/<pod uid>/<container>`; the instance group is this harness's."""

    def __init__(self, root: Path, instance: str) -> None:
        self.base = root / instance
        self.base.mkdir(exist_ok=True)

    @classmethod
    def create(cls, instance: str) -> CgroupTree | None:
        root = find_cgroup2_root()
        if root is None:
            return None
        try:
            return cls(root, instance)
        except OSError:
            return None

    def container(self, pod_uid: str, name: str) -> Path:
        path = self.base / pod_uid / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    def pod(self, pod_uid: str) -> Path:
        return self.base / pod_uid


def pids(group: Path) -> list[int]:
    """Every process in the group and its descendants."""
    found: list[int] = []
    for procs in group.rglob("cgroup.procs"):
        try:
            found += [int(line) for line in procs.read_text().split()]
        except (OSError, ValueError):
            continue
    return found


def populated(group: Path) -> bool:
    try:
        return "populated 1" in (group / "cgroup.events").read_text()
    except OSError:
        return False


def freeze(group: Path, frozen: bool) -> None:
    (group / "cgroup.freeze").write_text("1" if frozen else "0")


def is_frozen(group: Path) -> bool:
    try:
        return "frozen 1" in (group / "cgroup.events").read_text()
    except OSError:
        return False


def signal_all(group: Path, sig: int) -> None:
    """SIGKILL uses cgroup.kill (race-free); other signals go to each member process."""
    if not group.exists():
        return
    if sig == signal.SIGKILL:
        try:
            (group / "cgroup.kill").write_text("1")
            return
        except OSError:
            pass
    for pid in pids(group):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def remove(group: Path, timeout: float = 5.0) -> None:
    """Remove a group and its children once they are empty; gives up quietly after `timeout`."""
    if not group.exists():
        return
    deadline = time.monotonic() + timeout
    children = sorted((p for p in group.rglob("*") if p.is_dir()), key=lambda p: len(p.parts))
    for path in [*reversed(children), group]:
        while True:
            try:
                path.rmdir()
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    return
                time.sleep(0.05)
