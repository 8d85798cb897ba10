"""Token sources beyond the synthetic one (rtj_trainer.data `TokenBatches`, rtj_trainer.config
`DataConfig`, `ModelConfig`, `MAX_VOCAB`): a Hugging Face `save_to_disk` directory packed into
`seq_len + 1` blocks visited in a per-epoch permutation, and a uint32 token file for vocabularies
above 65,536, with the configuration checks that keep a token type and a vocabulary consistent."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from rtj_trainer.config import MAX_VOCAB, ConfigError, DataConfig
from rtj_trainer.configload import build_config
from rtj_trainer.data import TokenBatches

pytestmark = pytest.mark.unit

SEQ_LEN = 3
WIDTH = SEQ_LEN + 1
LENGTHS = (5, 1, 7, 3, 9, 2, 6, 4, 8, 5)
"""Documents of varying lengths: 50 tokens, 12 blocks of 4 and a 2-token tail that fills none."""
BLOCKS = sum(LENGTHS) // WIDTH
VOCAB = 256
WORLD, ROWS = 2, 2
"""Two ranks of two rows: a global batch takes 4 blocks, so an epoch of 12 blocks is 3 steps."""
STEPS_PER_EPOCH = BLOCKS // (WORLD * ROWS)


def _stream(total: int = sum(LENGTHS)) -> list[int]:
    """Distinct token ids in no sorted order, so a block read out of order would show."""
    return [(i * 37) % 211 + 1 for i in range(total)]


def _documents(stream: list[int], lengths: tuple[int, ...] = LENGTHS) -> list[list[int]]:
    documents, at = [], 0
    for length in lengths:
        documents.append(stream[at:at + length])
        at += length
    return documents


def _save(path: Path, columns: dict[str, Any]) -> str:
    from datasets import Dataset

    Dataset.from_dict(columns).save_to_disk(str(path))
    return str(path)


@pytest.fixture
def hf_dir(tmp_path: Path) -> str:
    return _save(tmp_path / "dataset", {"input_ids": _documents(_stream())})


def _batches(path: str, *, world_size: int = WORLD, seed: int = 1234) -> TokenBatches:
    return TokenBatches(DataConfig(kind="hf", path=path, batch_size=ROWS, seed=seed),
                        seq_len=SEQ_LEN, vocab_size=VOCAB, world_size=world_size)


def _block_of(row: torch.Tensor) -> int:
    """The index of the block of the concatenated documents that `row` is (fails if none)."""
    stream = _stream()
    first = stream.index(int(row[0]))
    assert first % WIDTH == 0, f"{row.tolist()} does not start at a block boundary"
    assert row.tolist() == stream[first:first + WIDTH], f"{row.tolist()} is not a block"
    return first // WIDTH


def _step_blocks(data: TokenBatches, step: int, world_size: int = WORLD) -> list[int]:
    """The blocks of every rank's batch at `step`, in rank order."""
    return [_block_of(row) for rank in range(world_size) for row in data.batch(step, rank)]


def test_hf_rows_are_blocks_of_seq_len_plus_one_tokens_of_the_documents_in_order(
        hf_dir: str) -> None:
    """Every row of every batch is `seq_len + 1` contiguous tokens of the documents concatenated
    in their order, starting at a multiple of `seq_len + 1`; the tail is never read."""
    data = _batches(hf_dir)
    seen: set[int] = set()
    for step in range(1, 2 * STEPS_PER_EPOCH + 1):
        for rank in range(WORLD):
            batch = data.batch(step, rank)
            assert batch.shape == (ROWS, WIDTH) and batch.dtype == torch.int64
            seen.update(_block_of(row) for row in batch)
    assert seen == set(range(BLOCKS))  # block 12 (the 2-token tail) does not exist


def test_hf_batch_is_a_pure_function_of_step_and_rank(hf_dir: str) -> None:
    """A second TokenBatches on the same directory (a resumed process) reads the same batch for
    every (step, rank): a resume continues exactly where the checkpoint left."""
    first, second = _batches(hf_dir), _batches(hf_dir)
    for step in (1, 2, 3, 4, 7, 11):
        for rank in range(WORLD):
            assert torch.equal(first.batch(step, rank), second.batch(step, rank))
    # Read in another order: no iterator state either.
    assert torch.equal(second.batch(11, 1), _batches(hf_dir).batch(11, 1))


def test_hf_steps_and_ranks_of_one_epoch_read_disjoint_blocks(hf_dir: str) -> None:
    """Within an epoch the global batch of each step takes the next world_size x batch_size
    blocks: no two (step, rank) pairs share a block, and the epoch's steps read every block."""
    data = _batches(hf_dir)
    read: list[int] = []
    for step in range(1, STEPS_PER_EPOCH + 1):
        blocks = _step_blocks(data, step)
        assert len(blocks) == WORLD * ROWS
        read.extend(blocks)
    assert len(read) == len(set(read)) == BLOCKS


def test_hf_next_epoch_reads_every_block_again_in_another_permutation(hf_dir: str) -> None:
    """After an epoch the stream wraps around: the next epoch reads every block once more, in
    an order drawn afresh (a permutation of its own, not the first epoch's again)."""
    data = _batches(hf_dir)
    epochs = [[block for step in range(1 + e * STEPS_PER_EPOCH, 1 + (e + 1) * STEPS_PER_EPOCH)
               for block in _step_blocks(data, step)] for e in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(BLOCKS))
    assert epochs[0] != epochs[1]


def test_hf_fingerprint_changes_with_the_data(tmp_path: Path, hf_dir: str) -> None:
    """The fingerprint identifies the source: more documents at the same path, the same
    documents at another path, or another seed give another fingerprint; the same give the
    same."""
    before = _batches(hf_dir).fingerprint()
    assert _batches(hf_dir).fingerprint() == before
    assert _batches(hf_dir, seed=1).fingerprint() != before
    copy = tmp_path / "copy"
    shutil.copytree(hf_dir, copy)
    assert _batches(str(copy)).fingerprint() != before
    longer = _save(tmp_path / "longer", {"input_ids": _documents(_stream(60),
                                                                 (*LENGTHS, 10))})
    shutil.rmtree(hf_dir)
    shutil.copytree(longer, hf_dir)  # the job's directory now holds other data
    assert _batches(hf_dir).fingerprint() != before


@pytest.mark.parametrize(("columns", "needle"), [
    ({"text": ["a", "b"]}, "no input_ids column"),
    ({"input_ids": [[1, 2], [3]]}, "3 tokens fill no block of seq_len + 1 = 4"),
])
def test_hf_directory_without_input_ids_or_a_block_is_refused_naming_data_path(
        tmp_path: Path, columns: dict[str, Any], needle: str) -> None:
    """A directory that cannot feed a single block is refused at construction, naming the
    setting to fix (`data.path`) and why."""
    path = _save(tmp_path / "bad", columns)
    with pytest.raises(ValueError, match=r"data\.path") as caught:
        _batches(path)
    assert needle in str(caught.value) and path in str(caught.value)


def test_hf_directory_that_is_not_a_dataset_is_refused_naming_data_path(tmp_path: Path) -> None:
    """A path that holds no `save_to_disk` directory is a ValueError naming `data.path` too."""
    with pytest.raises(ValueError, match=r"data\.path .*not a datasets save_to_disk directory"):
        _batches(str(tmp_path / "missing"))


def test_hf_resume_at_another_world_size_continues_with_the_blocks_not_read_yet(
        hf_dir: str) -> None:
    """Two steps at world size 2 read blocks at stream positions 0-7; the job, resumed at world
    size 1 from the checkpoint of step 2 (which keeps `consumed`, 8 blocks), goes on with
    positions 8-9, not reading again blocks it trained on already (found by this test: the
    stream was positioned with the current world size)."""
    before = _batches(hf_dir, world_size=2)
    read = set(_step_blocks(before, 1, 2)) | set(_step_blocks(before, 2, 2))
    assert before.consumed(2) == 8
    after = _batches(hf_dir, world_size=1)
    assert before.fingerprint() == after.fingerprint()  # the resume is not refused
    after.resume(2, before.consumed(2))
    assert not set(_step_blocks(after, 3, 1)) & read
    assert _step_blocks(after, 3, 1) == [after._block(8), after._block(9)]


def test_memmap_uint32_tokens_above_65535_come_back_intact(tmp_path: Path) -> None:
    """A uint32 token file for a 200,000-token vocabulary: every row is contiguous tokens of
    the file, ids above 65,535 unchanged (uint16 would have wrapped them)."""
    tokens = np.arange(198_000, 200_000, dtype=np.uint32)  # up to the vocabulary's last id
    path = tmp_path / "tokens.u32"
    tokens.tofile(path)
    data = TokenBatches(DataConfig(kind="memmap", path=str(path), dtype="uint32", batch_size=3),
                        seq_len=16, vocab_size=200_000)
    batch = data.batch(5, 1)
    assert batch.shape == (3, 17) and int(batch.min()) >= 198_000
    for row in batch:
        start = int(row[0]) - 198_000
        assert row.tolist() == tokens[start:start + 17].astype(np.int64).tolist()
    assert torch.equal(batch, data.batch(5, 1))


def _memmap_overrides(*, vocab: int, dtype: str | None) -> list[str]:
    overrides = ["data.kind=memmap", "data.path=/data/tokens.bin", f"model.vocab_size={vocab}"]
    return overrides + ([f"data.dtype={dtype}"] if dtype else [])


def test_uint16_tokens_are_refused_for_a_vocabulary_above_65536() -> None:
    """uint16 (the default) holds ids up to 65,535: a larger vocabulary needs uint32, and the
    error says which setting to change."""
    with pytest.raises(ConfigError, match=r"data\.dtype") as caught:
        build_config(preset="tiny", env={}, overrides=_memmap_overrides(vocab=65537, dtype=None))
    assert "uint32" in str(caught.value)
    with pytest.raises(ConfigError, match=r"data\.dtype"):
        build_config(preset="tiny", env={},
                     overrides=_memmap_overrides(vocab=200_000, dtype="uint16"))
    at_limit = build_config(preset="tiny", env={},
                            overrides=_memmap_overrides(vocab=65536, dtype=None))
    assert at_limit.data.dtype == "uint16" and at_limit.model.vocab_size == 65536
    wide = build_config(preset="tiny", env={},
                        overrides=_memmap_overrides(vocab=200_000, dtype="uint32"))
    assert wide.data.dtype == "uint32" and wide.model.vocab_size == 200_000


def test_the_vocabulary_is_accepted_up_to_max_vocab_and_refused_above() -> None:
    """`model.vocab_size` goes up to MAX_VOCAB (262,144, Gemma 3's); one more is refused,
    naming the field."""
    assert MAX_VOCAB == 262144
    cfg = build_config(preset="tiny", env={},
                       overrides=_memmap_overrides(vocab=MAX_VOCAB, dtype="uint32"))
    assert cfg.model.vocab_size == MAX_VOCAB
    with pytest.raises(ConfigError, match=r"model\.vocab_size"):
        build_config(preset="tiny", env={},
                     overrides=_memmap_overrides(vocab=MAX_VOCAB + 1, dtype="uint32"))
