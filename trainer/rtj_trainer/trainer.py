"""What one training attempt trains with, and what its checkpoints hold: the `Trainer`.

`train()` (rtj_trainer.train) drives it: `build` → `resume` → per step `step` (and `save` when a
checkpoint is due, then `report`) → `finish` → `close`. The Trainer owns the attempt's state: the
model, optimizer and scheduler (rtj_trainer.parallel), the data, the Checkpointer, and its own
counters. `state_dict()` is the whole checkpoint of a rank, keyed by the constants below next to
parallel's `MODEL`, `OPTIMIZER` and `SCHEDULER`; `load_state_dict()` is its inverse.

The Trainer is also the metrics' source: `snapshot()` reads the heartbeat from the Session (the
very beat NVRx received, including the Checkpointer's keepalive beats while it waits on I/O), the
commit figures from the Checkpointer's stats and the restart figures from the ledger, at the
moment of a scrape. Nothing copies values into the metrics.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from . import hfmodel, parallel, timeline
from .attempt import agree_on_identity, agree_on_ledger
from .checkpoint import (
    Checkpointer,
    CommitTimeoutError,
    close_interrupted,
    job_identity,
    stage_offered,
)
from .config import Config
from .data import TokenBatches
from .errors import DataMismatchError
from .gloocut import GlooConnections
from .ledger import LEDGER_FILE, Ledger
from .metrics import Snapshot
from .resiliency import Session
from .statekeys import (
    CONSUMED,
    DATA,
    FINGERPRINT,
    HF_CONFIG,
    LOSS,
    LOSSES_FILE,
    MONITOR,
    NEXT_STEP,
    PRODUCTIVE_SECONDS,
    RNG,
    STEP,
    STEP_COMPLETED_AT,
)
from .stop import StopAgreement

log = logging.getLogger(__name__)

_FROM = {"local": " from the node-local copies", "memory": " from the staging copy in memory",
         "device": " from the snapshot the device keepers hold", "resharded": " resharded",
         "live": " from the training state at the fault, kept in memory (no step recomputed)"}
"""How the resume log names where a checkpoint was read from (the shared store: nothing)."""


def _release(ctx: parallel.DistributedContext, gloo: GlooConnections, *, clean: bool) -> None:
    if clean:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
        gloo.forget()
    if ctx.device.type == "cuda":
        torch.cuda.empty_cache()


class Trainer:
    """One attempt's model, optimizer, data and checkpointer, and where the step loop stands."""

    def __init__(self, cfg: Config, session: Session, ctx: parallel.DistributedContext) -> None:
        """Use `Trainer.build`; this expects the process group of `ctx` to be up."""
        self.cfg = cfg
        self.session = session
        self.ctx = ctx
        self.rank = ctx.rank
        self.identity, self._pod_attempts = agree_on_identity(cfg, session, ctx)
        timeline.mark("identity")
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        self.data = TokenBatches(cfg.data, seq_len=cfg.model.seq_len,
                                 vocab_size=cfg.model.vocab_size, world_size=ctx.world_size)
        self._hf_config = (json.dumps(hfmodel.config_dict(cfg.model.hf_path))
                           if cfg.model.hf_path else "")
        carry = session.carry
        close_interrupted(carry)  # an earlier attempt's writer: kept or stopped before a new one
        stage_offered(carry)  # and the state it offered to keep, if the finalize step did not
        self.checkpointer = Checkpointer(
            cfg.checkpoint,
            root=Path(cfg.checkpoint.dir),
            rank=ctx.rank,
            world_size=ctx.world_size,
            device=ctx.device,
            identity=self.identity,
            job=job_identity(cfg.job.namespace, cfg.job.name),
            accepted_jobs=cfg.checkpoint.resume_from_jobs,
            keepalive=session.heartbeat,
            carry=carry,
        )
        try:
            self._loaded = self.checkpointer.load_latest()
            timeline.mark("checkpoint_chosen")
            # A resume overwrites every parameter: skip building and initialising the full model.
            self.model = parallel.build_model(cfg, ctx, initialise=self._loaded is None)
            self.optimizer, self.scheduler = parallel.build_optimizer(cfg, self.model)
        except BaseException:
            # An interrupted build (an in-process restart lands anywhere) still hands its
            # writer back or stops it (checkpoint.ProcessWriter).
            self.checkpointer.close(abort=True)
            raise
        timeline.mark("model_built")
        self.ledger: Ledger | None = None
        self.current_step = 0
        """The last completed step (the resumed one before the first step of this attempt)."""
        self.loss = float("nan")
        self.step_seconds = 0.0
        self.productive_seconds = 0.0
        self.steps_this_attempt = 0
        self.attempt_step_seconds = 0.0
        """The seconds of this attempt's steps (`step`'s own, as in `productive_seconds`): the
        loop's seconds less these went between the steps."""
        self.prepare_seconds: dict[str, float] = {}
        """After this attempt's first step: reading the state and `Checkpointer.prepare`."""
        self.last_stall_seconds = 0.0
        self.stall_seconds_total = 0.0
        self.stall_seconds_max = 0.0
        self.saved_step: int | None = None
        """The newest step this attempt started a checkpoint of."""
        self.snapshots = {"taken": 0, "skipped": 0, "stall_seconds": 0.0, "state_seconds": 0.0}
        """Node-local snapshots of this attempt (`snapshot`); `state_seconds`: of the stall."""
        self._losses: IO[str] | None = None
        self._finished = False
        self.final_save: dict[str, float] = {}
        """Rank 0, once finished: where the wait for the last checkpoint went (`finish`)."""
        """`finish` ran: every checkpoint is committed and the node-local copies can go."""
        self.stop_committed = True
        """False once a stop gave up waiting for its checkpoint (`stop`)."""
        self._interruptible = cfg.resiliency.inprocess_restart and ctx.device.type == "cuda"
        """Wait for the GPU at points within a step (in-process restart: parallel.train_step)."""
        self._keeps_live_state = bool(session.restarts_in_process
                                      and cfg.checkpoint.interval_steps)
        """An in-process restart stages the state this attempt reached (`offer_live_state`)."""
        self._live_views: dict[str, Any] | None = None
        """The model and optimizer state read in place (parallel.live_views), once known: for an
        in-process restart (`offer_live_state`) and snapshots (`snapshot_state`)."""
        self._live: tuple[int, dict[str, Any], float] | None = None
        """(step, RNG state, completed at) while the model and optimizer hold the state after
        that step; None from the moment the optimizer starts updating until the step is done."""

    @classmethod
    def build(cls, cfg: Config, session: Session) -> Trainer:
        """Join the process group and build everything; on failure, give the device back."""
        timeline.mark("build")
        ctx = parallel.init_distributed(cfg, session.launch, session.process_group_store(),
                                        session.carry.gloo)
        timeline.mark("process_group")
        try:
            return cls(cfg, session, ctx)
        except BaseException:
            _release(ctx, session.carry.gloo, clean=False)
            raise

    # -- the checkpoint's content -------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """This rank's whole checkpoint (tensors still on the device)."""
        state = self._whole_state(parallel.local_state(self.model, self.optimizer, self.scheduler),
                                  rng=parallel.rng_state(self.ctx.device), completed_at=time.time())
        if self._keeps_live_state or self.cfg.checkpoint.local_interval_steps:
            known = self._live_views is not None
            self._live_views = parallel.live_views(self.model, self.optimizer, state)
            if self._live_views is None and self._keeps_live_state and (
                    known or self.saved_step is None):
                log.warning("the training state cannot be read in place (a state-dict tensor is "
                            "a copy): an in-process restart resumes from the last save",
                            extra={"rank": self.rank})
        return state

    def snapshot_state(self) -> dict[str, Any]:
        """`state_dict()` for a node-local snapshot, read in place through the live views once
        known (parallel.live_state), without `get_state_dict`'s walk over every entry."""
        if self._live_views is None:
            return self.state_dict()
        return self._whole_state(parallel.live_state(self._live_views, self.optimizer,
                                                     self.scheduler),
                                 rng=parallel.rng_state(self.ctx.device), completed_at=time.time())

    def _whole_state(self, local: dict[str, Any], *, rng: dict[str, Any],
                     completed_at: float) -> dict[str, Any]:
        state = dict(local)
        state.update({
            STEP: self.current_step,
            RNG: rng,
            DATA: {NEXT_STEP: self.current_step + 1, FINGERPRINT: self.data.fingerprint(),
                   CONSUMED: self.data.consumed(self.current_step)},
            MONITOR: self.session.monitor_state(),
            PRODUCTIVE_SECONDS: self.productive_seconds,
            STEP_COMPLETED_AT: completed_at,
            LOSS: self.loss,
        })
        if self.cfg.model.hf_path:
            state[HF_CONFIG] = self._hf_config
        return state

    def offer_live_state(self) -> bool:
        """An in-process restart interrupted this attempt (any exception but a fatal one): when the
        model and optimizer still hold the state after the last completed step, offer that state
        to the checkpointer (Checkpointer.offer_live), which stages it into its staging buffer,
        so that the next attempt resumes from it (when every rank did the same) instead of
        rolling back to the last save. Called from the wrapper's finalize step, where nothing
        can interrupt it (registered by rtj_trainer.train with `checkpoint.expect_offer`).
        The state is read in place and needs no process group: on every rank but the failing
        one, NVRx has aborted and destroyed it by now. Returns whether it offered."""
        live, views = self._live, self._live_views
        if not self._keeps_live_state:
            return False
        step = None if live is None else live[0]
        if live is None or views is None or step != self.current_step:
            log.info("the training state after step %d is not kept (%s): the next attempt "
                     "resumes from the last save", self.current_step,
                     "no step done, or the optimizer was updating" if live is None
                     else "no views of it" if views is None else f"it is that of step {step}",
                     extra={"rank": self.rank})
            return False
        _, rng, completed_at = live
        local = parallel.live_state(views, self.optimizer, self.scheduler)
        self.checkpointer.offer_live(step, self._whole_state(local, rng=rng,
                                                             completed_at=completed_at))
        return True

    def _updating(self) -> None:
        self._live = None  # the optimizer starts changing the parameters

    def load_state_dict(self, state: dict[str, Any]) -> None:
        parallel.load_local_state(self.model, self.optimizer, self.scheduler, state)
        parallel.set_rng_state(state[RNG], self.ctx.device)
        self.session.load_monitor_state(state[MONITOR])
        self.current_step = int(state[STEP])
        self.data.resume(self.current_step, state[DATA].get(CONSUMED))
        self.productive_seconds = float(state[PRODUCTIVE_SECONDS])
        self.loss = float(state.get(LOSS, float("nan")))  # checkpoints before 2026-12-04: none

    # -- the attempt ------------------------------------------------------------------------

    def resume(self) -> None:
        """Load the newest checkpoint every rank finds valid (if any), then advance the ledger."""
        completed_at = None
        resumed_step = None
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            state = loaded.state
            if state[DATA][FINGERPRINT] != self.data.fingerprint():
                raise DataMismatchError(
                    f"checkpoint {loaded.directory} was written for other data (fingerprint "
                    f"{state[DATA][FINGERPRINT]}, this job's data has {self.data.fingerprint()}); "
                    "restore the job's data settings or point checkpoint.dir elsewhere"
                )
            self.load_state_dict(state)
            completed_at = float(state[STEP_COMPLETED_AT])
            resumed_step = self.current_step
            timeline.mark("state_loaded")
            if self.rank == 0:
                log.info("resumed from %s (step %d)%s%s", loaded.directory.name, self.current_step,
                         _FROM.get(loaded.source, ""),
                         f"; rejected: {list(loaded.rejected)}" if loaded.rejected else "")
        self.ledger = agree_on_ledger(self.cfg, self.session, self._pod_attempts, completed_at,
                                        resumed_step, self.rank)
        self.session.heartbeat()
        if self.rank == 0:
            self._losses = open(self.cfg.run_dir / LOSSES_FILE, "a")  # noqa: SIM115

    def step(self, step: int) -> None:
        """Train `step`, beat, and record its loss."""
        began = time.perf_counter()
        with self.session.section("step"):
            batch = self.data.batch(step, self.rank).to(self.ctx.device, non_blocking=True)
            loss = parallel.train_step(self.model, self.optimizer, self.scheduler, batch,
                                       self.cfg.optim.grad_clip, interruptible=self._interruptible,
                                       before_update=self._updating,
                                       update_guard=self.session.atomic)
            # The blocking copy in `item()` must not hold the GIL (see parallel.train_step).
            parallel.wait_for_device(loss.device)
            self.loss = float(loss.item())
        seconds = time.perf_counter() - began
        self.productive_seconds += seconds
        self.attempt_step_seconds += seconds
        self.steps_this_attempt += 1
        self.session.heartbeat()
        self.current_step, self.step_seconds = step, seconds
        if self._keeps_live_state:
            self._live = (step, parallel.rng_state(self.ctx.device), time.time())
        if self._losses is not None:
            self._losses.write(json.dumps({"step": step, "loss": self.loss,
                                           "attempt": self.identity, "pid": os.getpid(),
                                           "time": time.time()}) + "\n")
            self._losses.flush()
        self.session.after_step(self.steps_this_attempt)
        if self.steps_this_attempt == 1:
            timeline.mark("first_step")
            log.info("timeline %s", timeline.render(), extra={"rank": self.rank})
            if self.cfg.checkpoint.interval_steps:
                preparing = time.perf_counter()
                state = self.state_dict()  # the optimizer's state exists now
                read = time.perf_counter()
                self.checkpointer.prepare(state)
                del state
                self.prepare_seconds = {"state": round(read - preparing, 4),
                                        **self.checkpointer.prepare_seconds}

    def checkpoint_due(self, step: int) -> bool:
        interval = self.cfg.checkpoint.interval_steps
        last = step == self.cfg.train.steps
        return bool(interval and step % interval == 0) or (last and self.cfg.checkpoint.save_final)

    def local_snapshot_due(self, step: int) -> bool:
        every = self.cfg.checkpoint.local_interval_steps
        return bool(every and step % every == 0 and step != self.cfg.train.steps)

    def local_snapshot(self, step: int) -> None:
        """A node-local snapshot of `step` (`checkpoint.local_interval_steps`), skipped when this
        rank's writer is still busy: each rank decides alone (a snapshot counts for a resume
        only when every rank holds it), but every rank reads its state dict, in case reading
        it is collective."""
        began = time.perf_counter()
        with self.session.section("checkpoint"), self.session.atomic():
            state = self.snapshot_state()
            self.snapshots["state_seconds"] += time.perf_counter() - began  # section + state
            taken = self.checkpointer.snapshot_ready()
            if taken:
                self.checkpointer.snapshot(step, state)
        self.snapshots["taken" if taken else "skipped"] += 1
        self.snapshots["stall_seconds"] += time.perf_counter() - began

    def save(self, step: int, *, fail: str | None = None, deadline: float | None = None) -> None:
        """Start a checkpoint of `step` (read in place when staged through the device copy);
        `fail`: an injected write fault (FaultInjector.write_fault); `deadline`: a stop's."""
        began = time.perf_counter()
        with self.session.section("checkpoint"), self.session.atomic():
            state = self.snapshot_state() if self.checkpointer.defers_saves() else self.state_dict()
            # The last step's save is waited for and its node-local copies discarded (finish):
            # a copy would only delay its commit (one rank of the 1B model: 11.3 GB to /dev/shm).
            self.checkpointer.save(step, state, local_copy=step != self.cfg.train.steps,
                                   fail=fail, deadline=deadline)
            del state
        self.saved_step = step
        stall = time.perf_counter() - began  # state_dict + staging (+ sync write)
        self.last_stall_seconds = stall
        self.stall_seconds_total += stall
        self.stall_seconds_max = max(self.stall_seconds_max, stall)
        if self.rank == 0:
            log.info("checkpoint step %d (%s) stall %.4f s", step, self.cfg.checkpoint.mode, stall)

    def report(self, step: int) -> None:
        """Notice finished checkpoint writes (rank 0 commits them) and log progress."""
        stats = self.checkpointer.poll()
        last = step == self.cfg.train.steps
        if self.rank == 0 and (step % self.cfg.train.log_every == 0 or last):
            log.info("step %d/%d loss %.4f %.1f ms/step committed=%d", step, self.cfg.train.steps,
                     self.loss, self.step_seconds * 1000, stats.committed_step)

    def finish(self) -> None:
        """After the last step: wait until every checkpoint is committed, on every rank."""
        self._close_losses()
        began = time.perf_counter()
        with self.session.section("checkpoint"):
            if self.saved_step == self.cfg.train.steps:
                # Every rank reads the same verdict (rank 0's), so all of them fail together.
                self.checkpointer.wait_until_kept(self.saved_step)
            else:
                self.checkpointer.wait_until_committed()
        waited = time.perf_counter()
        self._barrier()
        last = self.checkpointer.stats.last_commit
        if last.get("step") == self.saved_step:  # rank 0: the last save's phases
            self.final_save = {**last, "wait": round(waited - began, 4),
                               "barrier": round(time.perf_counter() - waited, 4)}
        # Every rank's last checkpoint is committed: what is left (the exit, NVRx's completion
        # barrier, the launcher's) sends no heartbeat and must not be timed as a hang.
        self.session.training_finished()
        self._finished = True

    def stop(self, step: int, agreement: StopAgreement) -> bool:
        """Every rank agreed to stop after `step` (rtj_trainer.stop): save it unless it is saved
        already, wait until rank 0 committed it, and tell whether every rank was asked to stop
        (then rank 0 records the stop in the ledger: the next attempt is a resume, not a
        restart). Returns that verdict, the same on every rank.

        The wait is bounded by the stop's budget (`stop.stop_budget`: the launcher's
        `--term-timeout` less the time since the signal, the same on every rank), not by the
        commit deadline: a rank SIGKILLed before its shard was written would otherwise hold the
        others for `commit_timeout_seconds`. Past it `stop_committed` is False, no rank claims
        the step committed, and no rank joins another collective (a peer may be gone): the
        verdict is then False."""
        began = time.perf_counter()
        budget, deadline = agreement.stop_deadline(self.cfg.checkpoint.stop_timeout_seconds)
        saves = bool(self.cfg.checkpoint.interval_steps)
        self._close_losses()
        with self.session.section("checkpoint"):
            try:
                if self.saved_step != step and saves:
                    self.save(step, deadline=deadline)
            except CommitTimeoutError as exc:
                log.error("the stop checkpoint of step %d could not be started in time (%s)",
                          step, exc, extra={"rank": self.rank})
                self.stop_committed = False
            else:
                self.stop_committed = self.checkpointer.wait_for_stop(
                    step if saves else None, deadline)
        if not self.stop_committed:
            if self.rank == 0:
                log.info("stopped after step %d without its checkpoint, after %.3f s (budget "
                         "%.0f s); newest commit: step %d", step, time.perf_counter() - began,
                         budget, self.checkpointer.stats.committed_step)
            return False
        everyone = agreement.verdict().everyone
        committed = self.checkpointer.stats.committed_step
        if self.rank == 0:
            if everyone and committed == step:
                ledger = self.current_ledger()
                ledger.stopped_step = step
                ledger.write(self.cfg.run_dir / LEDGER_FILE)
            log.info("stopped after step %d: checkpoint of step %s committed in %.3f s (%s)",
                     step, committed, time.perf_counter() - began,
                     "every rank was asked to stop" if everyone
                     else "some ranks were asked to stop; the others will restart")
        self._barrier()
        return everyone

    def _barrier(self) -> None:
        """Wait for every rank, beating meanwhile (parallel.barrier)."""
        parallel.barrier(self.session.heartbeat,
                         timeout=parallel.collective_timeout(self.cfg, self.ctx.device))

    def newest_commit(self) -> tuple[int | None, float | None, Path | None]:
        """The step, commit time and (when this attempt committed it) directory of the newest
        checkpoint committed at this world size: the checkpointer's count (rank 0's resume plan,
        then the commits this attempt noticed), so no rank reads a manifest at the end."""
        stats = self.checkpointer.stats
        if stats.committed_step < 0:
            return None, None, None
        return stats.committed_step, stats.committed_at, stats.committed_dir

    def close(self, *, clean: bool) -> None:
        """Stop the checkpoint writer (abandoning its work unless `clean`) and free the device;
        after `finish`, delete the node-local copies (after the summary: the job's result was
        committed, and deleting GBs of /dev/shm takes seconds)."""
        self._close_losses()
        # A stop that gave up its checkpoint stops a writer still at it, and leaves the
        # process group alone: a peer may be gone, and the process exits next.
        clean = clean and self.stop_committed
        self.checkpointer.close(abort=not clean)
        if clean and self._finished:
            self.checkpointer.discard_local_copies()
            self.checkpointer.release_lock()  # the job is done: the directory is free
        _release(self.ctx, self.session.carry.gloo, clean=clean)

    def snapshot(self) -> Snapshot:
        """The metrics' values now, read from their sources (called on every scrape)."""
        ledger = self.current_ledger()
        stats = self.checkpointer.stats
        tokens_per_step = self.cfg.data.batch_size * self.cfg.model.seq_len
        seconds = self.step_seconds
        return Snapshot(
            heartbeat_timestamp=self.session.last_heartbeat,
            step=self.current_step,
            step_seconds=seconds,
            tokens_per_second=tokens_per_step / seconds if seconds > 0 else 0.0,
            checkpoint_stall_seconds=self.last_stall_seconds,
            checkpoint_write_seconds=stats.last_write_seconds,
            checkpoint_committed_step=stats.committed_step,
            checkpoint_committed_timestamp=stats.committed_at,
            restarts=dict(ledger.restarts),
            productive_seconds=self.productive_seconds,
            lost_seconds=ledger.lost_seconds,
            job_started_at=ledger.started_at,
        )

    def current_ledger(self) -> Ledger:
        """This attempt's ledger (set by `resume`)."""
        if self.ledger is None:
            raise RuntimeError("Trainer.resume() has not run yet")
        return self.ledger

    def _close_losses(self) -> None:
        if self._losses is not None:
            self._losses.close()
            self._losses = None
