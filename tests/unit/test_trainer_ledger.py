"""The restart ledger: which restart brought an attempt up, and the seconds it cost."""

from __future__ import annotations

import pytest
from rtj_trainer.ledger import advance_ledger, classify_restart

pytestmark = pytest.mark.unit


def test_restarts_are_classified_from_the_previous_attempt() -> None:
    first = advance_ledger(None, now=100.0, pod_attempts={"0": 0, "1": 0},
                           launcher_restart_count=0, inprocess_iteration=0,
                           resumed_step_completed_at=None)
    assert first.restarts == {"inprocess": 0, "launcher": 0, "pod": 0}
    kw = {"pod_attempts": {"0": 0, "1": 0}, "launcher_restart_count": 0}
    assert classify_restart(first, inprocess_iteration=1, **kw) == "inprocess"  # type: ignore[arg-type]
    launcher = advance_ledger(first, now=130.0, pod_attempts={"0": 0, "1": 0},
                              launcher_restart_count=1, inprocess_iteration=0,
                              resumed_step_completed_at=120.0)
    assert launcher.restarts["launcher"] == 1 and launcher.lost_seconds == pytest.approx(10.0)
    pod = advance_ledger(launcher, now=200.0, pod_attempts={"0": 0, "1": 1},
                         launcher_restart_count=2, inprocess_iteration=0,
                         resumed_step_completed_at=None)
    assert pod.restarts == {"inprocess": 0, "launcher": 1, "pod": 1}
    assert pod.lost_seconds == pytest.approx(10.0 + 100.0)  # nothing committed: since job start


def test_resuming_the_checkpoint_of_a_whole_job_stop_is_not_a_restart() -> None:
    first = advance_ledger(None, now=100.0, pod_attempts={"0": 0, "1": 0},
                           launcher_restart_count=0, inprocess_iteration=0,
                           resumed_step_completed_at=None)
    first.stopped_step = 40  # every rank got SIGTERM (a suspend) and step 40 was committed
    # The resumed pods are new ones: without the stop this would count a pod restart.
    resumed = advance_ledger(first, now=900.0, pod_attempts={"0": 1, "1": 1},
                             launcher_restart_count=0, inprocess_iteration=0,
                             resumed_step_completed_at=150.0, resumed_step=40)
    assert resumed.restarts == {"inprocess": 0, "launcher": 0, "pod": 0}
    assert resumed.lost_seconds == 0.0 and resumed.stopped_step is None
    # A later fault is a restart again.
    again = advance_ledger(resumed, now=950.0, pod_attempts={"0": 1, "1": 1},
                           launcher_restart_count=1, inprocess_iteration=0,
                           resumed_step_completed_at=940.0, resumed_step=45)
    assert again.restarts["launcher"] == 1 and again.lost_seconds == pytest.approx(10.0)


def test_resuming_an_older_checkpoint_than_the_stop_is_a_restart() -> None:
    first = advance_ledger(None, now=100.0, pod_attempts={"0": 0}, launcher_restart_count=0,
                           inprocess_iteration=0, resumed_step_completed_at=None)
    first.stopped_step = 40
    resumed = advance_ledger(first, now=200.0, pod_attempts={"0": 1}, launcher_restart_count=0,
                             inprocess_iteration=0, resumed_step_completed_at=150.0,
                             resumed_step=30)
    assert resumed.restarts["pod"] == 1 and resumed.lost_seconds == pytest.approx(50.0)
