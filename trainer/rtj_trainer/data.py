"""Token batches as a pure function of (seed, step, rank): resume sees exactly the same data.

There is no iterator state to lose. The "data position" saved with a checkpoint is the next step
(plus a fingerprint of the source, so a checkpoint is not resumed against different data), and the
batch for (step, rank) is recomputed from a counter-based seed. Two sources:

- `synthetic` (default): each sequence is an arithmetic progression modulo the vocabulary with a
  random start and stride, so the loss falls quickly and a wrong resume is visible in the losses.
- `memmap`: a flat uint16 token file (e.g. on the FSx mount); each sequence starts at an offset
  drawn from the same counter-based seed.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .config import DataConfig


def _generator(seed: int, step: int, rank: int) -> np.random.Generator:
    # Philox is counter-based: the stream for (seed, step, rank) never depends on earlier draws.
    return np.random.Generator(np.random.Philox(key=[seed & (2**64 - 1), (step << 20) | rank]))


class TokenBatches:
    """`batch(step, rank)` -> int64 [batch_size, seq_len + 1]: inputs and shifted targets."""

    def __init__(self, cfg: DataConfig, *, seq_len: int, vocab_size: int) -> None:
        self.cfg = cfg
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self._tokens: np.memmap[Any, np.dtype[np.uint16]] | None = None
        if cfg.kind == "memmap":
            assert cfg.path is not None
            self._tokens = np.memmap(Path(cfg.path), dtype=np.uint16, mode="r")
            if len(self._tokens) < seq_len + 2:
                raise ValueError(f"data.path {cfg.path}: only {len(self._tokens)} tokens")

    def fingerprint(self) -> str:
        """Identifies the source, so resuming against other data is refused."""
        text = f"{self.cfg.kind}:{self.cfg.path}:{self.cfg.seed}:{self.cfg.batch_size}:"
        text += f"{self.seq_len}:{self.vocab_size}"
        if self._tokens is not None:
            text += f":{len(self._tokens)}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def batch(self, step: int, rank: int) -> torch.Tensor:
        rng = _generator(self.cfg.seed, step, rank)
        rows, width = self.cfg.batch_size, self.seq_len + 1
        if self._tokens is None:
            start = rng.integers(0, self.vocab_size, size=(rows, 1))
            stride = rng.integers(1, max(2, self.vocab_size // 8), size=(rows, 1))
            tokens = (start + stride * np.arange(width)[None, :]) % self.vocab_size
        else:
            offsets = rng.integers(0, len(self._tokens) - width, size=rows)
            tokens = np.stack([self._tokens[o : o + width] for o in offsets]).astype(np.int64)
            tokens %= self.vocab_size
        return torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))
