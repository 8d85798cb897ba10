"""Loopback pod IPs: every pod gets its own 127.a.b.c address, so pods can bind the same port.

Linux routes all of 127.0.0.0/8 to `lo`, so any such address can be bound without setup. Each
harness instance takes one random /16 (`127.<a>.0.0`, a >= 2) and claims it for its lifetime by
binding `127.<a>.255.255:CLAIM_PORT`, so that two clusters running at the same time (another test
session, `make cluster-up`, the simulated nodes of `bench.scale`) never hand out the same address:
a /16 another one holds is skipped. (Before the claim the choice was only random, and a
clean-clone run's simulated nodes once collided with another cluster's pod on 127.146.0.2:9399.)
"""

from __future__ import annotations

import random
import socket

CLAIM_PORT = 64999
"""Bound on `127.<a>.255.255` by the allocator that holds the /16 `127.<a>.0.0`."""


def _claim(second_octet: int) -> socket.socket | None:
    sock = socket.socket()
    try:
        sock.bind((f"127.{second_octet}.255.255", CLAIM_PORT))
    except OSError:
        sock.close()
        return None
    return sock


class LoopbackIpAllocator:
    """Hands out 127.<a>.<b>.<c> (c in 1..254) round-robin, never an address still in use."""

    def __init__(self, second_octet: int | None = None) -> None:
        self._claim: socket.socket | None = None
        if second_octet is None:
            for candidate in random.sample(range(2, 255), 253):
                self._claim = _claim(candidate)
                if self._claim is not None:
                    second_octet = candidate
                    break
            else:
                raise RuntimeError("every 127.<a>.0.0/16 is claimed by another allocator")
        self.second_octet = second_octet
        if not 1 <= self.second_octet <= 255:
            raise ValueError("second octet must be in 1..255")
        self._next = 0
        self._in_use: set[str] = set()

    _SLOTS = 255 * 254  # b in 0..254; b = 255 is kept for node IPs

    def _address(self, slot: int) -> str:
        return f"127.{self.second_octet}.{slot // 254}.{slot % 254 + 1}"

    def allocate(self) -> str:
        """A free address; raises RuntimeError when all 64,770 are taken."""
        for _ in range(self._SLOTS):
            address = self._address(self._next)
            self._next = (self._next + 1) % self._SLOTS
            if address not in self._in_use:
                self._in_use.add(address)
                return address
        raise RuntimeError("no free loopback pod IPs left")

    def release(self, address: str) -> None:
        self._in_use.discard(address)

    def close(self) -> None:
        """Give the /16 back (a process that exits gives it back too)."""
        if self._claim is not None:
            self._claim.close()
            self._claim = None

    def node_ip(self, index: int) -> str:
        """A fixed address per node, outside the pod range: 127.<a>.255.<index+1>."""
        return f"127.{self.second_octet}.255.{index + 1}"
