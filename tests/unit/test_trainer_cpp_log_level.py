"""The trainer turns torch's C++ warnings off unless the job's environment asks for them: c10d
prints two lines for every store wait that times out, and NVRx's in-process monitor thread waits
on its store in 0.5 s waits for the whole run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.unit

TIMED_OUT_WAIT = textwrap.dedent("""
    import datetime, os
    import rtj_trainer
    import torch.distributed as dist
    print(os.environ["TORCH_CPP_LOG_LEVEL"])
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=10))
    try:
        store.wait(["never-set"], datetime.timedelta(milliseconds=100))
    except dist.DistStoreError:
        print("timed out")
""")


def run(level: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TORCH_CPP_LOG_LEVEL"}
    if level is not None:
        env["TORCH_CPP_LOG_LEVEL"] = level
    return subprocess.run([sys.executable, "-c", TIMED_OUT_WAIT], env=env, capture_output=True,
                          text=True, timeout=120, check=True)


def test_a_timed_out_store_wait_prints_nothing_by_default() -> None:
    result = run(None)
    assert result.stdout.split() == ["ERROR", "timed", "out"]
    assert "waitForInput" not in result.stderr, result.stderr


def test_a_job_that_asks_for_torch_warnings_gets_them() -> None:
    result = run("WARNING")
    assert result.stdout.split() == ["WARNING", "timed", "out"]
    assert "[c10d] waitForInput" in result.stderr, result.stderr
