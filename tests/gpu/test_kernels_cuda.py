"""The Triton kernels (rtj_trainer.kernels) against Hugging Face's own arithmetic on a GPU.

`make test-gpu` on a machine with CUDA (the device machines); `make test` leaves the `gpu` tier
out. The CPU paths of the same functions are tested in tests/unit/test_trainer_hf.py.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


def hf_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' Llama `apply_rotary_pos_emb` for one tensor, unsqueeze_dim=1."""
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.unsqueeze(1) + turned * sin.unsqueeze(1)


@pytest.mark.parametrize(("heads", "dim", "dtype"), [
    (16, 128, torch.bfloat16), (16, 128, torch.float32), (12, 96, torch.bfloat16),
    (5, 64, torch.float32)])
def test_the_triton_kernel_gives_hf_values_and_gradients(heads: int, dim: int,
                                                         dtype: torch.dtype) -> None:
    from rtj_trainer import kernels

    assert torch.cuda.is_available()
    assert kernels._rotary_kernel() is not None, "Triton did not import"
    torch.manual_seed(0)
    batch, seq = 2, 256
    # (batch, heads, seq, dim) views of (batch, seq, heads, dim) projections, as HF makes them
    x = torch.randn(batch, seq, heads, dim, device="cuda", dtype=dtype).transpose(1, 2)
    x.requires_grad_()
    angles = torch.randn(batch, seq, dim // 2, device="cuda")
    cos = torch.cat((angles, angles), -1).cos().to(dtype)
    sin = torch.cat((angles, angles * 0.5), -1).sin().to(dtype)  # unequal halves too
    # upstream gradients in both layouts: contiguous (batch, heads, ...) and the projections'
    for weights in (torch.randn(batch, heads, seq, dim, device="cuda", dtype=dtype),
                    torch.randn(batch, seq, heads, dim, device="cuda", dtype=dtype)
                    .transpose(1, 2)):
        got = kernels.rotary(x.transpose(1, 2), cos.unsqueeze(2), sin.unsqueeze(2)).transpose(1, 2)
        (got_grad,) = torch.autograd.grad((got * weights).sum(), x)
        expected = hf_rotary(x.double(), cos.double(), sin.double())
        (expected_grad,) = torch.autograd.grad((expected * weights.double()).sum(), x)
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(got_grad.double(), expected_grad.double(), rtol=tolerance,
                                   atol=tolerance)
        assert got.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize(("shape", "dtype"), [((8, 512, 5440), torch.bfloat16),
                                              ((3, 7, 11), torch.float32)])
def test_the_triton_swiglu_gives_hf_values_and_gradients(shape: tuple[int, ...],
                                                         dtype: torch.dtype) -> None:
    from rtj_trainer import kernels

    assert kernels._swiglu_kernels() is not None, "Triton did not import"
    torch.manual_seed(0)
    gate = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    up = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    weights = torch.randn(shape, device="cuda", dtype=dtype)
    got = kernels.swiglu(gate, up)
    got_grads = torch.autograd.grad((got * weights).sum(), (gate, up))
    expected = torch.nn.functional.silu(gate.double()) * up.double()
    expected_grads = torch.autograd.grad((expected * weights.double()).sum(), (gate, up))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
    for a, b in zip(got_grads, expected_grads, strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), b.double(), rtol=tolerance, atol=tolerance)
