"""A warm spare's ranks wait in NVRx's `reserve_fn` in short store waits
(rtj_trainer.nvrx.inprocess.patch_reserve_wait): the restart's asynchronous exception reaches
a rank only between two of them, so their length is how late a spare joins a take-over."""

from __future__ import annotations

import inspect
import threading
import time
from datetime import timedelta

import pytest
from nvidia_resiliency_ext.inprocess import wrap
from nvidia_resiliency_ext.inprocess.state import Mode, State
from nvidia_resiliency_ext.inprocess.store import PrefixStore, StoreMixin
from rtj_trainer.nvrx.inprocess import RESERVE_WAIT, patch_reserve_wait
from torch._C._distributed_c10d import TCPStore

pytestmark = pytest.mark.unit


class Watchdog:
    """NVRx's progress watchdog as reserve_fn uses it: one ping per store wait that timed out."""

    def __init__(self) -> None:
        self.pings: list[float] = []

    def ping(self) -> None:
        self.pings.append(time.monotonic())


def test_nvrx_still_hands_reserve_fn_the_watchdog_interval() -> None:
    """The patch replaces the module-level function that the wrapper calls by name."""
    source = inspect.getsource(wrap)
    assert "ret = reserve_fn(" in source and "wrapper.progress_watchdog_interval," in source
    assert "store.wait_for_completed(progress_watchdog_interval)" in source


def test_a_spare_waits_in_chunks_of_the_reserve_wait_not_of_the_watchdog_interval() -> None:
    patch_reserve_wait(RESERVE_WAIT)
    patch_reserve_wait(RESERVE_WAIT)  # idempotent

    class Store(TCPStore, StoreMixin):  # type: ignore[misc]
        pass

    master = Store(host_name="127.0.0.1", port=0, is_master=True, wait_for_workers=False,
                   timeout=timedelta(seconds=10))
    store = PrefixStore(0, master)
    state = State(rank=4, world_size=6, active_rank=None, active_world_size=4,
                  initial_rank=4, initial_world_size=6, mode=Mode.INACTIVE, iteration=0)
    watchdog = Watchdog()
    began = time.monotonic()
    waiting = threading.Thread(target=wrap.reserve_fn,
                               args=(state, store, watchdog, timedelta(seconds=1)))
    waiting.start()
    time.sleep(1.2)
    store.record_completed()  # an active rank finished: the spare's wait ends
    waiting.join(timeout=10)
    assert not waiting.is_alive()
    # With 1 s waits the spare would have come back to Python at most twice in 1.2 s; with
    # 0.2 s waits it comes back about six times (one ping each).
    assert len(watchdog.pings) >= 4, [round(p - began, 2) for p in watchdog.pings]
