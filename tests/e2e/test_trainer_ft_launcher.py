"""The real trainer under NVRx ft_launcher, 2 CPU ranks (gloo), with injected faults.

Every run goes through trainer/scripts/train-local.sh (what `make train-local` runs) with a fresh
run directory. Losses are compared bit for bit with a fault-free run of the same config: a resumed
run must recompute exactly the same numbers from its resume point on.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
import pytest
from harness.ports import free_port_block

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "trainer" / "scripts" / "train-local.sh"
STEPS = 30
pytestmark = pytest.mark.e2e


def _terminate_with_pytest() -> None:
    """In the child, before exec: SIGTERM when pytest dies (ft_launcher then stops its workers)."""
    import ctypes

    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _start(run_dir: Path, faults: str = "", extra_env: dict[str, str] | None = None,
           args: tuple[str, ...] = ()) -> subprocess.Popen[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RTJ_", "TRAINER_"))}
    # 10 s heartbeats: short enough to catch a hang quickly, long enough for a loaded CI box.
    env.update(RTJ_RUN_DIR=str(run_dir), TRAINER_FAULTS=faults, RTJ_HEARTBEAT_TIMEOUT_SECONDS="10")
    env.update(extra_env or {})
    return subprocess.Popen(
        ["bash", str(SCRIPT), "--set", f"train.steps={STEPS}", *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=_terminate_with_pytest,
    )


def _finish(proc: subprocess.Popen[str], timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"trainer did not finish in {timeout} s:\n{out[-4000:]}")
    finally:
        try:  # nothing of the run may outlive the test
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-6000:]
    return out


def _run(run_dir: Path, timeout: float = 240, **kwargs: Any) -> str:
    return _finish(_start(run_dir, **kwargs), timeout)


def _losses(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / "losses.jsonl").read_text().splitlines()]


def _summary(out: str) -> dict[str, Any]:
    lines = [ln for ln in out.splitlines() if ln.startswith('{"event": "summary"')]
    assert lines, out[-3000:]
    summary: dict[str, Any] = json.loads(lines[-1])
    return summary


def _resumed_by_the_second_attempt(losses: list[dict[str, Any]]) -> int:
    """The step the run's second (and last) attempt resumed from: one before its first step."""
    attempts: list[str] = []
    for entry in losses:
        if entry["attempt"] not in attempts:
            attempts.append(entry["attempt"])
    assert len(attempts) == 2, attempts
    return int(next(e["step"] for e in losses if e["attempt"] == attempts[1])) - 1


def _assert_same_losses(run: list[dict[str, Any]], baseline: dict[int, float]) -> None:
    for entry in run:
        assert entry["loss"] == baseline[entry["step"]], (entry, baseline[entry["step"]])


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("fault-free")
    out = _run(run_dir)
    summary = _summary(out)
    assert summary["steps"] == STEPS and summary["last_committed_step"] == STEPS
    assert summary["restarts"] == {"inprocess": 0, "launcher": 0, "pod": 0}
    final = summary["final_save"]  # the wait for the last checkpoint, split into its phases
    assert final["step"] == STEPS and final["write"] > 0 and final["wait"] > 0, final
    assert final["total"] >= final["staging"] + final["write"], final
    # The loop's seconds outside the steps, and what the first step's preparation took
    assert 0 <= summary["attempt_between_steps_seconds"] < summary["attempt_loop_seconds"], summary
    prepare = summary["attempt_prepare"]
    parts = {"state", "flatten", "snapshot_buffer", "staging_share", "staging_register"}
    assert parts <= set(prepare), prepare
    assert all(value >= 0 for value in prepare.values()), prepare
    losses = _losses(run_dir)
    assert [e["step"] for e in losses] == list(range(1, STEPS + 1))
    return {e["step"]: e["loss"] for e in losses}


def test_fault_free_run_reaches_the_last_step_and_prints_the_summary(
    fault_free: dict[int, float],
) -> None:
    assert sorted(fault_free) == list(range(1, STEPS + 1))
    assert fault_free[STEPS] < fault_free[1]


def test_exception_sigkill_and_hang_each_resume_with_identical_losses(
    tmp_path: Path, fault_free: dict[int, float]
) -> None:
    # A 10 s heartbeat timeout and 5 restarts leave room for a loaded CI machine; the hang is
    # still detected by the rank monitor, and each fault must have fired exactly once.
    out = _run(tmp_path, faults="8:1:exception,17:0:sigkill,26:1:hang", timeout=400,
               extra_env={"RTJ_MAX_RESTARTS": "5"})
    summary = _summary(out)
    assert summary["steps"] == STEPS and summary["last_committed_step"] == STEPS
    assert summary["restarts"]["launcher"] >= 3
    losses = _losses(tmp_path)
    attempts: dict[str, list[dict[str, Any]]] = {}
    for entry in losses:
        attempts.setdefault(entry["attempt"], []).append(entry)
    assert len(attempts) == summary["restarts"]["launcher"] + 1, list(attempts)
    firsts = [entries[0]["step"] for entries in attempts.values()]
    # Each restart resumes right after the newest commit (step 1 if nothing was committed yet,
    # e.g. when the first async write had not finished when the exception hit).
    assert firsts[0] == 1 and all(first <= 26 for first in firsts[1:]), firsts
    assert all((first - 1) % 5 == 0 for first in firsts), firsts  # commits every 5 steps
    assert max(e["step"] for e in losses) == STEPS
    _assert_same_losses(losses, fault_free)
    assert "Did not get subsequent heartbeat" in out  # the hang was caught by the rank monitor
    markers = sorted(p.name for p in (tmp_path / "faults").iterdir())
    assert markers == ["step17-rank0-sigkill", "step26-rank1-hang", "step8-rank1-exception"]


def test_a_killed_worker_resumes_from_a_node_local_snapshot_between_saves(
    tmp_path: Path, fault_free: dict[int, float]
) -> None:
    """Issue #32: saves every 10 steps, node-local snapshots every 2 between them
    (`checkpoint.local_interval_steps`), saves staged through the snapshots' device copy when
    it is free (`checkpoint.save_device_copy`, on by default on CUDA only). Rank 1 is SIGKILLed
    at the start of step 15: the launcher restarts both workers, and they resume from the
    newest snapshot both hold (step 14, or 12 if 14's write had not finished), not from the
    commit of step 10; the losses are the fault-free run's."""
    out = _run(tmp_path, faults="15:1:sigkill", args=(
        "--set", "checkpoint.interval_steps=10",
        "--set", f"checkpoint.local_dir={tmp_path / 'shm'}",
        "--set", "checkpoint.local_interval_steps=2",
        "--set", "checkpoint.save_device_copy=true",
        "--set", "train.min_step_seconds=0.2"))
    summary = _summary(out)
    assert summary["restarts"] == {"inprocess": 0, "launcher": 1, "pod": 0}
    assert summary["last_committed_step"] == STEPS
    snapshots = summary["attempt_snapshots"]
    assert snapshots["taken"] >= 5, summary  # steps 16 ... 28 of attempt 2
    # the thread's copies in this process (attempt 2's): how long one takes is what bounds the
    # steps a SIGKILL recomputes (docs/benchmarks.md, issue #32's table)
    assert 1 <= snapshots["thread_copies"] <= snapshots["taken"], summary
    assert 0 < snapshots["thread_copy_seconds_last"] <= snapshots["thread_copy_seconds_max"]
    # the stall's parts: the state read and the copy's launch, within it
    assert 0 < snapshots["state_seconds"] < snapshots["stall_seconds"], summary
    assert snapshots["copy_launch_seconds"] > 0, summary
    # the saves of 20 and 30 in this attempt: through the device copy unless a snapshot's copy
    # of 2 steps before still ran (then staged as before; both were committed: above)
    assert 1 <= summary["attempt_saves_through_device_copy"] <= 2, summary
    losses = _losses(tmp_path)
    resumed = _resumed_by_the_second_attempt(losses)
    assert resumed in (12, 14), _resumes(out)
    assert f"(step {resumed}) from the node-local copies" in out, _resumes(out)
    _assert_same_losses(losses, fault_free)


def test_a_killed_worker_resumes_from_the_snapshot_its_device_keeper_holds(
    tmp_path: Path, fault_free: dict[int, float]
) -> None:
    """Issue #32: with device keepers (`RTJ_DEVICE_KEEPER=1`, rtj_trainer.keeper; on CPU a
    keeper lends host memory, on a GPU device memory through CUDA IPC) the snapshots' buffer
    belongs to one keeper process per local rank, so the buffer outlives the worker SIGKILLed
    at the start of step 15: the restarted workers resume from the snapshot the keepers hold
    (step 14, or 12 should its record not be written yet), read from the keepers' memory, not
    from a file; the losses are the fault-free run's. The keepers are gone with the launcher."""
    out = _run(
        tmp_path, faults="15:1:sigkill",
        # with warm workers, as the GPU benchmarks run: each takes the keepers' directory from
        # its attach client's environment (the pool was started before the keepers)
        extra_env={"RTJ_DEVICE_KEEPER": "1", "RTJ_WARM_WORKERS": "1"}, args=(
        "--set", "checkpoint.interval_steps=10",
        "--set", f"checkpoint.local_dir={tmp_path / 'shm'}",
        "--set", "checkpoint.local_interval_steps=2",
        "--set", "train.min_step_seconds=0.2"))
    summary = _summary(out)
    assert summary["restarts"] == {"inprocess": 0, "launcher": 1, "pod": 0}
    assert summary["last_committed_step"] == STEPS
    assert summary["attempt_snapshots"]["taken"] >= 5, summary
    found = re.search(r"device keepers: 2 in (\S+)", out)
    assert found, out[-3000:]
    losses = _losses(tmp_path)
    resumed = _resumed_by_the_second_attempt(losses)
    assert resumed in (12, 14), _resumes(out)
    assert f"(step {resumed}) from the snapshot the device keepers hold" in out, _resumes(out)
    _assert_same_losses(losses, fault_free)
    deadline = time.monotonic() + 10  # they die with the launcher (PR_SET_PDEATHSIG)
    while (keepers := [p.pid for p in psutil.process_iter(["cmdline"])
                       if f"--directory={found.group(1)}" in (p.info["cmdline"] or [])]):
        assert time.monotonic() < deadline, keepers
        time.sleep(0.2)
    assert not Path(found.group(1)).exists()


def test_a_writer_killed_mid_save_resumes_from_the_previous_commit(
    tmp_path: Path, fault_free: dict[int, float]
) -> None:
    # Writes take 2 s, so the step-10 save is still being written when rank 0 is SIGKILLed at
    # step 14; its writer dies with it. Step 5 was committed before (the step-10 save waited
    # for it), so the job must resume from step 5, not 10.
    out = _run(tmp_path, faults="14:0:sigkill",
               args=("--set", "checkpoint.test_write_delay_seconds=2"))
    losses = _losses(tmp_path)
    attempts: list[str] = []
    for entry in losses:
        if entry["attempt"] not in attempts:
            attempts.append(entry["attempt"])
    second = [e for e in losses if e["attempt"] == attempts[1]]
    assert second[0]["step"] == 6, "resumed from the uncommitted step-10 checkpoint?"
    assert "resumed from step-000000005" in out
    _assert_same_losses(losses, fault_free)
    assert _summary(out)["last_committed_step"] == STEPS



def test_a_failed_last_save_restarts_the_attempt_instead_of_ending_one_interval_behind(
    tmp_path: Path, fault_free: dict[int, float]
) -> None:
    # review F1 and F2: rank 1's write of the step-10 save fails and leaves nothing (no record,
    # no `.error`); rank 0's write of the last save (step 30) fails with EIO. Step 10 is given
    # up at its 3 s deadline and later saves commit; the abandoned last save fails the attempt
    # on every rank, and the restart computes steps 26-30 again and commits step 30. Before,
    # step 10 blocked every later commit and the job ended "successfully" at step 25.
    out = _run(tmp_path, faults="10:1:write-lost,30:0:write-error", timeout=400,
               args=("--set", "checkpoint.commit_timeout_seconds=3"))
    assert "checkpoint of step 10 will not be committed" in out and "rank(s) 1" in out
    assert "the checkpoint of step 30 was abandoned" in out
    summary = _summary(out)
    assert summary["steps"] == STEPS and summary["last_committed_step"] == STEPS
    assert summary["restarts"]["launcher"] == 1, summary["restarts"]
    losses = _losses(tmp_path)
    attempts: dict[str, list[int]] = {}
    for entry in losses:
        attempts.setdefault(entry["attempt"], []).append(entry["step"])
    assert list(attempts.values())[1][0] == 26, attempts  # resumed from the step-25 commit
    _assert_same_losses(losses, fault_free)
    markers = sorted(p.name for p in (tmp_path / "faults").iterdir())
    assert markers == ["step10-rank1-write-lost", "step30-rank0-write-error"]


def test_inprocess_restart_recovers_an_exception_in_the_same_processes(
    tmp_path: Path, fault_free: dict[int, float]
) -> None:
    out = _run(tmp_path, faults="8:1:exception",
               extra_env={"RTJ_INPROCESS_RESTART": "1", "RTJ_HEARTBEAT_TIMEOUT_SECONDS": "60"})
    summary = _summary(out)
    assert summary["restarts"] == {"inprocess": 1, "launcher": 0, "pod": 0}
    losses = _losses(tmp_path)
    assert len({e["attempt"] for e in losses}) == 2
    assert len({e["pid"] for e in losses}) == 1  # rank 0 never left its process
    _assert_same_losses(losses, fault_free)
    assert "RankShouldRestart" in out
    # Rank 1 failed at the start of step 8: both ranks still held the state after step 7 and
    # kept it in memory, and the next attempt went on from there, the uncommitted step 7, not
    # from the step-5 save: no step was computed twice.
    assert [e["step"] for e in losses] == list(range(1, STEPS + 1))
    assert "resumed from step-000000007" in out and "from the training state at the fault" in out
    # A rank's checkpoint writer that was idle at the restart outlived it; one still writing
    # (the step-5 save, a few milliseconds of tiny steps earlier, on a loaded machine) was
    # replaced. Both ranks said which, and only the replaced ones started a writer again.
    # Asserted per rank, not by counting lines: a line may be said again when a restart's
    # exception interrupts the close that said it (review-2: a flaky count).
    def ranks(needle: str) -> set[str]:
        return {m.group(1) for ln in out.splitlines() if needle in ln
                for m in [re.search(r"\[rtj-trainer rank (\d+)\]", ln)] if m}

    # Both ranks kept their state (per rank, not a line count: a line may be said twice).
    assert ranks("kept the training state after step 7") == {"0", "1"}
    kept = ranks("checkpoint writer kept for the next attempt")
    stopped = ranks("checkpoint writer stopped: a write was in flight")
    assert kept | stopped == {"0", "1"} and not kept & stopped, (kept, stopped)
    started = [m.group(1) for ln in out.splitlines() if "checkpoint writer process" in ln
               for m in [re.search(r"\[rtj-trainer rank (\d+)\]", ln)] if m]
    # Each rank started one writer, and a rank whose writer was stopped started another.
    assert sorted(started) == sorted(["0", "1", *stopped]), (started, stopped)


def test_an_inprocess_restart_keeps_the_state_at_the_fault_in_the_device_keepers_buffer(
    tmp_path: Path, fault_free: dict[int, float]
) -> None:
    """With device keepers (rtj_trainer.keeper) and snapshots, an in-process restart keeps the
    interrupted attempt's training state in the keeper's buffer (a device-to-device copy on a
    GPU) instead of the host staging buffer, and the next attempt resumes from it: no step is
    computed twice and the losses are the fault-free run's."""
    out = _run(tmp_path, faults="8:1:exception", extra_env={
        "RTJ_INPROCESS_RESTART": "1", "RTJ_HEARTBEAT_TIMEOUT_SECONDS": "60",
        "RTJ_DEVICE_KEEPER": "1"}, args=(
        "--set", f"checkpoint.local_dir={tmp_path / 'shm'}",
        "--set", "checkpoint.local_interval_steps=2"))
    summary = _summary(out)
    assert summary["restarts"] == {"inprocess": 1, "launcher": 0, "pod": 0}
    losses = _losses(tmp_path)
    assert len({e["pid"] for e in losses}) == 1
    assert [e["step"] for e in losses] == list(range(1, STEPS + 1))
    _assert_same_losses(losses, fault_free)
    kept = [ln for ln in out.splitlines() if "kept the training state after step 7" in ln]
    assert kept and all("in the device keeper's memory" in ln for ln in kept), kept
    assert "resumed from step-000000007" in out and "from the training state at the fault" in out


@pytest.mark.long
def test_inprocess_restart_catches_a_hang_by_its_soft_timeout(tmp_path: Path) -> None:
    """One rank (no peer whose collective timeout could raise for it) stops making progress while
    alive: the in-process wrapper's soft timeout (4 s) restarts it in its process, long before
    the rank monitor's 60 s heartbeat timeout would have the launcher restart it. (NVRx checks the
    timeouts only when the rank sent nothing for a monitor interval; with the watchdog's interval
    equal to it the check hardly ever ran and a hang always became a launcher restart.)"""
    out = _run(tmp_path, faults="8:0:hang",
               extra_env={"RTJ_INPROCESS_RESTART": "1", "RTJ_HEARTBEAT_TIMEOUT_SECONDS": "60",
                          "RTJ_NPROC_PER_NODE": "1"},
               args=("--set", "resiliency.inprocess_soft_timeout_seconds=4"))
    assert _summary(out)["restarts"] == {"inprocess": 1, "launcher": 0, "pod": 0}
    assert "Interruption.SOFT_TIMEOUT" in out
    assert "Did not get subsequent heartbeat" not in out
    losses = _losses(tmp_path)
    assert len({e["pid"] for e in losses}) == 1  # the rank never left its process
    assert [e["step"] for e in losses if e["attempt"] == losses[-1]["attempt"]][-1] == STEPS
    # The rank hung at the start of step 8 with the state after step 7 intact: the next attempt
    # resumed from that state (kept in memory), not from the step-5 save.
    assert [e["step"] for e in losses] == list(range(1, STEPS + 1))
    assert "resumed from step-000000007" in out and "from the training state at the fault" in out


def test_a_hang_is_caught_by_the_timeout_learned_from_the_steps(tmp_path: Path) -> None:
    """With the learned hang timeout on (rtj_trainer.hangwatch; on by default on CUDA only) and
    NVRx's own soft timeout at 30 s, one rank that stops making progress at step 8 is restarted
    in place by the watch (it times steps 2-7, then any step past max(8 s, 5 x the longest)):
    its log line and NVRx's soft-timeout record, one in-process restart and no other (no false
    hang in the 29 other steps), the state after step 7 kept. The floor is high for a CPU: steps
    of this run took up to 3 s on a loaded 2-core host, which is why the timeout is off on CPU
    by default."""
    out = _run(tmp_path, faults="8:0:hang",
               extra_env={"RTJ_INPROCESS_RESTART": "1", "RTJ_HEARTBEAT_TIMEOUT_SECONDS": "120",
                          "RTJ_NPROC_PER_NODE": "1"},
               args=("--set", "resiliency.inprocess_soft_timeout_seconds=30",
                     "--set", "resiliency.learned_hang_timeout=true",
                     "--set", "resiliency.hang_timeout_learn_steps=3",
                     "--set", "resiliency.hang_timeout_floor_seconds=8"))
    summary = _summary(out)
    assert summary["restarts"] == {"inprocess": 1, "launcher": 0, "pod": 0}
    found = re.search(r"no progress for ([\d.]+) s in a step \(learned hang timeout ([\d.]+) s",
                      out)
    assert found, out[-3000:]
    # The watch fires once the quiet time exceeds the limit; the log prints both to 0.01 s, so
    # a quiet time of 8.004 s against a limit of 8.00 s reads "8.00 ... 8.00" (CI, 200c7b2).
    assert float(found.group(1)) >= float(found.group(2)) >= 8.0, found.group(0)
    learned = summary["learned_hang_timeout"]
    assert learned["reported"] == 1 and learned["seconds"] >= 8.0, learned
    # Steps 2-7 of the first attempt, 9-30 of the second (its first step, 8, is not timed).
    assert learned["steps_timed"] == 6 + 22, learned
    assert "Interruption.SOFT_TIMEOUT" in out
    losses = _losses(tmp_path)
    assert len({e["pid"] for e in losses}) == 1
    assert [e["step"] for e in losses] == list(range(1, STEPS + 1))
    assert "resumed from step-000000007" in out and "from the training state at the fault" in out


@pytest.mark.parametrize("startup_timeout", [None, pytest.param(4, marks=pytest.mark.long)])
def test_a_slow_first_step_is_not_taken_for_a_hang_but_a_slow_later_step_is(
    tmp_path: Path, startup_timeout: int | None
) -> None:
    """One rank whose main thread blocks for 8 s in one C call (a slow step, no Python running)
    at step 1 and at step 12, with a 4 s in-process soft timeout. The first step of an attempt
    has the start-up allowance (`resiliency.inprocess_startup_timeout_seconds`, by default the
    heartbeat timeout, 60 s here): no restart there. Step 12 has none: the soft timeout restarts
    the rank in its process. With the start-up timeout set to the soft timeout (no allowance,
    the control) the first step is restarted as well."""
    args = ["--set", "resiliency.inprocess_soft_timeout_seconds=4"]
    if startup_timeout is not None:
        args += ["--set", f"resiliency.inprocess_startup_timeout_seconds={startup_timeout}"]
    out = _run(tmp_path, faults="1:0:stall=8,12:0:stall=8",
               extra_env={"RTJ_INPROCESS_RESTART": "1", "RTJ_HEARTBEAT_TIMEOUT_SECONDS": "60",
                          "RTJ_NPROC_PER_NODE": "1"},
               args=tuple(args))
    losses = _losses(tmp_path)
    assert len({e["pid"] for e in losses}) == 1  # every restart stayed in the process
    assert "Did not get subsequent heartbeat" not in out  # no rank-monitor (launcher) restart
    assert "Interruption.SOFT_TIMEOUT" in out
    attempts: dict[str, list[int]] = {}
    for entry in losses:
        attempts.setdefault(entry["attempt"], []).append(entry["step"])
    ended = re.findall(r"restart iteration (\d+) ended by (\w+)", out)
    # The first attempt that logged steps ran through step 1 up to the slow step 12.
    assert next(iter(attempts.values())) == list(range(1, 12)), attempts
    if startup_timeout is None:
        assert _summary(out)["restarts"] == {"inprocess": 1, "launcher": 0, "pod": 0}
        assert ended == [("0", "RankShouldRestart")], ended
    else:
        # Attempt 0 was restarted in its slow first step, before it logged one.
        assert _summary(out)["restarts"] == {"inprocess": 2, "launcher": 0, "pod": 0}
        assert [iteration for iteration, _ in ended] == ["0", "1"], ended
    # Every step once, but for one race (see the blocked-rank test below, now `long`): on a fast
    # host the restart could land after step 12's optimizer update began, the state after step
    # 11 was not kept, and the next attempt recomputed step 11 from the save of step 10 (4 of 6
    # runs of that test on 2026-12-04). The update now runs in the wrapper's atomic section
    # (2026-12-05), which should close it; the allowance stays until a fast host confirms.
    steps = [e["step"] for e in losses]
    assert sorted(set(steps)) == list(range(1, STEPS + 1)), _resumes(out)
    assert steps == list(range(1, STEPS + 1)) or (
        steps == [*range(1, 12), *range(11, STEPS + 1)]
        and "the training state after step 11 is not kept" in out), _resumes(out)


def _resumes(out: str) -> list[str]:
    """The log lines that say where each attempt resumed from and what was kept in memory."""
    return [ln for ln in out.splitlines()
            if "resumed from" in ln or "training state" in ln or "ended by" in ln]


@pytest.mark.long
def test_a_rank_blocked_past_twice_the_soft_timeout_still_resumes_from_the_state_at_the_fault(
    tmp_path: Path,
) -> None:
    """Step 12 blocks the main thread in one C call for 11 s, with a 4 s soft timeout: NVRx's
    monitor thread raises its restart, waits the soft timeout for the main thread to reach the
    wrapper, then raises again and again until it does, so that further exceptions can land in
    the attempt's own handlers once the call returns. The training state after step 11 must
    still be offered and kept: the offer is made at the wrapper's finalize step, where none can
    land (checkpoint.expect_offer), and the next attempt resumes from step 11 in memory with no
    step computed twice. (An offer made from the attempt's exception handler can be cut short
    there; that is a race of a few milliseconds, which this test does not force: the old code
    passed it on a quiet machine. The unit tests check the finalize-step offer itself.)

    In the `long` tier since 2026-12-04: on a faster 2-core host it failed 4 of 14 runs (and 4 of
    6 with the trainer before that day's changes) with
    "the training state after step 11 is not kept (no step done, or the optimizer was
    updating)", the attempt resuming from the save of step 10 instead (correct, one step
    computed twice). The cause, read in NVRx 0.7.0 (inprocess/monitor_thread.py,
    progress_watchdog.py): the restart takes the wrapper's atomic lock at once, but raises into
    the main thread only after the progress watchdog synchronized with it, which needs the main
    thread to run Python again; once the C call returns, the main thread has a head start of
    up to a watchdog poll (5 ms), enough on a fast host to enter step 12's update. Since
    2026-12-05 the update runs inside the atomic section (parallel.train_step `update_guard`),
    so it meets the held lock and the exception lands before the update (unit test
    test_trainer_live_state). Not reproduced on the slower host where that was written, old
    code or new (6 of 6 runs each): the fix is checked by the unit test and by reading."""
    out = _run(tmp_path, faults="12:0:stall=11",
               extra_env={"RTJ_INPROCESS_RESTART": "1", "RTJ_HEARTBEAT_TIMEOUT_SECONDS": "60",
                          "RTJ_NPROC_PER_NODE": "1"},
               args=("--set", "resiliency.inprocess_soft_timeout_seconds=4"))
    losses = _losses(tmp_path)
    assert len({e["pid"] for e in losses}) == 1, _resumes(out)  # restarted in its process
    assert _summary(out)["restarts"] == {"inprocess": 1, "launcher": 0, "pod": 0}, _resumes(out)
    assert "kept the training state after step 11 in memory" in out, _resumes(out)
    assert [e["step"] for e in losses] == list(range(1, STEPS + 1)), _resumes(out)


@pytest.mark.long
def test_a_finished_job_is_not_taken_for_a_hang_on_its_way_out(tmp_path: Path) -> None:
    """After the last step's checkpoint is committed the worker still has work that runs no
    Python for seconds (deleting GBs of node-local copies, unpinning the staging buffer, NVRx's
    completion barrier). A fault one step past the last (`31:0:stall=8`, faults.py) blocks the
    main thread for 8 s there, with a 4 s in-process soft timeout: the job ends at once, with no
    in-process restart and one summary (Session.training_finished switches the wrapper's timeouts
    off). With them on, a 1B job on one H200 was restarted in place at its end and finished
    through one more attempt."""
    out = _run(tmp_path, faults=f"{STEPS + 1}:0:stall=8",
               extra_env={"RTJ_INPROCESS_RESTART": "1", "RTJ_HEARTBEAT_TIMEOUT_SECONDS": "60",
                          "RTJ_NPROC_PER_NODE": "1"},
               args=("--set", "resiliency.inprocess_soft_timeout_seconds=4"))
    assert f"injecting fault stall at step {STEPS + 1}" in out
    assert "Interruption.SOFT_TIMEOUT" not in out, _resumes(out)
    summaries = [ln for ln in out.splitlines() if ln.startswith('{"event": "summary"')]
    assert len(summaries) == 1, summaries
    summary = json.loads(summaries[0])
    assert summary["restarts"] == {"inprocess": 0, "launcher": 0, "pod": 0}, summary
    assert summary["steps"] == STEPS and summary["last_committed_step"] == STEPS
    assert [e["step"] for e in _losses(tmp_path)] == list(range(1, STEPS + 1))


def test_inprocess_restart_stops_a_writer_that_is_still_writing(
    tmp_path: Path, fault_free: dict[int, float]
) -> None:
    """Writes take 2 s, so rank 1's writer is still writing the step-10 save when rank 1 fails at
    step 11: the training state after step 10 is staged into the same buffer, so that writer is
    stopped (not kept) and a new one starts. The step-10 save is never committed, yet every rank
    holds the state after step 10 in its staging buffer: the job resumes from step 10 from
    memory, not from the step-5 commit."""
    out = _run(tmp_path, faults="11:1:exception",
               extra_env={"RTJ_INPROCESS_RESTART": "1", "RTJ_HEARTBEAT_TIMEOUT_SECONDS": "60"},
               args=("--set", "checkpoint.test_write_delay_seconds=2"))
    assert _summary(out)["restarts"] == {"inprocess": 1, "launcher": 0, "pod": 0}
    assert "resumed from step-000000010" in out and "from the training state at the fault" in out
    assert [e["step"] for e in _losses(tmp_path)] == list(range(1, STEPS + 1))
    _assert_same_losses(_losses(tmp_path), fault_free)
    # Rank 1 failed mid-write: its writer was stopped and a new one started. Rank 0 learns of
    # the failure later (NVRx's monitor; seconds on a loaded machine), when its 2 s write may
    # have finished: then its writer is idle and kept. Each replaced writer started once more.
    lines = out.splitlines()
    stopped = [ln for ln in lines if "checkpoint writer stopped: a write was in flight" in ln]
    kept = [ln for ln in lines if "checkpoint writer kept for the next attempt" in ln]
    assert any("rank 1]" in ln for ln in stopped), (stopped, kept)
    assert len(stopped) + len(kept) == 2, (stopped, kept)
    started = [ln for ln in lines if "checkpoint writer process" in ln]
    assert len(started) == 2 + len(stopped), (started, stopped)


def _free_port() -> int:
    return free_port_block(2)  # local rank 1 serves on the next port


def _scrape(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url, timeout=2).read().decode()
    values = {}
    for line in text.splitlines():
        if line.startswith("rtj_trainer_") and 'rank="' in line:
            name = line.split("{")[0]
            values.setdefault(name, float(line.rsplit(" ", 1)[1]))
            if name == "rtj_trainer_heartbeat_timestamp_seconds":
                assert 'rank="' in line and 'local_rank="' in line
    return values


def test_metrics_endpoint_shows_heartbeats_and_steps_advancing(tmp_path: Path) -> None:
    port = _free_port()
    proc = _start(tmp_path, extra_env={"RTJ_METRICS_PORT": str(port)},
                  args=("--set", "train.steps=400", "--set", "checkpoint.interval_steps=50"))
    samples: list[dict[str, float]] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(samples) < 2:
            try:
                sample = _scrape(f"http://127.0.0.1:{port + 1}/metrics")  # local rank 1
            except OSError:
                time.sleep(0.2)
                continue
            if sample.get("rtj_trainer_step", 0) >= 1 and (
                not samples or sample["rtj_trainer_step"] > samples[0]["rtj_trainer_step"] + 5
            ):
                samples.append(sample)
            time.sleep(0.2)
    finally:
        out = _finish(proc, 180)
    assert len(samples) == 2, out[-3000:]
    first, second = samples
    assert second["rtj_trainer_step"] > first["rtj_trainer_step"]
    assert (second["rtj_trainer_heartbeat_timestamp_seconds"]
            > first["rtj_trainer_heartbeat_timestamp_seconds"] > 0)
    for name in ("rtj_trainer_step_seconds", "rtj_trainer_tokens_per_second",
                 "rtj_trainer_checkpoint_committed_step", "rtj_trainer_restarts_total",
                 "rtj_trainer_productive_seconds_total", "rtj_trainer_lost_seconds_total",
                 "rtj_trainer_goodput_ratio", "rtj_trainer_info",
                 "rtj_trainer_checkpoint_stall_seconds", "rtj_trainer_checkpoint_write_seconds",
                 "rtj_trainer_checkpoint_committed_timestamp_seconds"):
        assert name in second, name
    assert _summary(out)["steps"] == 400


def test_launcher_kill_takes_down_the_whole_process_tree(tmp_path: Path) -> None:
    # A local run, where ft_launcher is an ordinary process. In a real container it is PID 1 and
    # ignores a SIGKILL sent from inside its PID namespace, so this fault is harness-only.
    import psutil

    proc = _start(tmp_path, faults="10:1:launcher-kill")
    try:
        out, _ = proc.communicate(timeout=240)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == -signal.SIGKILL, out[-3000:]  # the launcher itself was killed
    assert "injecting fault launcher-kill at step 10" in out
    rank0_pid = _losses(tmp_path)[-1]["pid"]
    deadline = time.monotonic() + 10
    while psutil.pid_exists(rank0_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not psutil.pid_exists(rank0_pid) or psutil.Process(rank0_pid).status() == "zombie"


def test_a_fatal_error_stops_ft_launcher_at_once_with_the_no_restart_code(tmp_path: Path) -> None:
    """A bad configuration: the workers exit 94, the shim stops the restarts (a 3-restart
    budget is left untouched: no second rendezvous cycle) and ft_launcher exits 93; the
    termination message names the reason. The first worker to exit makes the shim stop the
    other, which on a loaded machine may not have printed its own line yet: one or two."""
    message_file = tmp_path / "termination-log"
    proc = _start(tmp_path, extra_env={"RTJ_TERMINATION_MESSAGE_PATH": str(message_file),
                                       "RTJ_MAX_RESTARTS": "3"},
                  args=("--set", "data.kind=memmap"))
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 93, out[-4000:]
    assert out.count("rtj_trainer: fatal (ConfigurationError)") in (1, 2), out[-4000:]
    assert "Cycle: 0 Event: rendezvous_completed" in out, out[-4000:]
    assert "Cycle: 1 Event" not in out, out[-4000:]  # no restart
    message = json.loads(message_file.read_text())
    assert message["outcome"] == "Failed" and message["exitCode"] == 94
    assert message["reason"] == "ConfigurationError" and "data.path" in message["message"]


def _run_and_stop(tmp_path: Path, env: dict[str, str]) -> tuple[str, int]:
    """Start a run, SIGTERM the launcher after step 8 and check that the workers committed the
    step they stopped at and exited 0; the output and that step. The signal goes to the launcher
    alone (train-local.sh execs it), as a container runtime sends it to a container's main
    process: sent to the launcher's whole process group it would reach ft_launcher's rank
    monitors too, which close at once, before the launcher asks the workers to stop, and the
    workers' next heartbeat then fails (what made this test fail in CI)."""
    message_file = tmp_path / "termination-log"
    env = {"RTJ_TERMINATION_MESSAGE_PATH": str(message_file), **env}
    proc = _start(tmp_path, extra_env=env)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            losses = (tmp_path / "losses.jsonl")
            if losses.exists() and len(losses.read_text().splitlines()) >= 8:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the run ended before it could be stopped"
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-6000:]
    message = json.loads(message_file.read_text())
    stopped_at: int = _losses(tmp_path)[-1]["step"]
    assert 8 <= stopped_at < STEPS
    assert message["outcome"] == "Stopped" and message["reason"] == "CheckpointedBeforeStop"
    assert message["step"] == message["committedStep"] == stopped_at, message
    assert f"stopped after step {stopped_at}: checkpoint of step {stopped_at} committed" in out
    assert "every rank was asked to stop" in out
    commits = [json.loads(line)["step"]
               for line in (tmp_path / "commits.jsonl").read_text().splitlines()]
    assert commits[-1] == stopped_at
    message_file.unlink()
    return out, stopped_at


def test_sigterm_commits_the_current_step_and_the_next_run_resumes_from_it(
    tmp_path: Path, fault_free: dict[int, float]
) -> None:
    """What the harness kubelet does to a pod that is deleted (a suspend, a preemption, a
    drain): SIGTERM to the launcher's process group (rank monitors included). The launcher shim
    asks the workers to stop; they agree on a step, commit its checkpoint and exit 0 within the
    launcher's --term-timeout (40 s here: room for a loaded machine). The next run resumes from
    exactly that step, and it is a resume, not a restart."""
    message_file = tmp_path / "termination-log"
    env = {"RTJ_TERMINATION_MESSAGE_PATH": str(message_file),
           "RTJ_HEARTBEAT_TIMEOUT_SECONDS": "30", "RTJ_TERM_TIMEOUT_SECONDS": "40"}
    _, stopped_at = _run_and_stop(tmp_path, env)
    out = _run(tmp_path, extra_env=env)
    assert f"resumed from step-{stopped_at:09d}" in out
    losses = _losses(tmp_path)
    second = [e for e in losses if e["attempt"] != losses[0]["attempt"]]
    assert second[0]["step"] == stopped_at + 1  # no step lost, none recomputed
    assert [e["step"] for e in losses] == list(range(1, STEPS + 1))
    _assert_same_losses(losses, fault_free)
    summary = _summary(out)
    assert summary["restarts"] == {"inprocess": 0, "launcher": 0, "pod": 0}  # a resume
    assert json.loads(message_file.read_text())["outcome"] == "Succeeded"
    # Once more: it resumes at the last step and runs none, and still reports the final loss
    # (the checkpoint keeps it; before 2026-12-04 such a run said NaN).
    again = _run(tmp_path, extra_env=env)
    assert f"resumed from step-{STEPS:09d}" in again, again[-3000:]
    assert _summary(again)["attempt_steps"] == 0
    assert _summary(again)["final_loss"] == summary["final_loss"] == fault_free[STEPS]


WARM_WORKERS = {"RTJ_WARM_WORKERS": "1"}
_ATTACHED = re.compile(r"\[rtj-warm\] worker pid (\d+) runs in warm process (\d+)")


def _warm_workers_left(run_dir: Path, wait_seconds: float = 5.0) -> list[int]:
    """Warm workers (rtj_trainer.warm.worker) of this run still alive `wait_seconds` after the
    launcher's exit (idle ones die with it: PR_SET_PDEATHSIG). They lead their own sessions, so
    killing the launcher's process group would not end them."""
    deadline = time.monotonic() + wait_seconds
    while True:
        left = []
        for process in psutil.process_iter(["pid", "cmdline", "status"]):
            try:
                if (process.info["status"] != psutil.STATUS_ZOMBIE
                        and "rtj_trainer.warm.worker" in (process.info["cmdline"] or [])
                        and process.environ().get("RTJ_RUN_DIR") == str(run_dir)):
                    left.append(process.info["pid"])
            except psutil.Error:
                continue
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def test_warm_workers_replace_a_killed_worker_and_the_losses_are_unchanged(
    tmp_path: Path, fault_free: dict[int, float]
) -> None:
    """With RTJ_WARM_WORKERS=1 every worker runs in a warm process of the launcher's pool. Rank
    1's warm process SIGKILLs itself at step 8 (as its rank monitor would kill it): ft_launcher
    sees its worker die of SIGKILL, restarts the group, and the new workers attach to warm
    processes the pool started after the first ones were taken. The job finishes with the
    fault-free run's losses, and no warm process outlives the launcher."""
    out = _run(tmp_path, faults="8:1:sigkill", extra_env=WARM_WORKERS)
    summary = _summary(out)
    assert summary["restarts"] == {"inprocess": 0, "launcher": 1, "pod": 0}
    assert summary["last_committed_step"] == STEPS
    # The fault fired in rank 1 (its marker), and the launcher saw a worker of the group fail:
    # rank 1 dead of SIGKILL, or, when its monitor polled after rank 0 noticed the broken gloo
    # connection first, rank 0's error exit.
    assert sorted(p.name for p in (tmp_path / "faults").iterdir()) == ["step8-rank1-sigkill"]
    seen = re.findall(r"failed \(exitcode: (-?\d+)\) local_rank: (\d)", out)
    assert seen and seen[0] in (("-9", "1"), ("1", "0")), (
        seen, [ln for ln in out.splitlines() if "exitcode" in ln or "rtj-warm" in ln])
    attached = _ATTACHED.findall(out)
    assert len(attached) == 4, out[-6000:]  # both ranks, both attempts
    warm_pids = {int(warm) for _, warm in attached}
    assert len(warm_pids) == 4
    losses = _losses(tmp_path)
    assert {e["pid"] for e in losses} <= warm_pids  # rank 0's steps ran in warm processes
    assert max(e["step"] for e in losses) == STEPS
    _assert_same_losses(losses, fault_free)
    assert _warm_workers_left(tmp_path) == []


@pytest.mark.long
def test_warm_workers_checkpoint_and_stop_on_sigterm(
    tmp_path: Path, fault_free: dict[int, float]
) -> None:
    """The shim's stop signal reaches the warm process through the attach client (SIGUSR2 to
    the warm process only, not its checkpoint writer): the same checkpoint-then-stop as without
    warm workers, and both the client and the launcher exit 0."""
    env = {"RTJ_HEARTBEAT_TIMEOUT_SECONDS": "30", "RTJ_TERM_TIMEOUT_SECONDS": "40",
           **WARM_WORKERS}
    out, stopped_at = _run_and_stop(tmp_path, env)
    assert len(_ATTACHED.findall(out)) == 2, out[-6000:]
    losses = _losses(tmp_path)
    assert [e["step"] for e in losses] == list(range(1, stopped_at + 1))
    _assert_same_losses(losses, fault_free)
    assert _warm_workers_left(tmp_path) == []


def test_warm_workers_of_a_hugging_face_model_preload_its_modules(tmp_path: Path) -> None:
    """`--set model.hf_path=DIR`: the warm processes import transformers and the model's
    modeling module before a worker attaches (on an H200 those imports were 5 s of a SIGKILL
    restart's 11.9 s), and a SIGKILLed worker's replacement trains on from the checkpoint."""
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 4, "vocab_size": 300, "max_position_embeddings": 128}))
    run = tmp_path / "run"
    out = _run(run, faults="8:1:sigkill", extra_env=WARM_WORKERS,
               args=("--set", f"model.hf_path={model}", "--set", "model.seq_len=64"))
    preloads = re.findall(r"\[rtj-warm\] warm worker \d+ preloaded (.*)", out)
    assert len(preloads) >= 4, out[-4000:]  # two ranks, both attempts (and the pool's spares)
    assert all("transformers.models.llama.modeling_llama" in p for p in preloads)
    assert len(_ATTACHED.findall(out)) == 4
    summary = _summary(out)
    assert summary["restarts"]["launcher"] == 1 and summary["last_committed_step"] == STEPS

