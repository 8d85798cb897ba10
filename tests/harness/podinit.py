"""Pre-exec step of every pod container: isolate it like a container runtime would, then exec.

Runs as `python -S podinit.py <spec.json>` (stdlib only) in the container's new session. It
joins the container's cgroup, asks to die with the harness, enters new mount + UTS namespaces,
makes all mounts private, sets the pod hostname, bind-mounts the pod's /tmp, /dev/shm,
/etc/hosts and volumes, changes to the working directory and execs the container command.

Bind sources are opened (O_PATH) right after entering the new mount namespace and *before* any
bind mount, then mounted from /proc/self/fd/N, so a source that lives under a path that gets
covered (a run dir under /tmp) is still reachable.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
MS_RDONLY = 1
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


def _mount(source: str | None, target: str, flags: int) -> None:
    result = _libc.mount(
        source.encode() if source else None, target.encode(), None, ctypes.c_ulong(flags), None
    )
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"mount {source} -> {target}: {os.strerror(errno)}")


def _ensure_mountpoint(target: str, is_dir: bool) -> None:
    path = Path(target)
    if path.exists():
        return
    if is_dir:
        path.mkdir(parents=True, exist_ok=True)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    _libc.prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)
    if spec.get("cgroup_procs"):
        Path(spec["cgroup_procs"]).write_text(str(os.getpid()))
    default_workdir = os.open(spec["pod_dir"], os.O_RDONLY | os.O_DIRECTORY)

    os.unshare(CLONE_NEWNS | CLONE_NEWUTS)
    _mount(None, "/", MS_REC | MS_PRIVATE)
    socket.sethostname(spec["hostname"])
    # Open the sources in the new namespace (a bind source must belong to it), before any
    # mount can cover them.
    mounts = []
    for source, target, read_only in spec["mounts"]:
        fd = os.open(source, os.O_PATH)
        mounts.append((fd, target, read_only, os.path.isdir(source)))
    for fd, target, read_only, is_dir in sorted(mounts, key=lambda m: len(Path(m[1]).parts)):
        _ensure_mountpoint(target, is_dir)
        _mount(f"/proc/self/fd/{fd}", target, MS_BIND | MS_REC)
        if read_only:
            _mount(None, target, MS_BIND | MS_REMOUNT | MS_RDONLY)
        os.close(fd)

    if spec.get("working_dir"):
        os.makedirs(spec["working_dir"], exist_ok=True)
        os.chdir(spec["working_dir"])
    else:
        try:  # by path: children that re-enter the working directory by name must find it
            os.chdir(spec["pod_dir"])
        except OSError:
            os.fchdir(default_workdir)
    os.close(default_workdir)

    argv: list[str] = spec["argv"]
    if not argv:
        print("harness: the container has no command; images are not run", file=sys.stderr)
        os._exit(127)
    sys.stdout.flush()
    try:
        os.execvpe(argv[0], argv, spec["env"])
    except FileNotFoundError:
        print(f"harness: {argv[0]}: command not found", file=sys.stderr)
        os._exit(127)
    except PermissionError:
        print(f"harness: {argv[0]}: permission denied", file=sys.stderr)
        os._exit(126)


if __name__ == "__main__":
    main()
