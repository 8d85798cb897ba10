"""Token batches: a pure function of (seed, step, rank), synthetic or from a token file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from rtj_trainer.config import DataConfig
from rtj_trainer.data import TokenBatches

pytestmark = pytest.mark.unit


def test_batches_are_a_pure_function_of_step_and_rank() -> None:
    data = TokenBatches(DataConfig(batch_size=3, seed=7), seq_len=16, vocab_size=256)
    again = TokenBatches(DataConfig(batch_size=3, seed=7), seq_len=16, vocab_size=256)
    assert torch.equal(data.batch(12, 1), again.batch(12, 1))
    assert data.batch(12, 1).shape == (3, 17) and int(data.batch(12, 1).max()) < 256
    assert not torch.equal(data.batch(12, 1), data.batch(12, 0))
    assert not torch.equal(data.batch(12, 1), data.batch(13, 1))
    assert data.fingerprint() != TokenBatches(DataConfig(seed=8), seq_len=16,
                                              vocab_size=256).fingerprint()


def test_memmap_batches_read_the_token_file(tmp_path: Path) -> None:
    import numpy as np

    path = tmp_path / "tokens.bin"
    np.arange(1000, dtype=np.uint16).tofile(path)
    data = TokenBatches(DataConfig(kind="memmap", path=str(path), batch_size=2), seq_len=8,
                        vocab_size=65536)
    batch = data.batch(3, 0)
    assert batch.shape == (2, 9)
    assert torch.equal(batch[:, 1:] - batch[:, :-1], torch.ones(2, 8, dtype=torch.int64))
    assert torch.equal(batch, data.batch(3, 0))
