"""Loopback pod IPs: every pod gets its own 127.a.b.c address, so pods can bind the same port.

Linux routes all of 127.0.0.0/8 to `lo`, so any such address can be bound without setup. Each
harness instance takes one random /16 (`127.<a>.0.0`, a >= 2) so that two clusters running at the
same time (another test session, `make cluster-up`) are unlikely to hand out the same address.
"""

from __future__ import annotations

import random


class LoopbackIpAllocator:
    """Hands out 127.<a>.<b>.<c> (c in 1..254) round-robin, never an address still in use."""

    def __init__(self, second_octet: int | None = None) -> None:
        self.second_octet = second_octet if second_octet is not None else random.randint(2, 254)
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

    def node_ip(self, index: int) -> str:
        """A fixed address per node, outside the pod range: 127.<a>.255.<index+1>."""
        return f"127.{self.second_octet}.255.{index + 1}"
