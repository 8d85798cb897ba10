"""Two element-wise pieces of the Llama family in fewer passes than HF's: rotary position
embeddings (`rotary`) and the SwiGLU gate (`swiglu`). Each is one Triton kernel forward and one
backward on CUDA (the image's torch ships Triton; RTJ_TRITON=0 turns them off), and plain torch
elsewhere (CPU tests, no Triton).

Rotary: HF's `apply_rotary_pos_emb` computes `q * cos + rotate_half(q) * sin` (and the same for
k) on (batch, heads, seq, dim) views of the projections: a negation, a `torch.cat`, two
multiplies and an add, each its own pass over q or k forward and again backward, all in
PyTorch's generic strided element-wise kernels (cos and sin broadcast over the heads). On an
H200 that was about 30 ms of the 1B Llama's 243 ms step (docs/benchmarks.md). `rotary` computes
the same values:

- on CUDA with Triton: one kernel reads x, cos and sin once and
  writes the output once, forward and backward, in fp32 inside, rounded once;
- elsewhere (CPU, or no Triton): a multiply and an `addcmul_` a half, into one output.

cos and sin are constants to it (rotary tables have no parameters): a caller whose cos or sin
needs a gradient keeps HF's function (`hfmodel.contiguous_rope` checks).

SwiGLU: HF's MLP computes `act_fn(gate_proj(x)) * up_proj(x)`: SiLU, then the product, and
autograd keeps the gate, its SiLU and the up projection for backward, where it makes three more
passes. `swiglu` reads gate and up once and writes the product once; backward reads the
gradient, gate and up once and writes both gradients (SiLU recomputed, not kept).
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` for `x` of shape (batch, seq, heads, dim) and `cos`,
    `sin` of shape (batch, seq, 1, dim), differentiable in `x` only."""
    return _Rotary.apply(x, cos, sin)  # type: ignore[no-any-return]


class _Rotary(torch.autograd.Function):
    # out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2  =>  dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _apply_rotary(x, cos, sin, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        cos, sin = ctx.saved_tensors
        return _apply_rotary(grad, cos, sin, backward=True), None, None


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                  backward: bool) -> torch.Tensor:
    out = torch.empty_like(x)
    kernel = _rotary_kernel() if x.is_cuda else None
    if kernel is not None and all(t.stride(-1) == 1 for t in (x, out, cos, sin)):
        _launch_rotary(kernel, x, cos, sin, out, backward)
        return out
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c1, c2, s1, s2 = cos[..., :half], cos[..., half:], sin[..., :half], sin[..., half:]
    if backward:
        torch.mul(x1, c1, out=out[..., :half]).addcmul_(x2, s2)
        torch.mul(x2, c2, out=out[..., half:]).addcmul_(x1, s1, value=-1.0)
    else:
        torch.mul(x1, c1, out=out[..., :half]).addcmul_(x2, s1, value=-1.0)
        torch.mul(x2, c2, out=out[..., half:]).addcmul_(x1, s2)
    return out


def _launch_rotary(kernel: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            out: torch.Tensor, backward: bool) -> None:
    import triton

    batch, seq, heads, dim = x.shape
    cos = cos.expand(batch, seq, 1, dim)
    sin = sin.expand(batch, seq, 1, dim)
    with torch.cuda.device(x.device):  # Triton launches on the current device
        kernel[(batch * seq,)](
            x, cos, sin, out, seq, heads,
            x.stride(0), x.stride(1), x.stride(2),
            out.stride(0), out.stride(1), out.stride(2),
            cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
            HALF=dim // 2, HEADS_P2=triton.next_power_of_2(heads),
            HALF_P2=triton.next_power_of_2(dim // 2), BACKWARD=backward)


@functools.cache
def _triton_usable() -> bool:
    """Triton imports and RTJ_TRITON is not 0."""
    if os.environ.get("RTJ_TRITON", "1") == "0":
        return False
    try:
        import triton.language  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _rotary_kernel() -> Any:
    """The Triton kernel, or None where Triton cannot be imported or RTJ_TRITON=0 (it is
    compiled at its first launch for each set of constants, then cached by Triton on disk)."""
    if not _triton_usable():
        return None
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, seq, heads,  # type: ignore[no-untyped-def]
                      xb, xs, xh, ob, os_, oh, cb, cs, sb, ss,
                      HALF: tl.constexpr, HEADS_P2: tl.constexpr, HALF_P2: tl.constexpr,
                      BACKWARD: tl.constexpr):
        row = tl.program_id(0)
        b = row // seq
        s = row % seq
        h = tl.arange(0, HEADS_P2)[:, None]
        j = tl.arange(0, HALF_P2)[None, :]
        mask = (h < heads) & (j < HALF)
        cmask = j < HALF
        xp = x_ptr + b * xb + s * xs + h * xh + j
        x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(xp + HALF, mask=mask, other=0.0).to(tl.float32)
        cp = cos_ptr + b * cb + s * cs + j
        sp = sin_ptr + b * sb + s * ss + j
        c1 = tl.load(cp, mask=cmask, other=0.0).to(tl.float32)
        c2 = tl.load(cp + HALF, mask=cmask, other=0.0).to(tl.float32)
        s1 = tl.load(sp, mask=cmask, other=0.0).to(tl.float32)
        s2 = tl.load(sp + HALF, mask=cmask, other=0.0).to(tl.float32)
        if BACKWARD:
            o1 = x1 * c1 + x2 * s2
            o2 = x2 * c2 - x1 * s1
        else:
            o1 = x1 * c1 - x2 * s1
            o2 = x2 * c2 + x1 * s2
        op = out_ptr + b * ob + s * os_ + h * oh + j
        tl.store(op, o1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(op + HALF, o2.to(out_ptr.dtype.element_ty), mask=mask)

    return rotary_kernel


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`silu(gate) * up`, differentiable in both."""
    return _SwiGLU.apply(gate, up)  # type: ignore[no-any-return]


class _SwiGLU(torch.autograd.Function):
    # out = g s(g) u, s the sigmoid  =>  du = go g s(g), dg = go u s(g) (1 + g (1 - s(g)))

    @staticmethod
    def forward(ctx: Any, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        kernel = _swiglu_kernels() if gate.is_cuda else None
        if kernel is not None and _flat(gate, up):
            out = torch.empty_like(gate)
            _launch_swiglu(kernel[0], (gate, up, out))
            return out
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        gate, up = ctx.saved_tensors
        kernel = _swiglu_kernels() if grad.is_cuda else None
        if kernel is not None and _flat(gate, up, grad):
            grad_gate, grad_up = torch.empty_like(gate), torch.empty_like(up)
            _launch_swiglu(kernel[1], (grad, gate, up, grad_gate, grad_up))
            return grad_gate, grad_up
        with torch.no_grad():  # autograd's own SiLU backward, the SiLU recomputed
            grad_up = grad * torch.nn.functional.silu(gate)
            grad_gate = torch.ops.aten.silu_backward(grad * up, gate)
        return grad_gate, grad_up


def _flat(*tensors: torch.Tensor) -> bool:
    """All contiguous, of one shape and dtype: the kernels index them as one flat array."""
    first = tensors[0]
    return all(t.is_contiguous() and t.shape == first.shape and t.dtype == first.dtype
               for t in tensors)


SWIGLU_BLOCK = 4096


def _launch_swiglu(kernel: Any, tensors: tuple[torch.Tensor, ...]) -> None:
    import triton

    count = tensors[0].numel()
    with torch.cuda.device(tensors[0].device):
        kernel[(triton.cdiv(count, SWIGLU_BLOCK),)](*tensors, count, BLOCK=SWIGLU_BLOCK)


@functools.cache
def _swiglu_kernels() -> Any:
    """(forward, backward) Triton kernels, or None as `_rotary_kernel`."""
    if not _triton_usable():
        return None
    import triton
    import triton.language as tl

    @triton.jit  # type: ignore[untyped-decorator]
    def swiglu_forward(gate_ptr, up_ptr, out_ptr, count,  # type: ignore[no-untyped-def]
                       BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < count
        g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        out = g * tl.sigmoid(g) * u
        tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit  # type: ignore[untyped-decorator]
    def swiglu_backward(grad_ptr, gate_ptr, up_ptr, grad_gate_ptr,  # type: ignore[no-untyped-def]
                        grad_up_ptr, count, BLOCK: tl.constexpr):
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < count
        go = tl.load(grad_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        g = tl.load(gate_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        s = tl.sigmoid(g)
        tl.store(grad_up_ptr + offsets, (go * g * s).to(grad_up_ptr.dtype.element_ty), mask=mask)
        grad_gate = go * u * s * (1.0 + g * (1.0 - s))
        tl.store(grad_gate_ptr + offsets, grad_gate.to(grad_gate_ptr.dtype.element_ty), mask=mask)

    return swiglu_forward, swiglu_backward
