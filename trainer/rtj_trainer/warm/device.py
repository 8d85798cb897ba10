"""A warm worker's device warm-up (on unless `RTJ_WARM_DEVICE=0`): before any worker attaches, the
warm worker meant for local rank N creates its CUDA context on device N and runs the first-use work
of the libraries a training step touches, so that a worker started after a fault (a SIGKILL, a
hang, a launcher restart) does not pay it between its start and its first step:

- the CUDA context (`torch.cuda.set_device`, a first tensor);
- cuBLAS and cuBLASLt: a small linear layer forward and backward in bf16 and fp32 (their handles
  and workspaces, the kernels' modules, which CUDA loads lazily at first launch);
- Triton: rtj_trainer.kernels' rotary and SwiGLU forward and backward at a small shape (Triton's
  driver and launcher, the kernels' binaries from Triton's disk cache; a different shape may
  still compile or load its own specialization at the first step).

What it cannot do ahead: the NCCL communicator (it needs the process group, made after the
rendezvous) and the caching allocator's segments of the real step. Everything it allocated is
given back (`empty_cache`) before it waits, so an idle warm worker holds its context and cuBLAS's
workspace only; ft_launcher's check that a dead worker's GPU memory was freed allows for it
(rtj_trainer.keeper.held_mb via the launcher shim).

A device that is not there (no CUDA, or fewer devices than `local_rank + 1`) is reported and
nothing is done: the worker then does everything itself, as without the warm-up.
"""

from __future__ import annotations

import time
from typing import Any

SWITCH_ENV = "RTJ_WARM_DEVICE"
"""`1` or unset: a warm worker meant for a local rank warms that rank's device when there is
one (a CPU machine: nothing happens); `0`: warm workers touch no device before attach."""


def switched_on(env: Any) -> bool:
    value = str(env.get(SWITCH_ENV, "1")).strip()
    if value not in ("0", "1"):
        raise SystemExit(f"warm worker: {SWITCH_ENV}={value!r}: expected 1 or 0")
    return value == "1"


def warm_up(local_rank: int) -> dict[str, Any]:
    """Warm device `local_rank` in this process; returns the seconds each piece took (or why
    nothing was done: {"skipped": reason})."""
    import torch

    if not torch.cuda.is_available():
        return {"skipped": "no CUDA device"}
    if local_rank >= torch.cuda.device_count():
        return {"skipped": f"local rank {local_rank} but {torch.cuda.device_count()} devices"}
    report: dict[str, Any] = {"device": local_rank}

    def timed(name: str, fn: Any) -> None:
        began = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        report[name] = round(time.perf_counter() - began, 4)

    device = torch.device("cuda", local_rank)
    def context() -> None:
        torch.cuda.set_device(device)
        torch.empty(1, device=device)

    timed("context", context)
    for dtype in (torch.bfloat16, torch.float32):
        timed(f"matmul_{str(dtype).removeprefix('torch.')}", lambda d=dtype: _linear(device, d))
    try:
        timed("triton", lambda: _kernels(device))
    except Exception as exc:  # no Triton, a compiler missing: the worker finds out itself
        report["triton"] = f"failed: {exc!r}"
    torch.cuda.empty_cache()
    return report


def _linear(device: Any, dtype: Any) -> None:
    import torch

    layer = torch.nn.Linear(256, 512, device=device, dtype=dtype)
    x = torch.randn(64, 256, device=device, dtype=dtype, requires_grad=True)
    layer(x).float().sum().backward()


def _kernels(device: Any) -> None:
    import torch

    from .. import kernels

    x = torch.randn(1, 64, 2, 64, device=device, dtype=torch.bfloat16, requires_grad=True)
    cos = torch.randn(1, 64, 1, 64, device=device, dtype=torch.bfloat16)
    sin = torch.randn(1, 64, 1, 64, device=device, dtype=torch.bfloat16)
    kernels.rotary(x, cos, sin).float().sum().backward()  # type: ignore[no-untyped-call]
    gate = torch.randn(64, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(64, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    kernels.swiglu(gate, up).float().sum().backward()  # type: ignore[no-untyped-call]
