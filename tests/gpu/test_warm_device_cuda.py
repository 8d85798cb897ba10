"""The warm workers' device warm-up on a real GPU (rtj_trainer.warm.device): it creates the
context on the rank's device, runs cuBLAS and the Triton kernels, and leaves nothing allocated."""

from __future__ import annotations

import pytest
import torch
from rtj_trainer.warm import device

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_the_warm_up_uses_the_ranks_device_and_leaves_nothing_allocated() -> None:
    report = device.warm_up(0)
    assert report["device"] == 0
    for piece in ("context", "matmul_bfloat16", "matmul_float32", "triton"):
        assert isinstance(report[piece], float), (piece, report)
    assert torch.cuda.current_device() == 0
    assert torch.cuda.memory_allocated(0) == 0
    beyond = torch.cuda.device_count()
    assert "skipped" in device.warm_up(beyond)
