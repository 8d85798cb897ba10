"""Distributed setup, FSDP2 sharding, the optimizer and the per-rank checkpoint state.

The same code runs on CPU/gloo and CUDA/NCCL at any world size; the device decides the backend and
the precision policy. Every transformer block is a `fully_shard` unit and so is the root (which
holds the embeddings and head). Parameters stay fp32 and sharded; on CUDA the compute runs in bf16
with fp32 gradient reduction.

Checkpoints are per-rank shards (rtj_trainer.checkpoint): `local_state()` turns the FSDP/optimizer
state into plain local tensors (each rank's slice of every DTensor), and `load_local_state()`
writes such a slice back. Slices are only meaningful at the same world size, which the checkpoint
manifest records and checks (the operator never changes WORLD_SIZE within a job).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

# FSDP imports torch._dynamo lazily, at the first `fully_shard` or forward. Import it here, before
# the in-process wrapper runs anything: the wrapper's asynchronous abort can land in the middle
# of an import and leave a partially initialised module behind, and every later iteration of
# that process then fails on it ("partially initialized module 'torch._dynamo' has no attribute
# 'utils'", then "Artifact of type=precompile already registered"). Seen on a warm spare whose
# first activation was interrupted on a loaded machine; the import costs the same time here.
import torch._dynamo
import torch.distributed as dist
from torch._C._distributed_c10d import Store
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from . import gloocut, hfmodel
from .checkpoint import reshard
from .checkpoint.format import CheckpointError
from .checkpoint.reshard import SHARDING
from .config import Config
from .launchenv import LaunchEnvironment
from .model import GPT

MODEL = "model"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
"""Keys of `local_state()` in the checkpoint state (rtj_trainer.trainer adds the others; the
fourth, `SHARDING`, maps the sliced entries to their whole shapes)."""


@dataclass(frozen=True, slots=True)
class DistributedContext:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    mesh: DeviceMesh

    @property
    def backend(self) -> str:
        return "nccl" if self.device.type == "cuda" else "gloo"


def pick_device(cfg: Config, launch: LaunchEnvironment) -> torch.device:
    wants_cuda = cfg.train.device == "cuda" or (
        cfg.train.device == "auto" and torch.cuda.is_available()
    )
    if wants_cuda:
        torch.cuda.set_device(launch.local_rank)
        return torch.device("cuda", launch.local_rank)
    return torch.device("cpu")


def collective_timeout(cfg: Config, device: torch.device) -> timedelta:
    res = cfg.resiliency
    if res.collective_timeout_seconds is not None:
        seconds = res.collective_timeout_seconds
    elif res.inprocess_restart and device.type == "cpu":
        seconds = 5.0  # gloo cannot be aborted: a peer stuck in a collective waits this long
    else:
        seconds = 2 * res.heartbeat_timeout_seconds
    return timedelta(seconds=seconds)


def init_distributed(
    cfg: Config, launch: LaunchEnvironment, store: Store | None = None,
    gloo: gloocut.GlooConnections | None = None,
) -> DistributedContext:
    """`init_process_group` (env:// unless a store is given) and a 1-D mesh over all ranks.
    With a store on gloo, the group's connections are recorded in `gloo` (a restart cuts
    them)."""
    device = pick_device(cfg, launch)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"timeout": collective_timeout(cfg, device)}
    if store is not None:
        wait_for_peers(store, launch.world_size)
        kwargs.update(store=store, rank=launch.rank, world_size=launch.world_size)
    if device.type == "cuda":
        kwargs["device_id"] = device
    # In the in-process wrapper (a store is given) on gloo, remember the group's connections so
    # that a restart can cut them (rtj_trainer.gloocut: gloo has no abort).
    cuttable = store is not None and backend == "gloo" and gloo is not None
    before = gloocut.snapshot() if cuttable else frozenset()
    dist.init_process_group(backend, **kwargs)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    if cuttable:
        assert gloo is not None
        gloo.record(before, exclude_ports=frozenset(
            {launch.master_port, launch.wrapper_store_port}))
    return DistributedContext(
        rank=dist.get_rank(),
        local_rank=launch.local_rank,
        world_size=dist.get_world_size(),
        device=device,
        mesh=mesh,
    )


PEERS_KEY = "rtj-ranks-arrived"
PEER_ARRIVAL_TIMEOUT = timedelta(seconds=120)
"""How long a rank waits for the others of its restart iteration before giving up (the in-process
wrapper's store timeout); a rank that died meanwhile is the wrapper's to notice first."""


def wait_for_peers(store: Store, world_size: int,
                   timeout: timedelta = PEER_ARRIVAL_TIMEOUT) -> None:
    """Wait in Python, not inside `init_process_group`, until every rank of this restart
    iteration has come (a counter in `store`, which is fresh for every iteration).

    In the in-process wrapper a rank that waits for a slower peer inside gloo's or NCCL's
    set-up blocks in C++: the wrapper's progress watchdog gets no timestamp from it, and after
    the soft timeout it restarts a rank that is only waiting. gloo's own set-up also gives up
    after the collective timeout (5 s on CPU with in-process restart): a peer later than that
    failed the ranks that came first (tests/e2e/test_trainer_barrier.py).
    This loop runs Python between short sleeps, so the watchdog's timestamps keep coming (no
    manual ping, and no heartbeat to the rank monitor, whose initial timeout still covers the
    start), and the process group is only set up once everyone is there."""
    arrived = store.add(PEERS_KEY, 1)

    def everyone() -> bool:
        nonlocal arrived
        arrived = store.add(PEERS_KEY, 0)
        return arrived >= world_size

    if arrived < world_size and not poll(everyone, seconds=timeout.total_seconds(),
                                         max_pause=0.2):
        raise RuntimeError(f"{arrived} of {world_size} ranks reached the process group "
                           f"within {timeout.total_seconds():g} s")


def poll(done: Callable[[], bool], *, seconds: float, max_pause: float,
         keepalive: Callable[[], object] | None = None, every_seconds: float = 0.5) -> bool:
    """Ask `done` between sleeps that grow from 1 ms to `max_pause` until it says yes or
    `seconds` have passed, and call `keepalive` every `every_seconds` meanwhile; whether `done`
    said yes. Python runs between the sleeps, so the in-process wrapper's progress watchdog
    keeps seeing this rank (a wait in C++ would look like a hang)."""
    deadline = time.monotonic() + seconds
    last = 0.0
    pause = 0.001
    while not done():
        now = time.monotonic()
        if now >= deadline:
            return False
        if keepalive is not None and now - last >= every_seconds:
            keepalive()
            last = now
        time.sleep(pause)
        pause = min(max_pause, pause * 2)
    return True


def build_model(cfg: Config, ctx: DistributedContext, *,
                initialise: bool = True) -> torch.nn.Module:
    """The sharded model on this rank's device: the GPT, or the Hugging Face causal LM of
    `model.hf_path` (rtj_trainer.hfmodel).

    `initialise`: build the whole model on the device with seeded weights (identical on every
    rank), then shard; a Hugging Face directory with weights loads them instead. Without it (a
    checkpoint is about to overwrite every parameter) the model is built on the meta device,
    sharded there, and only this rank's shards are allocated, with no initialisation kernels: a
    restart neither builds nor initialises the full model.
    """
    hf_path = cfg.model.hf_path
    pretrained = hf_path is not None and hfmodel.has_weights(hf_path)
    on_meta = not initialise or pretrained
    model: torch.nn.Module
    if hf_path is not None:
        model = hfmodel.build(hf_path, device="meta" if on_meta else ctx.device,
                              seed=None if on_meta else cfg.train.seed)
        blocks: torch.nn.ModuleList = hfmodel.decoder_layers(model)
    elif on_meta:
        with torch.device("meta"):
            model = GPT(cfg.model)
        blocks = model.blocks
    else:
        with torch.device(ctx.device):
            gpt = GPT(cfg.model)
        gpt.init_weights(torch.Generator(device=ctx.device).manual_seed(cfg.train.seed))
        model, blocks = gpt, gpt.blocks
    use_bf16 = cfg.train.mixed_precision == "bf16" or (
        cfg.train.mixed_precision == "auto" and ctx.device.type == "cuda"
    )
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if use_bf16
        else MixedPrecisionPolicy()
    )
    for block in blocks:
        fully_shard(block, mesh=ctx.mesh, mp_policy=policy)
    fully_shard(model, mesh=ctx.mesh, mp_policy=policy)
    if on_meta:
        model.to_empty(device=ctx.device)
        if hf_path is not None:
            hfmodel.restore_buffers(model, ctx.device)
    if initialise and pretrained:
        assert hf_path is not None
        hfmodel.load_weights(model, hf_path)
    return model


def forward_logits(model: torch.nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    """The logits of a forward pass, whichever model (a Hugging Face model returns an output
    object)."""
    output = model(inputs)
    return output if isinstance(output, torch.Tensor) else output.logits  # type: ignore[no-any-return]


def build_optimizer(
    cfg: Config, model: torch.nn.Module
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (no decay on norms) with linear warmup and cosine decay to min_lr_ratio."""
    o = cfg.optim
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": o.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
        foreach=True,
    )
    total = cfg.train.steps

    def factor(step: int) -> float:
        if o.warmup_steps and step < o.warmup_steps:
            return (step + 1) / o.warmup_steps
        progress = min(1.0, (step - o.warmup_steps) / max(1, total - o.warmup_steps))
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def wait_for_device(device: torch.device) -> None:
    """Wait until the work queued so far on `device`'s current stream is done, without holding
    the GIL (`Event.synchronize` releases it), so other Python threads run meanwhile."""
    if device.type == "cuda":
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        event.synchronize()


def barrier(keepalive: Callable[[], object], *, timeout: timedelta,
            every_seconds: float = 0.5) -> None:
    """`dist.barrier()` that calls `keepalive` (the heartbeat) every `every_seconds` while it
    waits for the other ranks: a rank that reached the barrier is alive, however long a peer
    takes to get there (a slow last commit, a loaded host), and its watchdogs must not take the
    wait for a hang. A peer that never comes is the collective timeout's to end: past
    `timeout` this waits on the barrier's own result, which raises where the backend timed out."""
    work = dist.barrier(async_op=True)
    assert work is not None
    poll(work.is_completed, seconds=timeout.total_seconds(), max_pause=0.05,
         keepalive=keepalive, every_seconds=every_seconds)
    work.wait()


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    tokens: torch.Tensor,
    grad_clip: float,
    *,
    interruptible: bool = False,
    before_update: Callable[[], None] | None = None,
    update_guard: Callable[[], AbstractContextManager[None]] | None = None,
) -> torch.Tensor:
    """One optimizer step on this rank's batch; returns the loss averaged over all ranks.

    `before_update` is called right before the optimizer starts changing the parameters: up to
    then the model and optimizer still hold the state after the previous step (what an
    in-process restart may resume from, rtj_trainer.trainer `Trainer.offer_live_state`).
    `update_guard` (the in-process wrapper's atomic section) holds `before_update` and the
    update: NVRx's restart takes the same lock when it begins, and only raises its exception
    into this thread once its progress watchdog has synchronized with it. A rank blocked in a C
    call past the soft timeout therefore ran on into the next step's update before that
    exception landed, and its state after the last step was lost (4 of 14 runs of the
    blocked-rank test on a fast host); now it meets the held lock at the update and the
    exception lands there, before anything changed. A restart that begins during an update
    waits for it (the update has no collective, so it ends).

    `interruptible` (in-process restart on CUDA): wait for the GPU, with the GIL released, after
    the forward and after the backward pass. A rank whose peer failed is stuck behind a
    collective that never completes. Seen on two H200s: such a rank's main thread ran ahead into
    the optimizer step (its stack was in `_multi_tensor_adam`) and the in-process wrapper's
    monitor thread never ran its abort until the rank monitor killed the process. The likely
    reason is a host blocked inside an op that holds the GIL (a full CUDA launch queue); these
    waits keep the host from running ahead of a stuck collective and release the GIL.
    """
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    logits = forward_logits(model, inputs)
    loss = torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1)
    )
    if interruptible:
        wait_for_device(loss.device)
    loss.backward()  # type: ignore[no-untyped-call]
    if interruptible:
        wait_for_device(loss.device)
    if grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    with update_guard() if update_guard is not None else nullcontext():
        if before_update is not None:
            before_update()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    mean = loss.detach().clone()
    dist.all_reduce(mean, op=dist.ReduceOp.SUM)
    return mean / dist.get_world_size()


def to_local(value: Any) -> Any:
    """`value` with every DTensor replaced by this rank's local slice."""
    if isinstance(value, DTensor):
        return value.to_local()
    if isinstance(value, dict):
        return {k: to_local(v) for k, v in value.items()}
    if isinstance(value, list):
        return [to_local(v) for v in value]
    return value


def into_template(template: Any, saved: Any, where: str) -> Any:
    """Copy saved local slices into the DTensors of a freshly obtained state-dict template."""
    if isinstance(template, DTensor):
        local = template.to_local()
        if not isinstance(saved, torch.Tensor) or saved.shape != local.shape:
            got = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
            raise CheckpointError(
                f"checkpoint shard mismatch at {where}: {got} vs {tuple(local.shape)}")
        local.copy_(saved)
        return template
    if isinstance(template, dict):
        missing = set(template) - set(saved)
        if missing:
            raise ValueError(f"checkpoint lacks {where}.{sorted(missing)[:3]}")
        return {k: into_template(v, saved[k], f"{where}.{k}") for k, v in template.items()}
    if isinstance(template, list):
        pairs = enumerate(zip(template, saved, strict=True))
        return [into_template(t, s, f"{where}[{i}]") for i, (t, s) in pairs]
    if isinstance(template, torch.Tensor) and isinstance(saved, torch.Tensor):
        # Always a copy: a saved tensor may be a view of the staging buffer (a resume from
        # memory), which the optimizer would otherwise update in place (Adam's `step`).
        return saved.to(device=template.device, dtype=template.dtype, copy=True)
    return saved


def local_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    """This rank's slice of model, optimizer and scheduler state (tensors still on the device)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {
        MODEL: to_local(model_sd),
        OPTIMIZER: to_local(optim_sd),
        SCHEDULER: scheduler.state_dict(),
        SHARDING: {**sharding(model_sd, MODEL), **sharding(optim_sd, OPTIMIZER)},
    }


def sharding(tree: Any, under: str) -> dict[str, list[int]]:
    """The entries of `tree` (stored under the key `under`) that are this rank's dim-0 slices of
    a sharded tensor, with the whole tensor's shape: what lets a checkpoint be read at another
    world size, or put back together (rtj_trainer.checkpoint.reshard)."""
    return {path: list(leaf.shape) for path, leaf in reshard.paths(tree, (under,))
            if isinstance(leaf, DTensor) and len(leaf.placements) == 1
            and isinstance(leaf.placements[0], Shard) and leaf.placements[0].dim == 0}


def live_views(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
) -> dict[str, Any] | None:
    """The model and optimizer parts (and the sharding) of a `local_state()` result, if every
    tensor in them shares its memory with a parameter, buffer or optimizer-state tensor of this
    rank and every other value in them is either the optimizer's hyperparameters
    (`param_groups`, which `live_state` reads afresh) or none at all; None otherwise (a copy
    would show a stale state). Kept by an attempt so that an in-process restart can stage the
    state it was interrupted in, with no collective and no process group
    (rtj_trainer.trainer `Trainer.offer_live_state`)."""
    live: set[int] = set()
    for tensor in [*model.parameters(), *model.buffers()]:
        live.add(_local_storage(tensor))
    for per_param in optimizer.state.values():
        for value in per_param.values():
            if isinstance(value, torch.Tensor):
                live.add(_local_storage(value))
    optim = state[OPTIMIZER]
    if (not isinstance(optim, dict) or set(optim) != {"state", "param_groups"}
            or len(optim["param_groups"]) != len(optimizer.param_groups)):
        return None
    in_place = {MODEL: state[MODEL], "state": optim["state"]}
    tensors: list[torch.Tensor] = []
    if not _collect_tensors(in_place, tensors) or not tensors:
        return None  # a number or a string among them would not follow the training
    if any(_local_storage(t) not in live for t in tensors):
        return None
    # The sharding of a state dict is fixed for the model and optimizer: kept with the views
    views = {MODEL: state[MODEL], OPTIMIZER: optim}
    return views if SHARDING not in state else {**views, SHARDING: state[SHARDING]}


def live_state(
    views: dict[str, Any],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> dict[str, Any]:
    """A `local_state()` result as the training state is now, from `live_views`: the tensors read
    in place, the optimizer's hyperparameters (the learning rate the scheduler set last) and the
    scheduler's state read afresh."""
    optim = views[OPTIMIZER]
    groups = [{**saved, **{k: v for k, v in group.items() if k != "params"}}
              for saved, group in zip(optim["param_groups"], optimizer.param_groups, strict=True)]
    live = {MODEL: views[MODEL], OPTIMIZER: {"state": optim["state"], "param_groups": groups},
            SCHEDULER: scheduler.state_dict()}
    return live if SHARDING not in views else {**live, SHARDING: views[SHARDING]}


def _local_storage(tensor: torch.Tensor) -> int:
    local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
    return int(local.untyped_storage().data_ptr())


def _collect_tensors(tree: Any, into: list[torch.Tensor]) -> bool:
    """Append every tensor of `tree` to `into`; False if it holds any other leaf."""
    if isinstance(tree, torch.Tensor):
        into.append(tree)
        return True
    if isinstance(tree, dict):
        return all([_collect_tensors(value, into) for value in tree.values()])
    if isinstance(tree, (list, tuple)):
        return all([_collect_tensors(value, into) for value in tree])
    return False


def load_local_state(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    saved: dict[str, Any],
) -> None:
    model_template, optim_template = get_state_dict(model, optimizer)
    set_state_dict(
        model,
        optimizer,
        model_state_dict=into_template(model_template, saved[MODEL], MODEL),
        optim_state_dict=into_template(optim_template, saved[OPTIMIZER], OPTIMIZER),
    )
    scheduler.load_state_dict(saved[SCHEDULER])


def rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["cpu"].clone())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].clone(), device)
