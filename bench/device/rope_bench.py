"""The rotary embedding of one attention input of the `1b` Llama's shape (batch 8, 2,048
positions, 16 heads of 128, bf16), forward and backward, on one GPU: Hugging Face's own function
on the (batch, heads, seq, dim) view, `rtj_trainer.rope` without Triton (a multiply and an
`addcmul_` a half) and with its Triton kernel. Prints the mean milliseconds of each over 50 runs
and that times 32 (q and k of 16 layers: what one training step spends there).

    python3 bench/device/rope_bench.py
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch
from rtj_trainer import rope


def hf_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + turned * sin.unsqueeze(1)


def ours(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return rope.rotary(x.transpose(1, 2), cos.unsqueeze(2), sin.unsqueeze(2)).transpose(1, 2)


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
    kernel = rope._triton_kernel()
    variants: list[tuple[str, Callable[..., torch.Tensor], bool]] = [
        ("hf", hf_rotary, False), ("torch", ours, False), ("triton", ours, True)]
    reference = hf_rotary(x.double(), cos.double(), sin.double())
    for name, function, triton in variants:
        if triton and kernel is None:
            print(f"{name}: Triton did not import", flush=True)
            continue
        rope._triton_kernel = (lambda: kernel) if triton else (lambda: None)  # type: ignore[method-assign]
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
