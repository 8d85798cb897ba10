"""The progress lines tests and benchmarks parse keep their exact text through the logger."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from rtj_trainer import termination
from rtj_trainer.__main__ import _PrefixFormatter, fatal, report_termination
from rtj_trainer.config import ConfigError

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


def test_a_fatal_error_of_any_local_rank_names_its_reason_when_rank_0_said_nothing_yet(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "termination-log"
    monkeypatch.setenv(termination.PATH_ENV, str(path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    # An ordinary message is local rank 0's alone.
    report_termination(termination.TerminationMessage(outcome=termination.SUCCEEDED,
                                                       exit_code=0))
    assert not path.exists()
    # A fatal error: local rank 1 got there first, so its reason is the pod's.
    assert fatal(ConfigError("data.kind=memmap needs data.path")) == 94
    said = json.loads(path.read_text())
    assert said["outcome"] == "Failed" and said["exitCode"] == 94
    assert said["reason"] == "ConfigurationError" and "data.path" in said["message"]
    # Another local rank's later fatal error does not overwrite it; local rank 0's does.
    assert fatal(ConfigError("something else")) == 94
    assert "data.path" in json.loads(path.read_text())["message"]
    monkeypatch.setenv("LOCAL_RANK", "0")
    fatal(ConfigError("rank 0's words"))
    assert "rank 0's words" in json.loads(path.read_text())["message"]
