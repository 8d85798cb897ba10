"""The step loop: build, resume, train, checkpoint, report. No resiliency branches in here.

Everything that differs between a plain run, an ft_launcher restart and an in-process restart is
behind `Session` (rtj_trainer.resiliency); everything that differs between CPU and CUDA is behind
rtj_trainer.parallel and rtj_trainer.checkpoint. One call of `train()` is one attempt: it resumes
from the newest valid committed checkpoint (if any), runs to `train.steps`, waits for the final
checkpoint to commit and returns the summary (rank 0) or None.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from . import parallel
from .checkpoint import Checkpointer
from .config import Config
from .data import TokenBatches
from .faults import FaultInjector, parse_faults
from .metrics import LEDGER_FILE, Ledger, TrainerMetrics, advance_ledger
from .resiliency import Session

log = logging.getLogger(__name__)
LOSSES_FILE = "losses.jsonl"


def _agree_on_identity(cfg: Config, session: Session, ctx: parallel.DistributedContext) -> tuple[
    str, dict[str, int]
]:
    """Rank 0 names this attempt (checkpoint directories carry the name); all ranks report their
    pod's attempt number so restarts can be classified."""
    attempts: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(attempts, (str(cfg.job.node_index), cfg.job.attempt))
    pod_attempts = dict(attempts)
    name = [
        f"a{sum(pod_attempts.values())}-l{session.launch.launcher_restart_count}"
        f"-i{session.iteration}-{int(time.time() * 1000) % 10**8}"
    ]
    dist.broadcast_object_list(name, src=0)
    return str(name[0]), pod_attempts


def _reconcile_ledger(
    cfg: Config,
    session: Session,
    pod_attempts: dict[str, int],
    resumed_step_completed_at: float | None,
    rank: int,
) -> Ledger:
    """Rank 0 advances job-state.json for this attempt; every rank gets the same ledger."""
    box: list[Any] = [None]
    if rank == 0:
        path = cfg.run_dir / LEDGER_FILE
        ledger = advance_ledger(
            Ledger.read(path),
            now=time.time(),
            pod_attempts=pod_attempts,
            launcher_restart_count=session.launch.launcher_restart_count,
            inprocess_iteration=session.iteration,
            resumed_step_completed_at=resumed_step_completed_at,
        )
        ledger.write(path)
        box[0] = ledger
    dist.broadcast_object_list(box, src=0)
    result: Ledger = box[0]
    return result


def _count_commits(root: Path) -> int:
    try:
        return sum(1 for line in (root / "commits.jsonl").read_text().splitlines() if line)
    except FileNotFoundError:
        return 0


def train(cfg: Config, session: Session, metrics: TrainerMetrics) -> dict[str, Any] | None:
    launch = session.launch
    ctx = parallel.init_distributed(cfg, launch, session.process_group_store())
    checkpointer: Checkpointer | None = None
    clean = False
    try:
        identity, pod_attempts = _agree_on_identity(cfg, session, ctx)
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        data = TokenBatches(cfg.data, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size)
        checkpointer = Checkpointer(
            cfg.checkpoint,
            root=Path(cfg.checkpoint.dir),
            rank=ctx.rank,
            world_size=ctx.world_size,
            device=ctx.device,
            identity=identity,
            keepalive=session.heartbeat,
        )

        start_step, productive, completed_at = 0, 0.0, None
        loaded = checkpointer.load_latest()
        # A resume overwrites every parameter: skip building and initialising the full model.
        model = parallel.build_model(cfg, ctx, initialise=loaded is None)
        optimizer, scheduler = parallel.build_optimizer(cfg, model)
        if loaded is not None:
            state = loaded.state
            if state["data"]["fingerprint"] != data.fingerprint():
                raise RuntimeError(
                    f"checkpoint {loaded.directory.name} was written for other data "
                    f"({state['data']['fingerprint']} != {data.fingerprint()})"
                )
            parallel.load_local_state(model, optimizer, scheduler, state)
            parallel.set_rng_state(state["rng"], ctx.device)
            session.load_monitor_state(state["monitor"])
            start_step = int(state["step"])
            productive = float(state["productive_seconds"])
            completed_at = float(state["step_completed_at"])
            if ctx.rank == 0:
                print(f"[rtj-trainer] resumed from {loaded.directory.name} (step {start_step})"
                      + (f"; rejected: {list(loaded.rejected)}" if loaded.rejected else ""),
                      flush=True)
        ledger = _reconcile_ledger(cfg, session, pod_attempts, completed_at, ctx.rank)

        snap = metrics.snapshot
        snap.job_started_at = ledger.started_at
        snap.restarts = dict(ledger.restarts)
        snap.lost_seconds = ledger.lost_seconds
        snap.productive_seconds = productive
        snap.step = start_step
        snap.checkpoint_committed_step = checkpointer.stats.committed_step
        snap.checkpoint_committed_timestamp = checkpointer.stats.committed_at
        snap.heartbeat_timestamp = session.heartbeat()

        injector = FaultInjector(parse_faults(cfg.faults), rank=ctx.rank,
                                 marker_dir=Path(cfg.checkpoint.dir) / "faults")
        losses = open(cfg.run_dir / LOSSES_FILE, "a") if ctx.rank == 0 else None  # noqa: SIM115
        tokens_per_step = cfg.data.batch_size * cfg.model.seq_len
        interval = cfg.checkpoint.interval_steps
        loss_value = float("nan")
        steps_this_attempt = 0
        stall_total, stall_max = 0.0, 0.0
        step = start_step

        def checkpoint_state() -> dict[str, Any]:
            state = parallel.local_state(model, optimizer, scheduler)
            state.update(
                step=step,
                rng=parallel.rng_state(ctx.device),
                data={"next_step": step + 1, "fingerprint": data.fingerprint()},
                monitor=session.monitor_state(),
                productive_seconds=productive,
                step_completed_at=time.time(),
            )
            return state

        loop_began = time.perf_counter()
        try:
            for step in range(start_step + 1, cfg.train.steps + 1):
                injector.maybe_fire(step)
                began = time.perf_counter()
                with session.section("step"):
                    batch = data.batch(step, ctx.rank).to(ctx.device, non_blocking=True)
                    loss = parallel.train_step(model, optimizer, scheduler, batch,
                                               cfg.optim.grad_clip)
                    loss_value = float(loss.item())
                seconds = time.perf_counter() - began
                productive += seconds
                steps_this_attempt += 1
                snap.heartbeat_timestamp = session.heartbeat()
                snap.step, snap.step_seconds = step, seconds
                snap.tokens_per_second = tokens_per_step / seconds if seconds > 0 else 0.0
                snap.productive_seconds = productive
                if losses is not None:
                    losses.write(json.dumps({"step": step, "loss": loss_value,
                                             "attempt": identity, "pid": os.getpid(),
                                             "time": time.time()}) + "\n")
                    losses.flush()
                session.after_step(steps_this_attempt)
                if steps_this_attempt == 1 and interval:  # optimizer state now exists
                    checkpointer.prepare(checkpoint_state())

                last = step == cfg.train.steps
                if (interval and step % interval == 0) or (last and cfg.checkpoint.save_final):
                    save_began = time.perf_counter()
                    with session.section("checkpoint"), session.atomic():
                        state = checkpoint_state()
                        checkpointer.save(step, state)
                        del state
                    stall = time.perf_counter() - save_began  # state_dict + staging (+ sync write)
                    snap.checkpoint_stall_seconds = stall
                    stall_total += stall
                    stall_max = max(stall_max, stall)
                    if ctx.rank == 0:
                        print(f"[rtj-trainer] checkpoint step {step} ({cfg.checkpoint.mode}) "
                              f"stall {stall:.4f} s", flush=True)
                stats = checkpointer.poll()
                snap.checkpoint_write_seconds = stats.last_write_seconds
                snap.checkpoint_committed_step = stats.committed_step
                snap.checkpoint_committed_timestamp = stats.committed_at
                if ctx.rank == 0 and (step % cfg.train.log_every == 0 or last):
                    print(f"[rtj-trainer] step {step}/{cfg.train.steps} loss {loss_value:.4f} "
                          f"{seconds * 1000:.1f} ms/step committed={stats.committed_step}",
                          flush=True)
        finally:
            if losses is not None:
                losses.close()
        loop_seconds = time.perf_counter() - loop_began

        with session.section("checkpoint"):
            checkpointer.wait_until_committed()
        stats = checkpointer.stats
        snap.checkpoint_write_seconds = stats.last_write_seconds
        snap.checkpoint_committed_step = stats.committed_step
        snap.checkpoint_committed_timestamp = stats.committed_at
        dist.barrier()
        clean = True
        if ctx.rank != 0:
            return None
        now = time.time()
        return {
            "event": "summary",
            "steps": cfg.train.steps,
            "final_loss": loss_value,
            "wall_seconds": round(now - ledger.started_at, 3),
            "productive_seconds": round(productive, 3),
            "goodput": round(productive / max(1e-9, now - ledger.started_at), 4),
            "restarts": dict(ledger.restarts),
            "lost_seconds": round(ledger.lost_seconds, 3),
            "checkpoints_committed": _count_commits(Path(cfg.checkpoint.dir)),
            "last_committed_step": stats.committed_step,
            "attempt_steps": steps_this_attempt,
            "attempt_loop_seconds": round(loop_seconds, 3),
            "attempt_checkpoint_stall_seconds_total": round(stall_total, 4),
            "attempt_checkpoint_stall_seconds_max": round(stall_max, 4),
        }
    finally:
        if checkpointer is not None:
            checkpointer.close(abort=not clean)
        if clean:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        if ctx.device.type == "cuda":
            torch.cuda.empty_cache()
