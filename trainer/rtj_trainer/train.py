"""The step loop: build, resume, train, checkpoint, report. No resiliency branches in here.

Everything that differs between a plain run, an ft_launcher restart and an in-process restart is
behind `Session` (rtj_trainer.resiliency); everything that differs between CPU and CUDA is behind
rtj_trainer.parallel and rtj_trainer.checkpoint; what an attempt holds is the `Trainer`
(rtj_trainer.trainer). One call of `train()` is one attempt: it resumes from the newest valid
committed checkpoint (if any), runs to `train.steps`, waits for the final checkpoint to commit and
returns where it ended (`Finished`: the summary on rank 0, and on every rank the last step and
the newest committed checkpoint, for the pod's termination message).

A SIGTERM inside the step loop ends it early, on every rank at the same step, after a
checkpoint of that step is committed (rtj_trainer.stop); `Finished.stopped` says so
(`Finished.stop_committed` is False when the stop's budget ran out before the commit).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint import expect_offer
from .config import Config
from .errors import FatalError
from .faults import FaultInjector
from .metrics import TrainerMetrics
from .resiliency import Session
from .stop import STOP, StopAgreement, torch_reduce
from .summary import job_summary
from .trainer import Trainer


@dataclass(frozen=True, slots=True)
class Finished:
    """How an attempt that reached the last step ended."""

    summary: dict[str, Any] | None
    """The summary JSON (rank 0; None elsewhere)."""
    step: int
    committed_step: int | None
    committed_time: float | None
    committed_dir: Path | None = None
    """The directory of `committed_step`, when this attempt committed it."""
    stopped: bool = False
    """The loop stopped early, after committing the checkpoint of `step` (rtj_trainer.stop)."""
    everyone_stopped: bool = False
    """...and every rank of the job had been asked to stop (not only some pods)."""
    stop_committed: bool = True
    """False: the stop gave up waiting for the checkpoint of `step` (its budget ran out, or the
    save was abandoned); `committed_step` is an older commit, or None."""


def pace(until: float, *, slice_seconds: float = 0.05) -> None:
    """Sleep until monotonic time `until` (train.min_step_seconds), in slices short enough for
    an asynchronous exception of the in-process wrapper to land between them."""
    while (left := until - time.monotonic()) > 0:
        time.sleep(min(left, slice_seconds))


def train(cfg: Config, session: Session, metrics: TrainerMetrics) -> Finished:
    trainer = Trainer.build(cfg, session)
    clean = False
    # An in-process restart resumes from the state this attempt reached, if it is intact: the
    # wrapper's finalize step asks for it (checkpoint.stage_offered), not this attempt's own
    # exception handler, which NVRx's repeated restart exceptions can cut short.
    expect_offer(session.carry, trainer.offer_live_state)
    try:
        trainer.resume()
        metrics.watch(trainer.snapshot)
        injector = FaultInjector(cfg.fault_list, rank=trainer.rank,
                                 marker_dir=Path(cfg.checkpoint.dir) / "faults")
        agreement = StopAgreement(torch_reduce(trainer.ctx.device),
                                  check_every=cfg.checkpoint.stop_check_every_steps)
        loop_began = time.perf_counter()
        STOP.arm()  # from now on a SIGTERM asks for a checkpoint, then a stop
        for step in range(trainer.current_step + 1, cfg.train.steps + 1):
            step_began = time.monotonic()
            with session.watched_step():  # the learned hang timeout (rtj_trainer.hangwatch)
                injector.maybe_fire(step)
                trainer.step(step)
            if trainer.checkpoint_due(step):
                trainer.save(step, fail=injector.write_fault(step))
            elif trainer.local_snapshot_due(step):
                trainer.local_snapshot(step)
            trainer.report(step)
            pace(step_began + cfg.train.min_step_seconds)
            if step < cfg.train.steps and agreement.should_stop(step, trainer.steps_this_attempt):
                everyone = trainer.stop(step, agreement)
                clean = True
                committed_step, committed_time, committed_dir = trainer.newest_commit()
                return Finished(summary=None, step=step, committed_step=committed_step,
                                committed_time=committed_time, committed_dir=committed_dir,
                                stopped=True, everyone_stopped=everyone,
                                stop_committed=trainer.stop_committed)
        loop_seconds = time.perf_counter() - loop_began
        trainer.finish()
        injector.maybe_fire(cfg.train.steps + 1)  # a fault on the way out (faults.py)
        clean = True
        committed_step, committed_time, committed_dir = trainer.newest_commit()
        return Finished(
            summary=job_summary(trainer, loop_seconds) if trainer.rank == 0 else None,
            step=trainer.current_step, committed_step=committed_step,
            committed_time=committed_time, committed_dir=committed_dir,
        )
    except BaseException as exc:
        STOP.disarm()  # an in-process restart or a dying worker has nothing newer to save
        if isinstance(exc, (FatalError, KeyboardInterrupt, SystemExit)):
            expect_offer(session.carry, None)  # no restart resumes from here
        raise
    finally:
        if clean:
            expect_offer(session.carry, None)
        metrics.unwatch()
        trainer.close(clean=clean)
