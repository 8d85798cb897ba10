"""Staging: a nested state with tensors -> (skeleton, layout) + ONE flat host byte buffer.

Why one flat buffer: each rank stages its state (its FSDP slices, optimizer and scheduler state,
RNG, data position, NVRx rank-monitor state) into one buffer, then hands it to NVRx's persistent
writer process. The step loop is blocked only for the device-to-host copy. One flat buffer (not
hundreds of tensors) crosses the process boundary, and because it is allocated in shared memory
once and reused, nothing is copied again on the way; on CUDA it is also page-locked
(`cudaHostRegister`) so the copy runs at DMA speed.

The skeleton and layout go into each shard's JSON header (rtj_trainer.checkpoint.format), never
through pickle.

The buffer also serves a resume: it is the process's (kept across in-process restarts), and
`HostStaging.staged` says which save it holds once a copy into it completed (None while one is
under way). After an in-process restart every rank still holds its last save there, committed or
not, so the ranks roll back from memory when all hold the same one
(`Checkpointer._load_staged`) instead of reading a copy from a disk, or falling back to an older
save whose copies were finished.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ..keeper import client as keeper
from . import hostmem

log = logging.getLogger(__name__)

_ALIGN = 64
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Placeholder for the index-th tensor of the flat buffer inside the saved skeleton."""

    index: int


@dataclass(frozen=True, slots=True)
class TensorLayout:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Staged:
    """Which save a staging buffer holds: its step and checkpoint identity, the rank and world
    size it is the shard of, and what it takes to rebuild the state from the buffer."""

    step: int
    identity: str
    rank: int
    world_size: int
    skeleton: Any
    layout: list[TensorLayout]
    live: bool = False
    """Staged at an in-process restart from the interrupted attempt's training state (not a
    checkpoint save): no copy of it exists anywhere else."""


def map_leaves(tree: Any, kind: type[T], fn: Callable[[T], Any]) -> Any:
    """`tree` (dicts, lists and tuples, nested) with every leaf of type `kind` replaced by
    `fn(leaf)`, in order (a dict's in its keys' order); everything else as it is."""
    if isinstance(tree, kind):
        return fn(tree)
    if isinstance(tree, dict):
        return {key: map_leaves(value, kind, fn) for key, value in tree.items()}
    if isinstance(tree, list):
        return [map_leaves(value, kind, fn) for value in tree]
    if isinstance(tree, tuple):
        return tuple(map_leaves(value, kind, fn) for value in tree)
    return tree


def flatten_state(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """`tree` with each tensor appended (detached) to `tensors` and replaced by its slot."""

    def slot(tensor: torch.Tensor) -> TensorSlot:
        tensors.append(tensor.detach())
        return TensorSlot(len(tensors) - 1)

    return map_leaves(tree, torch.Tensor, slot)


def unflatten_state(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """`flatten_state` undone: each slot replaced by its tensor of `tensors`."""
    return map_leaves(tree, TensorSlot, lambda slot: tensors[slot.index])


def plan_layout(tensors: list[torch.Tensor]) -> tuple[list[TensorLayout], int]:
    layout, offset = [], 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        layout.append(TensorLayout(offset, nbytes, tensor.dtype, tuple(tensor.shape)))
        offset += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return layout, max(offset, _ALIGN)


def tensor_views(blob: torch.Tensor, layout: list[TensorLayout]) -> list[torch.Tensor]:
    return [
        blob[item.offset : item.offset + item.nbytes].view(item.dtype).view(item.shape)
        for item in layout
    ]


@dataclass(frozen=True, slots=True)
class FlatState:
    """A nested state as one flat buffer holds it: the skeleton (`flatten_state`), its tensors
    in order, their places (`plan_layout`) and the buffer's size in bytes."""

    skeleton: Any
    tensors: list[torch.Tensor]
    layout: list[TensorLayout]
    total: int

    @classmethod
    def of(cls, state: Any) -> FlatState:
        tensors: list[torch.Tensor] = []
        skeleton = flatten_state(state, tensors)
        layout, total = plan_layout(tensors)
        return cls(skeleton, tensors, layout, total)

    def copy_into(self, buffer: torch.Tensor, views: list[torch.Tensor] | None = None) -> None:
        """Every tensor into its place in `buffer` (of `total` bytes) on the current stream, in
        a few multi-tensor launches, never one blocking copy per tensor. `views`:
        `tensor_views(buffer, layout)` made earlier (a caller that copies the same layout again
        keeps them: ~3-7 ms for 650 tensors on a CPU core).

        Grouped by device and dtype, because `_foreach_copy_` takes its fast multi-tensor path
        only when a whole list shares them: a training state mixes the parameters and moments on
        the device with host tensors (AdamW's `step` counters, the RNG states), and one mixed
        list is copied tensor by tensor. Into a device buffer, host tensors are first packed into
        one page-locked host block (`_host_block`) and copied from it without blocking: a
        blocking host-to-device copy waits for the stream, so each `step` counter waited for
        the device copies launched before it (~17 ms a snapshot of a 1B model on an H100)."""
        if not self.tensors:
            return
        targets = views if views is not None else tensor_views(buffer, self.layout)
        groups: dict[tuple[torch.device, torch.dtype], tuple[list[torch.Tensor],
                                                             list[torch.Tensor]]] = {}
        from_host: list[int] = []
        for index, tensor in enumerate(self.tensors):
            if buffer.device.type != "cpu" and tensor.device.type == "cpu":
                from_host.append(index)
                continue
            dst, src = groups.setdefault((tensor.device, tensor.dtype), ([], []))
            dst.append(targets[index])
            src.append(tensor)
        for dst, src in groups.values():
            torch._foreach_copy_(dst, src)
        if from_host:
            sources = [self.tensors[i] for i in from_host]
            block = _host_block(sources)
            torch._foreach_copy_(block, sources)  # host to page-locked host: no device wait
            for index, piece in zip(from_host, block, strict=True):
                targets[index].copy_(piece, non_blocking=True)


def _host_block(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Page-locked host tensors shaped as `tensors`, views of one block from torch's caching
    host allocator, which keeps it until the copies from it completed on the device."""
    layout, total = plan_layout(tensors)
    return tensor_views(torch.empty(total, dtype=torch.uint8, pin_memory=True), layout)


class HostStaging:
    """One reusable flat host buffer in shared memory (page-locked on CUDA)."""

    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None
        self._registered = False
        self.staged: Staged | None = None
        """The save the buffer holds in full (set by the checkpointer after a staging copy)."""
        self.seconds: dict[str, float] = {}
        """The newest allocation's parts: `share` (allocated and populated in shared memory),
        `register` (page-locked), `hold` (handed to the device keeper)."""

    def ensure(self, nbytes: int, device: torch.device) -> torch.Tensor:
        if self.buffer is None or self.buffer.numel() != nbytes:
            self.release()
            # Allocated and mapped where the GIL is free (rtj_trainer.checkpoint.hostmem): this
            # runs in a thread beside the first steps, and torch's `share_memory_()` stopped them
            # for the allocation (1.90-2.25 s for 11.29 GB on an H100 host, docs/benchmarks.md).
            began = time.perf_counter()
            self.buffer = hostmem.shared_buffer(nbytes)
            shared = time.perf_counter()
            if device.type == "cuda":
                # Page-lock the shared buffer in place: D2H copies then run at DMA speed and the
                # writer process still maps the very same memory.
                try:
                    result = torch.cuda.cudart().cudaHostRegister(  # type: ignore[no-untyped-call]
                        self.buffer.data_ptr(), nbytes, 0)
                    self._registered = int(result) == 0
                except Exception as exc:  # staging still works, only slower
                    result, self._registered = exc, False
                if not self._registered:
                    log.warning("cudaHostRegister failed (%s): staging copies are pageable", result)
            registered = time.perf_counter()
            keeper.hold_host(self.buffer)  # with a device keeper: it frees the pages, not a kill
            self.seconds = {"share": round(shared - began, 4),
                            "register": round(registered - shared, 4),
                            "hold": round(time.perf_counter() - registered, 4)}
        return self.buffer

    @classmethod
    def of(cls, carry: Any) -> HostStaging:
        """The process's one staging buffer, kept in its `CarryOver` (rtj_trainer.carry): an
        in-process restart finds the buffer (allocated and page-locked, seconds for GBs) of the
        attempt before it instead of allocating anew."""
        if carry.staging is None:
            carry.staging = cls()
        staging: HostStaging = carry.staging
        return staging

    def release(self) -> None:
        self.staged = None
        if self.buffer is not None and self._registered:
            torch.cuda.cudart().cudaHostUnregister(  # type: ignore[no-untyped-call]
                self.buffer.data_ptr())
        self.buffer, self._registered = None, False


def stage_to_host(
    state: dict[str, Any], device: torch.device, staging: HostStaging
) -> tuple[Any, list[TensorLayout], torch.Tensor]:
    """Copy every tensor of `state` into the staging buffer; returns (skeleton, layout, buffer).

    This is the whole stall of an async checkpoint: one device-to-host copy per tensor and, on
    CUDA, one synchronize.
    """
    flat = FlatState.of(state)
    buffer = staging.ensure(flat.total, device)
    staging.staged = None  # from here until the caller says otherwise it holds no whole save
    for view, tensor in zip(tensor_views(buffer, flat.layout), flat.tensors, strict=True):
        view.copy_(tensor, non_blocking=device.type == "cuda")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return flat.skeleton, flat.layout, buffer

