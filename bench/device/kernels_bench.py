"""The element-wise pieces of the `1b` Llama (batch 8, 2,048 positions, bf16), forward and
backward, on one GPU: the rotary embedding of one attention input (16 heads of 128) and the
SwiGLU gate of one MLP (5,440 wide), each as Hugging Face computes it, through
`rtj_trainer.kernels` without Triton, and with its Triton kernels. Prints the mean milliseconds
of each over 50 runs and what one training step spends there (rotary x32: q and k of 16 layers;
SwiGLU x16).

    python3 bench/device/kernels_bench.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from rtj_trainer import kernels


def hf_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + turned * sin.unsqueeze(1)


def ours(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return kernels.rotary(x.transpose(1, 2), cos.unsqueeze(2), sin.unsqueeze(2)).transpose(1, 2)


def timed(function: Callable[[], None], runs: int = 50) -> float:
    for _ in range(5):
        function()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(runs):
        function()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / runs


def main() -> int:
    batch, seq, heads, dim = 8, 2048, 16, 128
    projection = torch.randn(batch, seq, heads * dim, device="cuda", dtype=torch.bfloat16)
    x = projection.view(batch, seq, heads, dim).transpose(1, 2).detach().requires_grad_()
    angles = torch.randn(batch, seq, dim // 2, device="cuda")
    cos = torch.cat((angles, angles), -1).cos().to(torch.bfloat16)
    sin = torch.cat((angles, angles), -1).sin().to(torch.bfloat16)
    upstream = torch.randn(batch, seq, heads, dim, device="cuda",
                           dtype=torch.bfloat16).transpose(1, 2)
    kernel = kernels._rotary_kernel()
    variants: list[tuple[str, Callable[..., torch.Tensor], bool]] = [
        ("hf", hf_rotary, False), ("torch", ours, False), ("triton", ours, True)]
    reference = hf_rotary(x.double(), cos.double(), sin.double())
    for name, function, triton in variants:
        if triton and kernel is None:
            print(f"{name}: Triton did not import", flush=True)
            continue
        kernels._rotary_kernel = (lambda: kernel) if triton else (lambda: None)  # type: ignore[method-assign]
        error = (function(x, cos, sin).double() - reference).abs().max().item()
        def forward_only(f: Callable[..., torch.Tensor] = function) -> None:
            with torch.no_grad():
                f(x, cos, sin)

        def forward_backward(f: Callable[..., torch.Tensor] = function) -> None:
            f(x, cos, sin).backward(upstream)

        forward, both = timed(forward_only), timed(forward_backward)
        print(f"rope {name}: forward {forward:.3f} ms, forward+backward {both:.3f} ms, "
              f"x32 (q and k, 16 layers) {both * 32:.1f} ms; max |error| {error:.2e}",
              flush=True)
    kernels._rotary_kernel = lambda: kernel  # type: ignore[method-assign]
    swiglu_kernels = kernels._swiglu_kernels()
    gate = torch.randn(batch, seq, 5440, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    up = torch.randn(batch, seq, 5440, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(batch, seq, 5440, device="cuda", dtype=torch.bfloat16)
    swiglus: list[tuple[str, Callable[..., torch.Tensor], bool]] = [
        ("hf", lambda g, u: torch.nn.functional.silu(g) * u, False),
        ("torch", kernels.swiglu, False), ("triton", kernels.swiglu, True)]
    for name, function, triton in swiglus:
        kernels._swiglu_kernels = (  # type: ignore[method-assign]
            (lambda: swiglu_kernels) if triton else (lambda: None))

        def gate_forward(f: Callable[..., torch.Tensor] = function) -> None:
            with torch.no_grad():
                f(gate, up)

        def gate_both(f: Callable[..., torch.Tensor] = function) -> None:
            f(gate, up).backward(grad)

        forward, both = timed(gate_forward), timed(gate_both)
        print(f"swiglu {name}: forward {forward:.3f} ms, forward+backward {both:.3f} ms, "
              f"x16 (16 layers) {both * 16:.1f} ms", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
