"""A helper process's tie to its parent (Linux prctl), in one place: the checkpoint writer, the
device keeper and the idle warm worker each ask the kernel to SIGKILL them when the process
that started them dies, and the first two name themselves so `ps` and a SIGKILL's logs tell
them apart from the worker. Off Linux (no prctl) both calls do nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal

PR_SET_PDEATHSIG = 1
PR_SET_NAME = 15


def _prctl(option: int, *args: object) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(option, *args)


def parent_death_signal(sig: int) -> None:
    """The signal this process gets when its parent dies (0: none any more)."""
    _prctl(PR_SET_PDEATHSIG, int(sig))


def die_with_parent(name: bytes | None = None) -> None:
    """SIGKILL this process when its parent dies; `name`: the process's name (15 bytes shown)."""
    parent_death_signal(signal.SIGKILL)
    if name is not None:
        _prctl(PR_SET_NAME, ctypes.c_char_p(name), 0, 0, 0)
