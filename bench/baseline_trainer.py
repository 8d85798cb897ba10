"""What a Kubeflow PyTorchJob user runs instead (issue #32's baseline), for `bench.goodput`'s
`baseline` variant: a plain torchrun worker script with the same model (the built-in GPT, or
`model.hf_path`), data, optimizer, learning-rate schedule and steps as the trainer (it builds
them with the trainer's own functions and config), that saves with
`torch.distributed.checkpoint.async_save` every `checkpoint.interval_steps` steps, keeps the
`checkpoint.keep` newest complete saves (as the trainer keeps its commits), and resumes from the
newest complete save (DCP writes `.metadata` last).

What it does not have, on purpose, because that user does not: no heartbeats, no in-process
restart, no node-local copies, no warm workers. `torchrun --max-restarts` restarts every worker
when one exits (an exception, a SIGKILL). Its only hang protection is the collective timeout of
`init_process_group` (`--collective-timeout`, default 600 s, PyTorch's NCCL default): a rank
that hangs outside a collective is never caught on its own, and its peers fail only when their
next collective times out. With one rank there is no peer: a hang never recovers, and the
benchmark caps the run and reports it.

The same fault injection as the trainer (`TRAINER_FAULTS`, once per job, markers under
`<checkpoint dir>/faults`), so both runs meet the same schedule. Rank 0 appends one line per
step to `<checkpoint dir>/losses.jsonl` (the trainer's format) and prints the summary JSON as
the trainer does: productive seconds are the seconds of each step's last execution (recomputed
steps count once),
wall seconds run from the first attempt's start (after its process group and model were built)
to the summary.

    torchrun --standalone --nproc-per-node=2 --max-restarts=8 bench/baseline_trainer.py \\
        --preset tiny --set train.steps=200 --set checkpoint.interval_steps=50
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from rtj_trainer import parallel
from rtj_trainer.configload import build_config
from rtj_trainer.data import TokenBatches
from rtj_trainer.faults import FaultInjector
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh

STEPS_FILE = "losses.jsonl"
"""One line a step, as the trainer's (`step`, `loss`, `attempt`, `time`) plus its `seconds`:
bench.localrun reads both the same way."""
STARTED_FILE = "baseline-started"
SAVE_PREFIX = "dcp-step-"


def newest_complete_save(root: Path) -> tuple[int, Path] | None:
    """The newest save whose `.metadata` DCP wrote (its last file): (step, directory)."""
    saves = []
    for path in root.glob(f"{SAVE_PREFIX}*"):
        if (path / ".metadata").exists():
            saves.append((int(path.name.removeprefix(SAVE_PREFIX)), path))
    return max(saves) if saves else None


def prune_saves(root: Path, keep: int) -> list[Path]:
    """Delete every complete save but the `keep` newest, and every incomplete one older than the
    newest complete (an async save a restart cut short); newer incomplete ones may be in flight.
    What the user's script does with `checkpoint.keep`, as the trainer keeps `keep` commits: a
    run that keeps every 11 GB save fills a 64 GB disk by its sixth. Returns what it deleted."""
    saves = sorted((int(path.name.removeprefix(SAVE_PREFIX)), (path / ".metadata").exists(), path)
                   for path in root.glob(f"{SAVE_PREFIX}*") if path.is_dir())
    complete = [step for step, done, _ in saves if done]
    kept = set(complete[-keep:]) if keep > 0 else set(complete)
    newest = complete[-1] if complete else None
    doomed = [path for step, done, path in saves
              if (done and step not in kept) or (not done and newest is not None and step < newest)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def productive_seconds(lines: list[dict[str, Any]]) -> float:
    """Seconds of each step's last execution: a step run again after a restart counts once."""
    last: dict[int, float] = {}
    for line in lines:
        last[int(line["step"])] = float(line["seconds"])
    return sum(last.values())


def training_state(model: Any, optimizer: Any, scheduler: Any) -> dict[str, Any]:
    """What a save holds and a resume loads into: model, optimizer and schedule."""
    return {"model": get_model_state_dict(model),
            "optim": get_optimizer_state_dict(model, optimizer),
            "scheduler": scheduler.state_dict()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench/baseline_trainer.py")
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--set", action="append", default=[], dest="sets")
    parser.add_argument("--collective-timeout", type=float, default=600.0)
    args = parser.parse_args(argv)
    cfg = build_config(preset=args.preset, env=os.environ, overrides=args.sets)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available() and cfg.train.device != "cpu"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # torchrun's agent keeps one store for all of its restarts, and `env://` adds no prefix per
    # restart: a restarted gloo group read the dead workers' addresses and hung (seen with torch
    # 2.15). Keys per restart, as a user who met that hang would do.
    timeout = timedelta(seconds=args.collective_timeout)
    store = dist.PrefixStore(
        f"baseline/restart-{restart}",
        dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
                      is_master=False, timeout=timeout))
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank,
                            world_size=world, timeout=timeout)
    ctx = parallel.DistributedContext(rank=rank, local_rank=local_rank, world_size=world,
                                      device=device,
                                      mesh=init_device_mesh(device.type, (world,)))
    # DCP's async save runs its collectives in a background thread: on a process group of its
    # own (gloo), as torchtitan does, or they interleave with the training's (seen: gloo's
    # "collective mismatch" abort).
    save_group = dist.new_group(backend="gloo")
    root = Path(cfg.checkpoint.dir)
    root.mkdir(parents=True, exist_ok=True)
    model = parallel.build_model(cfg, ctx, initialise=True)
    optimizer, scheduler = parallel.build_optimizer(cfg, model)
    data = TokenBatches(cfg.data, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size,
                        world_size=world)
    faults = FaultInjector(cfg.fault_list, rank=rank, marker_dir=root / "faults")
    started = root / STARTED_FILE
    if rank == 0 and not started.exists():
        started.write_text(f"{time.time()}\n")
    first = 1
    newest = newest_complete_save(root)
    if newest is not None:
        step, path = newest
        state = training_state(model, optimizer, scheduler)
        dcp.load(state, checkpoint_id=str(path), process_group=save_group)
        set_model_state_dict(model, state["model"])
        set_optimizer_state_dict(model, optimizer, state["optim"])
        scheduler.load_state_dict(state["scheduler"])
        first = step + 1
        if rank == 0:
            print(f"[baseline] resumed from step {step} ({path.name})", flush=True)
    steps_log = (root / STEPS_FILE).open("a") if rank == 0 else None
    pending: Any = None
    interval = cfg.checkpoint.interval_steps
    loss = float("nan")
    for step in range(first, cfg.train.steps + 1):
        faults.maybe_fire(step)
        began = time.perf_counter()
        batch = data.batch(step, rank).to(device, non_blocking=True)
        loss = float(parallel.train_step(model, optimizer, scheduler, batch,
                                         cfg.optim.grad_clip).item())
        seconds = time.perf_counter() - began
        if steps_log is not None:
            steps_log.write(json.dumps({"step": step, "seconds": seconds, "loss": loss,
                                        "attempt": f"r{restart}", "pid": os.getpid(),
                                        "time": time.time()}) + "\n")
            steps_log.flush()
        if interval and (step % interval == 0 or step == cfg.train.steps):
            if pending is not None:
                pending.result()  # one save in flight at a time, as DCP's examples do
                if rank == 0:
                    prune_saves(root, cfg.checkpoint.keep)
            state = training_state(model, optimizer, scheduler)
            pending = dcp.async_save(state, checkpoint_id=str(root / f"{SAVE_PREFIX}{step:09d}"),
                                     process_group=save_group)
    if pending is not None:
        pending.result()
        if rank == 0:
            prune_saves(root, cfg.checkpoint.keep)
    dist.barrier()
    if rank == 0:
        assert steps_log is not None
        steps_log.close()
        lines = [json.loads(x) for x in (root / STEPS_FILE).read_text().splitlines() if x]
        wall = time.time() - float(started.read_text())
        productive = productive_seconds(lines)
        print(json.dumps({"event": "summary", "steps": cfg.train.steps, "final_loss": loss,
                          "wall_seconds": round(wall, 3),
                          "productive_seconds": round(productive, 3),
                          "goodput": round(productive / max(wall, 1e-9), 4),
                          "steps_run": len(lines),
                          "restarts": {"launcher": restart}}), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
