"""Decision table: a trainer's termination message ends the job (rule 5), the final status is
the trainers' own (rule 6), and the CheckpointStale condition (issue 11, items 7-9)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from rtj_operator.api.vocabulary import Reason
from rtj_wire.termination import TerminationMessage
from unit.decisions_builders import (
    T0,
    beats,
    condition,
    deleted,
    events,
    job,
    rendezvous,
    running,
    running_world,
    then,
    trainer,
    world,
)

pytestmark = pytest.mark.unit

LATER = T0 + timedelta(seconds=60)
CONFIG = TerminationMessage(outcome="Failed", reason="ConfigurationError",
                        message="invalid trainer config: data.path is required", exit_code=94)


def test_a_fatal_message_fails_the_job_at_once_while_the_other_pod_still_runs() -> None:
    j = job()
    two = then(running(j), j, world(trainer(0), trainer(1, "Failed", exit_code=93,
                                                        outcome=CONFIG), rdzv=rendezvous()),
               now=LATER)
    assert two.status["state"] == "Failed"
    assert two.status["reason"] == Reason.TRAINER_FATAL
    assert "tiny-1" in two.status["message"] and "ConfigurationError" in two.status["message"]
    assert "data.path is required" in two.status["message"]
    failed = condition(two, "Failed")
    assert failed["status"] == "True" and failed["reason"] == "TrainerFatalError"
    assert "data.path is required" in failed["message"]
    assert sorted(deleted(two)) == ["tiny-0", "tiny-rdzv"]
    assert events(two).count("TrainerFatalError") == 1
    assert two.status["restarts"]["rank"] == 0 and two.status["restarts"]["full"] == 0


@pytest.mark.parametrize(("outcome", "codes", "reason", "said"), [
    # A worker's code listed in nonRetryableExitCodes, reported by the launcher shim.
    (TerminationMessage(outcome="Failed", reason="NonRetryableExitCode", exit_code=42,
                    message="worker rank 3 exited with code 42"), [42],
     Reason.NON_RETRYABLE, "exited with code 42, which is listed in nonRetryableExitCodes"),
    # The trainer's own fatal code is a TrainerFatalError even when the user lists 94.
    (CONFIG, [94], Reason.TRAINER_FATAL, "reported ConfigurationError"),
    # A message without a reason still ends the job.
    (TerminationMessage(outcome="Failed"), [], Reason.TRAINER_FATAL, "reported a fatal error"),
])
def test_failed_messages_end_the_job(outcome: TerminationMessage, codes: list[int], reason: Reason,
                                     said: str) -> None:
    j = job(faultTolerance={"nonRetryableExitCodes": codes})
    two = then(running(j), j, world(trainer(0, "Failed", exit_code=93, outcome=outcome),
                                    trainer(1), rdzv=rendezvous()), now=LATER)
    assert (two.status["state"], two.status["reason"]) == ("Failed", reason)
    assert said in two.status["message"]


@pytest.mark.parametrize("code", [93, 94])
def test_the_launchers_and_the_trainers_codes_are_never_retried(code: int) -> None:
    j = job()
    two = then(running(j), j, world(trainer(0, "Failed", exit_code=code), trainer(1),
                                    rdzv=rendezvous()), now=LATER)
    assert two.status["reason"] == Reason.NON_RETRYABLE


def test_a_bare_no_restart_exit_waits_for_the_peer_that_caused_it() -> None:
    """Every launcher exits 93 after one worker's fatal error (rtj_trainer.launcher); only the
    pod of that worker has the reason. A peer's bare 93 seen first neither fails the job as
    NonRetryableExitCode nor counts as a pod failure: the pass waits for the other pod."""
    j = job()
    soon = T0 + timedelta(seconds=35)  # 5 s after the peer's launcher exited
    one = then(running(j), j, world(trainer(0), trainer(1, "Failed", exit_code=93),
                                    rdzv=rendezvous()), now=soon)
    assert one.status["state"] not in ("Failed", "Succeeded")
    assert one.status["restarts"]["rank"] == 0 and not deleted(one)
    assert "NonRetryableExitCode" not in events(one)
    two = then(one, j, world(trainer(0, "Failed", exit_code=93, outcome=CONFIG),
                             trainer(1, "Failed", exit_code=93), rdzv=rendezvous()),
               now=soon + timedelta(seconds=2))
    assert (two.status["state"], two.status["reason"]) == ("Failed", Reason.TRAINER_FATAL)
    assert "tiny-0" in two.status["message"] and "data.path is required" in two.status["message"]


def test_a_bare_no_restart_exit_ends_the_job_once_every_pod_ended_or_the_grace_ran_out() -> None:
    j = job()
    ended = then(running(j), j, world(trainer(0, "Failed", exit_code=93),
                                      trainer(1, "Failed", exit_code=93), rdzv=rendezvous()),
                 now=T0 + timedelta(seconds=31))
    assert (ended.status["state"], ended.status["reason"]) == ("Failed", Reason.NON_RETRYABLE)
    late = then(running(j), j, world(trainer(0), trainer(1, "Failed", exit_code=93),
                                     rdzv=rendezvous()), now=T0 + timedelta(seconds=46))
    assert (late.status["state"], late.status["reason"]) == ("Failed", Reason.NON_RETRYABLE)


def test_a_succeeded_message_does_not_end_a_running_job() -> None:
    j = job()
    done = TerminationMessage(outcome="Succeeded", step=80, committed_step=80, exit_code=0)
    two = then(running(j), j, world(trainer(0, "Succeeded", exit_code=0, outcome=done),
                                    trainer(1), rdzv=rendezvous()), now=LATER)
    assert two.status["state"] not in ("Failed", "Succeeded")


def test_the_final_step_and_checkpoint_are_the_trainers_not_the_last_scrape() -> None:
    j = job()
    one = running(j)  # the last scrape saw step 10, nothing committed
    said = [TerminationMessage(outcome="Succeeded", step=75, committed_step=70,
                           committed_time=(T0 + timedelta(seconds=50)).timestamp(), exit_code=0),
            TerminationMessage(outcome="Succeeded", step=75, committed_step=70,
                           committed_time=(T0 + timedelta(seconds=50)).timestamp(), exit_code=0)]
    two = then(one, j, world(*(trainer(i, "Succeeded", exit_code=0, outcome=said[i])
                               for i in range(2)), rdzv=rendezvous()), now=LATER)
    assert two.status["state"] == "Succeeded"
    assert two.status["step"] == 75
    assert two.status["lastCheckpoint"] == {"step": 70, "time": "2026-11-29T12:00:50Z"}


def test_without_messages_the_final_checkpoint_is_the_evidence() -> None:
    j = job()
    now = T0 + timedelta(seconds=30)
    one = then(running(j), j, running_world(), now=now, liveness=beats(now, step=70,
                                                                        committed=80))
    two = then(one, j, world(trainer(0, "Succeeded", exit_code=0),
                             trainer(1, "Succeeded", exit_code=0), rdzv=rendezvous()), now=LATER)
    assert two.status["step"] == 80
    assert two.status["lastCheckpoint"]["step"] == 80


# --- CheckpointStale ----------------------------------------------------------------------------


@pytest.mark.parametrize(("step", "committed", "stale"), [
    (30, None, False),   # 30 steps, nothing committed: exactly 3 x 10, not more
    (31, None, True),    # more than 3 intervals without any checkpoint
    (70, 40, False),
    (71, 40, True),
    (71, 70, False),
])
def test_checkpoint_stale_when_the_step_runs_more_than_n_intervals_ahead(
    step: int, committed: int | None, stale: bool
) -> None:
    j = job(checkpoint={"claimName": "ckpt", "intervalSteps": 10, "staleAfterIntervals": 3})
    now = T0 + timedelta(seconds=40)
    two = then(running(j), j, running_world(), now=now,
               liveness=beats(now, step=step, committed=committed))
    stale_condition = condition(two, "CheckpointStale")
    assert stale_condition["status"] == ("True" if stale else "False")
    assert stale_condition["reason"] == ("CheckpointStale" if stale else "CheckpointCurrent")
    assert ("CheckpointStale" in events(two)) == stale
    if stale:
        assert f"step {step} is {step - (committed or 0)} steps past" in stale_condition["message"]


def test_checkpoint_stale_flips_back_when_a_commit_catches_up_with_one_event_each_way() -> None:
    j = job(checkpoint={"claimName": "ckpt", "intervalSteps": 10, "staleAfterIntervals": 2})
    at = [T0 + timedelta(seconds=40 + 10 * n) for n in range(4)]
    one = then(running(j), j, running_world(), now=at[0], liveness=beats(at[0], step=25))
    assert condition(one, "CheckpointStale")["status"] == "True"
    two = then(one, j, running_world(), now=at[1], liveness=beats(at[1], step=26))
    assert condition(two, "CheckpointStale")["status"] == "True"
    assert "CheckpointStale" not in events(two)  # no new Event while it stays stale
    three = then(two, j, running_world(), now=at[2], liveness=beats(at[2], step=30,
                                                                     committed=30))
    assert condition(three, "CheckpointStale")["status"] == "False"
    assert "CheckpointCurrent" in events(three)
    four = then(three, j, running_world(), now=at[3], liveness=beats(at[3], step=31,
                                                                     committed=30))
    assert "CheckpointCurrent" not in events(four)
