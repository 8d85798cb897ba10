"""The benchmarks' log analysis, checked against output recorded from real runs (2026-11-29)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import pytest

from bench.common import StampedLine, describe_spread, format_spread, format_table
from bench.localrun import (
    Resume,
    StepRecord,
    analyse_recovery,
    group_attempts,
    identity_clock,
    parse_launcher_events,
    parse_resumes,
    parse_summary,
    parse_wrapper_events,
    read_fault_times,
    read_losses,
)

pytestmark = pytest.mark.unit

# Recorded: `TRAINER_FAULTS=12:1:sigkill make train-local` (trimmed), lines stamped on arrival.
SIGKILL_RUN = [
    (1795950091.035, "[rtj-trainer rank 1] injecting fault sigkill at step 12"),
    (1795950091.326, "2026-11-29 11:01:31,313 [INFO] [vm] [workload:?(?) infra:?(?)] "
     "profiling.py:93   - Cycle: 1 Event: failure_detected Node: localhost_4307_0 Rank: 0 "
     "Time: 2026-11-29 11:01:31.313 UTC"),
    (1795950092.439, "2026-11-29 11:01:32,434 [INFO] profiling.py:93   - Cycle: 1 Event: "
     "worker_terminated Node: localhost_4307_0 Rank: 0 Time: 2026-11-29 11:01:32.434 UTC"),
    (1795950093.553, "2026-11-29 11:01:33,492 [INFO] profiling.py:93   - Cycle: 1 Event: "
     "worker_start_completed Node: localhost_4307_0 Rank: 0 Time: 2026-11-29 11:01:33.492 UTC"),
    (1795950100.598, "[rtj-trainer] resumed from step-000000010.a0-l0-i0-50085497 (step 10)"),
    (1795950104.197, '{"event": "summary", "steps": 30, "goodput": 0.1678, '
     '"restarts": {"inprocess": 0, "launcher": 1, "pod": 0}}'),
]
FAULT_AT = 1795950091.0271568
RECORDS = [
    StepRecord(10, "a0-l0-i0-50085497", 1795950090.8532288, 5.50),
    StepRecord(11, "a0-l0-i0-50085497", 1795950091.0248368, 5.54),
    StepRecord(11, "a0-l1-i0-50098530", 1795950100.8388712, 5.54),
    StepRecord(12, "a0-l1-i0-50098530", 1795950100.906553, 5.52),
]


def stamped(rows: list[tuple[float, str]]) -> list[StampedLine]:
    return [StampedLine(at, text) for at, text in rows]


def test_launcher_events_are_read_with_their_cycle_and_utc_time() -> None:
    events = parse_launcher_events(stamped(SIGKILL_RUN))
    assert [(e.cycle, e.name) for e in events] == [
        (1, "failure_detected"), (1, "worker_terminated"), (1, "worker_start_completed")]
    assert events[0].at == pytest.approx(1795950091.313, abs=1e-3)


def test_the_attempt_identity_clock_resolves_to_the_moment_the_process_group_was_ready() -> None:
    assert identity_clock("a0-l1-i0-50098530", near=1795950100.8) == pytest.approx(
        1795950098.530, abs=1e-3)
    assert identity_clock("no-clock-here", near=1795950100.8) is None


def test_a_launcher_restart_is_split_into_detect_restart_init_load_and_first_step() -> None:
    lines = stamped(SIGKILL_RUN)
    recovery = analyse_recovery(
        "step12-rank1-sigkill", FAULT_AT, events=parse_launcher_events(lines),
        inprocess_detections=[], resumes=parse_resumes(lines), records=RECORDS)
    assert recovery.fault_step == 12
    assert recovery.phases == pytest.approx({
        "detect": 0.286, "restart": 2.179, "init": 5.038, "load": 2.068, "first_step": 0.241,
    }, abs=2e-3)
    assert recovery.total_seconds == pytest.approx(9.812, abs=2e-3)
    assert sum(recovery.phases.values()) == pytest.approx(recovery.total_seconds, abs=5e-3)
    assert recovery.back_to_fault_step_seconds == pytest.approx(9.879, abs=2e-3)
    assert recovery.resumed_from_step == 10


def test_an_in_process_restart_has_no_launcher_milestones_and_still_adds_up() -> None:
    records = [StepRecord(11, "a0-l0-i0-50085497", FAULT_AT - 0.1, 5.5),
               StepRecord(11, "a0-l0-i1-50094000", FAULT_AT + 4.0, 5.5)]
    recovery = analyse_recovery("step12-rank1-exception", FAULT_AT, events=[],
                                inprocess_detections=[FAULT_AT + 0.5], resumes=[],
                                records=records)
    assert recovery.phases["detect"] == pytest.approx(0.5, abs=1e-3)
    assert recovery.phases["restart"] is None and recovery.phases["load"] is None
    assert recovery.total_seconds == pytest.approx(4.0, abs=1e-3)
    present = [v for v in recovery.phases.values() if v is not None]
    assert sum(present) == pytest.approx(4.0, abs=5e-3)


# Recorded from a warm spare's takeover on the local cluster (2026-12-01, pod logs, trimmed):
# NVRx's own lines carry the time they were logged (local time), the pod logs no arrival time.
SPARE_TAKEOVER_LOG = [
    "2026-12-01 03:56:23,603 [ERROR] [bench-0] [workload:0(?) infra:?(?)] wrap.py:582 "
    "[2026-12-01 03:56:23.603071] rank=0 fn_ex: RuntimeError('Connection closed by peer')",
    "[rtj-trainer rank 0] marked ranks [2, 3] of restart iteration 0 terminated",
    "2026-12-01 03:56:23,815 [WARNING] [bench-0] [workload:0(?) infra:?(?)] wrap.py:598 "
    "[2026-12-01 03:56:23.815312] rank=0 term_ex: RankShouldRestart('Interruption.EXCEPTION')",
    "2026-12-01 03:56:24,641 [INFO] [bench-2] [workload:4(?) infra:?(?)] rank_assignment.py:829 "
    "[In-process] Rank reassigned (rank changed from 4 to 2) to fill gap",
]


def test_wrapper_lines_give_the_in_process_detection_and_the_spares_move_in_local_time() -> None:
    events = parse_wrapper_events([StampedLine(0.0, text) for text in SPARE_TAKEOVER_LOG])
    local = datetime(2026, 12, 1, 3, 56, 23, 603000).timestamp()  # naive: this machine's zone
    assert events["detected"] == pytest.approx([local, local + 0.212], abs=1e-3)
    assert events["reassigned"] == pytest.approx([local + 1.038], abs=1e-3)


def test_an_in_process_takeover_counts_the_spares_move_in_as_its_restart() -> None:
    records = [StepRecord(35, "a0-l0-i0-50085497", FAULT_AT - 0.1, 5.5),
               StepRecord(31, "a0-l0-i1-50094800", FAULT_AT + 4.2, 5.5)]  # group at 94.800
    recovery = analyse_recovery(
        "step36-pod1-kill", FAULT_AT, events=[], inprocess_detections=[FAULT_AT + 0.3],
        inprocess_restarts=[FAULT_AT + 1.3], resumes=[Resume(FAULT_AT + 4.0, "", -1)],
        records=records)
    assert recovery.phases == pytest.approx({
        "detect": 0.3, "restart": 1.0, "init": 2.473, "load": 0.227, "first_step": 0.2},
        abs=2e-3)
    assert recovery.total_seconds == pytest.approx(4.2, abs=1e-3)


def test_a_fault_without_a_later_attempt_has_no_recovery_time() -> None:
    recovery = analyse_recovery("step12-rank1-hang", FAULT_AT, events=[],
                                inprocess_detections=[], resumes=[], records=RECORDS[:2])
    assert recovery.total_seconds is None
    assert recovery.back_to_fault_step_seconds is None


def test_attempts_are_ordered_by_their_first_step() -> None:
    attempts = group_attempts(list(reversed(RECORDS)))
    assert [a.identity for a in attempts] == ["a0-l0-i0-50085497", "a0-l1-i0-50098530"]
    assert attempts[1].first_step == 11 and attempts[1].last_step == 12


def test_the_summary_is_the_last_summary_json_line() -> None:
    parsed = parse_summary(stamped(SIGKILL_RUN))
    assert parsed is not None
    summary, at = parsed
    assert summary["restarts"]["launcher"] == 1 and at == 1795950104.197
    assert parse_summary(stamped(SIGKILL_RUN[:-1])) is None


def test_losses_and_fault_markers_are_read_from_the_run_directory(tmp_path: Path) -> None:
    (tmp_path / "faults").mkdir()
    (tmp_path / "faults" / "step12-rank1-sigkill").write_text(f"{FAULT_AT}\n")
    rows = [{"step": 1, "loss": 5.5, "attempt": "a0-l0-i0-1", "time": 10.0}]
    (tmp_path / "losses.jsonl").write_text(json.dumps(rows[0]) + "\n" + '{"step": 2, "lo')
    assert read_fault_times(tmp_path) == {"step12-rank1-sigkill": FAULT_AT}
    assert read_losses(tmp_path / "losses.jsonl") == [StepRecord(1, "a0-l0-i0-1", 10.0, 5.5)]


def test_spreads_ignore_missing_values_and_print_median_with_range() -> None:
    spread = describe_spread([3.0, None, 1.0, 2.0])
    assert spread == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert format_spread(spread) == "2.00 (1.00-3.00)"
    assert format_spread(describe_spread([None])) == "-"
    table = format_table(["a", "bb"], [["1", "2"]])
    assert table.splitlines()[0] == "| a | bb |"
