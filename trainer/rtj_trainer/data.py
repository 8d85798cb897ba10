"""Token batches as a pure function of (seed, step, rank): resume sees exactly the same data.

There is no iterator state to lose. The "data position" saved with a checkpoint is the next step
(plus a fingerprint of the source, so a checkpoint is not resumed against different data), and the
batch for (step, rank) is recomputed from a counter-based seed. Three sources:

- `synthetic` (default): each sequence is an arithmetic progression modulo the vocabulary with a
  random start and stride, so the loss falls quickly and a wrong resume is visible in the losses.
- `memmap`: a flat token file (`data.dtype` uint16, or uint32 for vocabularies above 65,536; e.g.
  on the FSx mount); each sequence starts at an offset drawn from the same counter-based seed.
- `hf`: a Hugging Face `datasets` directory (`save_to_disk`) with an `input_ids` column: its
  documents are concatenated in order and packed into blocks of `seq_len + 1` tokens (the tail that
  fills no block is dropped); the blocks are visited in a permutation per epoch drawn from the seed,
  the global batch of each step taking the next `world_size x batch_size` of them, so step `s` of
  rank `r` always reads the same blocks and a resume continues exactly where the last checkpoint
  left (the checkpoint keeps how many blocks were read, `consumed`: a resume at another world size
  goes on with the next block). The tokens are read into memory once (4 or 8 bytes a token).
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

    def __init__(self, cfg: DataConfig, *, seq_len: int, vocab_size: int,
                 world_size: int = 1) -> None:
        self.cfg = cfg
        self.seq_len = seq_len
        self.vocab_size = vocab_size
        self.world_size = world_size
        self._tokens: np.ndarray[Any, Any] | None = None
        self._blocks = 0
        self._origin = (0, 0)
        """(step, blocks of the stream consumed after it): where this attempt's steps count
        from (`resume`)."""
        if cfg.kind == "memmap":
            assert cfg.path is not None
            self._tokens = np.memmap(Path(cfg.path), dtype=np.dtype(cfg.dtype), mode="r")
            if len(self._tokens) < seq_len + 2:
                raise ValueError(f"data.path {cfg.path}: only {len(self._tokens)} tokens")
        elif cfg.kind == "hf":
            assert cfg.path is not None
            self._tokens = _dataset_tokens(cfg.path)
            self._blocks = len(self._tokens) // (seq_len + 1)
            if self._blocks < 1:
                raise ValueError(f"data.path {cfg.path}: {len(self._tokens)} tokens fill no "
                                 f"block of seq_len + 1 = {seq_len + 1}")

    def fingerprint(self) -> str:
        """Identifies the source, so resuming against other data is refused."""
        text = f"{self.cfg.kind}:{self.cfg.path}:{self.cfg.seed}:{self.cfg.batch_size}:"
        text += f"{self.seq_len}:{self.vocab_size}"
        if self._tokens is not None:
            text += f":{len(self._tokens)}"
        if self.cfg.kind == "memmap" and self.cfg.dtype != "uint16":
            text += f":{self.cfg.dtype}"
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def batch(self, step: int, rank: int) -> torch.Tensor:
        rng = _generator(self.cfg.seed, step, rank)
        rows, width = self.cfg.batch_size, self.seq_len + 1
        if self.cfg.kind == "hf":
            assert self._tokens is not None
            first = (self._origin[1]
                     + ((step - self._origin[0] - 1) * self.world_size + rank) * rows)
            blocks = [self._block(index) for index in range(first, first + rows)]
            tokens = np.stack([self._tokens[b * width:(b + 1) * width] for b in blocks])
            tokens = tokens.astype(np.int64) % self.vocab_size
        elif self._tokens is None:
            start = rng.integers(0, self.vocab_size, size=(rows, 1))
            stride = rng.integers(1, max(2, self.vocab_size // 8), size=(rows, 1))
            tokens = (start + stride * np.arange(width)[None, :]) % self.vocab_size
        else:
            offsets = rng.integers(0, len(self._tokens) - width, size=rows)
            tokens = np.stack([self._tokens[o : o + width] for o in offsets]).astype(np.int64)
            tokens %= self.vocab_size
        return torch.from_numpy(np.ascontiguousarray(tokens, dtype=np.int64))

    def consumed(self, step: int) -> int:
        """Blocks of the stream the whole job has read once `step` is done (kind=hf): what a
        checkpoint keeps, so that a resume at another world size goes on with the next block."""
        return self._origin[1] + (step - self._origin[0]) * self.world_size * self.cfg.batch_size

    def resume(self, step: int, consumed: int | None) -> None:
        """Go on after `step`, when `consumed` blocks were read (None: a checkpoint that did not
        record it, written at this world size)."""
        if consumed is None:
            consumed = step * self.world_size * self.cfg.batch_size
        self._origin = (step, consumed)

    def _block(self, index: int) -> int:
        """The block at position `index` of the stream: epoch `index // blocks`, visited in that
        epoch's permutation (drawn from the seed and the epoch alone)."""
        epoch, position = divmod(index, self._blocks)
        order = np.random.Generator(np.random.Philox(key=[self.cfg.seed & (2**64 - 1),
                                                          (1 << 62) | epoch]))
        return int(order.permutation(self._blocks)[position])


def _dataset_tokens(path: str) -> np.ndarray[Any, Any]:
    """Every document's `input_ids` of a `save_to_disk` directory, concatenated in order."""
    from datasets import load_from_disk

    try:
        dataset = load_from_disk(path)
    except (FileNotFoundError, ValueError) as exc:
        raise ValueError(f"data.path {path}: not a datasets save_to_disk directory "
                         f"({exc})") from None
    if "input_ids" not in dataset.column_names:
        raise ValueError(f"data.path {path}: no input_ids column (columns: "
                         f"{dataset.column_names})")
    column = dataset.data.column("input_ids")
    parts = [chunk.flatten().to_numpy(zero_copy_only=False) for chunk in column.chunks]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
