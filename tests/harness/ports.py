"""Local TCP ports for processes a test starts, picked so that the whole block is free.

A port from `bind(0)` comes from the kernel's ephemeral range (32768-60999 here), the same range
outgoing connections take theirs from: the next port up, which a second rank serves on, may be
taken by a connection at any moment (a clean-clone run lost a rank that way to EADDRINUSE). The
block is therefore taken below that range and checked port by port."""

from __future__ import annotations

import random
import socket

LOW, HIGH = 20000, 32000


def free_port_block(count: int, *, attempts: int = 200) -> int:
    """The first of `count` consecutive ports on 127.0.0.1 that are free now."""
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(LOW, HIGH - count)
        sockets: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports in {LOW}..{HIGH}")
