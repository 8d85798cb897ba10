"""Gloo has no abort (pytorch/pytorch#130345): cut its connections instead.

With in-process restart on CPU, a rank whose peer failed stays blocked inside a gloo collective
until gloo's timeout (5 s here, `parallel.collective_timeout`) unless the peer it waits on closes
its connection: a rank that waits on a *surviving* peer, which itself left the collective with
an error, waits the whole timeout, since that peer's process group is still alive (FSDP's mesh
holds it). Measured on the local cluster: when a warm spare took over a lost pod, the survivor's
other rank left its collective 4.75 s after the first, by the timeout. NVRx's
`AbortTorchDistributed` aborts NCCL only; `ProcessGroupGloo.abort()` and `shutdown()` (torch 2.15)
and `destroy_process_group()` leave a pending gloo operation, and its peer's, waiting.

What does end it at once is a TCP shutdown of the process group's sockets: the local operation
fails ("Connection closed by peer") and so does every peer's that waits on this rank. The process
group is then destroyed as usual (NVRx's abort) and the next attempt builds a new one. So:

- `GlooConnections.record(before)` after `init_process_group` (and the mesh): the TCP sockets that
  appeared since the `snapshot()` taken before it are this attempt's gloo connections (the only
  sockets the set-up opens when it is given a store; the store's own port is excluded all the same,
  and so is a connection accepted meanwhile by a server that listened before the snapshot, such as a
  Prometheus scrape of the rank's metrics endpoint);
- `GlooConnections.cut()`, an NVRx abort step in the wrapper's monitor thread, shuts them down
  (`SHUT_RDWR`, no close: gloo still owns the descriptors and closes them when the group is
  destroyed). It runs on every rank of a restart, also on one whose main thread is blocked in the
  collective.

CPU/gloo only: NCCL's bootstrap sockets are never recorded (NCCL has its own abort).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator

log = logging.getLogger(__name__)

def _sockets() -> dict[int, int]:
    """inode -> file descriptor of this process's sockets."""
    found: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:[") and target.endswith("]"):
            found[int(target[8:-1])] = int(name)
    return found


@contextlib.contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket | None]:
    """A socket object over descriptor `fd` (None if it is gone), detached again afterwards:
    the descriptor is not ours to close."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError:
        yield None
        return
    try:
        yield sock
    finally:
        sock.detach()


def _tcp_ports(fd: int) -> tuple[int, int | None] | None:
    """(local port, peer port) of a TCP socket, the peer port None when it is not connected (a
    listening socket); None for any other socket, or one gone meanwhile."""
    with _borrowed(fd) as sock:
        if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6) or \
                sock.type != socket.SOCK_STREAM:
            return None
        try:
            local = sock.getsockname()[1]
        except OSError:
            return None
        try:
            return local, sock.getpeername()[1]
        except OSError:
            return local, None


def snapshot() -> frozenset[int]:
    """The inodes of this process's sockets now (take it right before `init_process_group`)."""
    return frozenset(_sockets())


class GlooConnections:
    """One attempt's gloo connections, recorded after the process group is up and cut when an
    in-process restart aborts the attempt. The process keeps one (rtj_trainer.carry.CarryOver:
    the abort step that cuts runs in NVRx's monitor thread, outside any attempt)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recorded: frozenset[int] = frozenset()
        """Socket inodes of the current attempt's gloo connections."""

    def record(self, before: frozenset[int], *,
               exclude_ports: frozenset[int] = frozenset()) -> int:
        """Remember the connected TCP sockets opened since `before` (skipping any whose local
        or peer port is in `exclude_ports`, and any accepted by a server that was listening at
        `before`) as the current attempt's gloo connections; returns how many."""
        now = _sockets()
        # A connection accepted by a server that listened before the snapshot (the rank's
        # metrics endpoint) has that server's port as its local port: it is not gloo's.
        servers = {ports[0] for inode in before & now.keys()
                   if (ports := _tcp_ports(now[inode])) is not None and ports[1] is None}
        mine = set()
        for inode, fd in now.items():
            if inode in before:
                continue
            ports = _tcp_ports(fd)
            if ports is None or ports[1] is None or ports[0] in servers:
                continue
            if not exclude_ports.intersection(ports):
                mine.add(inode)
        with self._lock:
            self._recorded = frozenset(mine)
        return len(mine)

    def forget(self) -> None:
        """The attempt's process group was destroyed cleanly: nothing to cut."""
        with self._lock:
            self._recorded = frozenset()

    def cut(self) -> int:
        """Shut down the recorded connections that are still open; returns how many. Safe from
        any thread: only `shutdown(2)`, no close."""
        with self._lock:
            wanted, self._recorded = self._recorded, frozenset()
        if not wanted:
            return 0
        done = 0
        for inode, fd in _sockets().items():
            if inode not in wanted:
                continue
            with _borrowed(fd) as sock:
                if sock is None:
                    continue
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                    done += 1
                except OSError:
                    pass  # already shut or reset by the peer
        return done
