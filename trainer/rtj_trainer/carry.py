"""What one training attempt leaves to the next attempt in the same process: the `CarryOver`.

Why: with in-process restart (rtj_trainer.resiliency, NVRx's wrapper) a soft fault ends an attempt
and the wrapper calls the training function again in the same process. Some things are too costly
to build anew on that critical path, or must be finished by the next attempt, so they outlive the
attempt:

- `writer`: the rank's idle NVRx checkpoint writer process (spawning one imports torch: seconds),
  and `writer_to_replace`, the rank whose writer was stopped mid-write and must be replaced once
  nothing can interrupt any more (rtj_trainer.checkpoint.checkpointer, "ProcessWriter");
- `staging`: the page-locked host staging buffer (GBs: seconds to allocate and register), and the
  save it holds, from which the next attempt may resume with no step recomputed;
- `unclosed`: checkpointers whose `close()` an in-process restart cut short, finished at the
  wrapper's finalize step (`checkpoint.close_interrupted`);
- `offered` / `offer`: the training state an interrupted attempt offered to keep, and how it
  offers it (`checkpoint.expect_offer`, `checkpoint.stage_offered`);
- `gloo`: the attempt's gloo connections, cut by the wrapper's abort step (rtj_trainer.gloocut).

One `CarryOver` per process, owned by `Resiliency` (the in-process restart layer) and passed
explicitly: `Session.carry` → `Trainer` → `Checkpointer(carry=...)` and
`parallel.init_distributed(..., gloo=...)`; the wrapper's abort and finalize steps get it through
the `Resiliency` that builds them. Code that is given none (a unit test, a tool) makes a fresh
one: nothing is carried.

What stays process-global on purpose, and why: `stop.STOP` (set by a signal handler, which is
process-wide by nature), `timeline`'s marks (the process's own start-up timeline, read in its
log lines) and the warm worker's attachment (rtj_trainer.warm.worker: one per warm process, used
by its `atexit` hook). None of them is state an attempt hands to the next.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .gloocut import GlooConnections


@dataclass(eq=False)
class CarryOver:
    """See the module docstring. Fields typed loosely where their classes live above this module
    (the checkpointer's own types: rtj_trainer.checkpoint)."""

    writer: Any = None
    """The kept NVRx writer queue (idle), or None."""
    writer_to_replace: int | None = None
    """The rank whose writer an in-process restart stopped while it was writing."""
    staging: Any = None
    """The process's `checkpoint.staging.HostStaging` (created at first use)."""
    unclosed: list[Any] = field(default_factory=list)
    """Checkpointers whose close() has not run to its end."""
    offered: tuple[Any, int, dict[str, Any]] | None = None
    """(checkpointer, step, state): the training state an interrupted attempt offered to keep,
    not staged yet."""
    offer: Callable[[], object] | None = None
    """How the running attempt offers its training state, while it may be interrupted."""
    gloo: GlooConnections = field(default_factory=GlooConnections)
