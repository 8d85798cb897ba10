"""The warm workers' device warm-up on a real GPU (rtj_trainer.warm.device): it creates the
context on the rank's device, runs cuBLAS and the Triton kernels, and keeps no more device memory
than cuBLAS's workspaces (on an H100: 65 MiB allocated after it, measured 2026-12-07), which the
worker, once it is a trainer, reuses."""

from __future__ import annotations

import pytest
import torch
from rtj_trainer.warm import device

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_warm_up_uses_the_ranks_device_and_keeps_only_the_library_workspaces() -> None:
    report = device.warm_up(0)
    assert report["device"] == 0
    for piece in ("context", "matmul_bfloat16", "matmul_float32", "triton"):
        assert isinstance(report[piece], float), (piece, report)
    assert torch.cuda.current_device() == 0
    # the test tensors are given back; what stays is cuBLAS's and cuBLASLt's workspaces
    assert torch.cuda.memory_allocated(0) <= 128 * 2**20, torch.cuda.memory_allocated(0)
    assert torch.cuda.memory_reserved(0) <= 256 * 2**20, torch.cuda.memory_reserved(0)
    beyond = torch.cuda.device_count()
    assert "skipped" in device.warm_up(beyond)
