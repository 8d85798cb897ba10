"""The goodput benchmark's baseline (issue #32): the plain torchrun script a PyTorchJob user runs,
for real (torchrun, gloo, two CPU ranks, DCP async saves): it recovers an exception and a
SIGKILL by restarting every worker from the newest complete save, ends with the same final
loss as a run without faults, and counts recomputed steps once."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.baseline_trainer import productive_seconds
from bench.goodput import goodput_ratio
from bench.localrun import run_local_trainer

pytestmark = pytest.mark.e2e

SETS = ["train.steps=30", "checkpoint.interval_steps=10", "train.device=cpu"]


def test_the_baseline_recovers_by_restarting_from_its_newest_save(tmp_path: Path) -> None:
    clean = run_local_trainer(tmp_path / "clean", sets=SETS, baseline=True, max_restarts=0,
                              timeout_seconds=240)
    faulted = run_local_trainer(tmp_path / "faulted", faults="12:1:exception,25:0:sigkill",
                                sets=SETS, baseline=True, max_restarts=3, timeout_seconds=240)
    assert clean.summary is not None and faulted.summary is not None, faulted.log_path
    assert faulted.summary["restarts"] == {"launcher": 2}
    assert faulted.summary["final_loss"] == clean.summary["final_loss"]
    resumed = [line.text for line in faulted.lines if "[baseline] resumed from step" in line.text]
    assert [r.split("step ")[1].split(" ")[0] for r in resumed] == ["10", "20"]
    assert faulted.summary["steps_run"] == 30 + 1 + 4  # a fault fires before its step
    assert 0 < faulted.summary["goodput"] < clean.summary["goodput"] <= 1
    assert sorted(faulted.fault_times) == ["step12-rank1-exception", "step25-rank0-sigkill"]


def test_recomputed_steps_count_once_and_the_ratio_says_why_it_is_missing() -> None:
    lines = [{"step": 1, "seconds": 1.0}, {"step": 2, "seconds": 5.0}, {"step": 2, "seconds": 2.0}]
    assert productive_seconds(lines) == 3.0
    runs = {"faulted": {"figures": {"goodput": 0.8}}, "baseline": {"figures": {"goodput": 0.4}}}
    assert goodput_ratio(runs) == {"ours": "faulted", "ours_goodput": 0.8,
                                   "baseline_goodput": 0.4, "ratio": 2.0, "why_none": None}
    runs["baseline"]["figures"] = {"completed": False}
    assert goodput_ratio(runs)["why_none"] == "the baseline did not finish within --run-timeout"
