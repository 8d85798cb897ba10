"""The progress lines tests and benchmarks parse keep their exact text through the logger."""

from __future__ import annotations

import logging

import pytest
from rtj_trainer.__main__ import _PrefixFormatter

pytestmark = pytest.mark.unit


def _line(message: str, *args: object, rank: int | None = None,
          level: int = logging.INFO) -> str:
    record = logging.LogRecord("rtj_trainer.trainer", level, __file__, 1, message, args, None)
    if rank is not None:
        record.rank = rank
    return _PrefixFormatter().format(record)


def test_progress_lines_keep_their_text() -> None:
    assert (_line("resumed from %s (step %d)%s", "step-000000005.a0", 5, "")
            == "[rtj-trainer] resumed from step-000000005.a0 (step 5)")
    assert (_line("checkpoint step %d (%s) stall %.4f s", 10, "async", 0.01234)
            == "[rtj-trainer] checkpoint step 10 (async) stall 0.0123 s")
    assert (_line("injecting fault %s at step %d", "launcher-kill", 10, rank=1)
            == "[rtj-trainer rank 1] injecting fault launcher-kill at step 10")


def test_other_levels_are_named() -> None:
    assert (_line("not resuming from %s", "x", level=logging.WARNING)
            == "[rtj-trainer] WARNING rtj_trainer.trainer: not resuming from x")
