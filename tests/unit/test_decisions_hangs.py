"""Rule 7, finding hangs (`decisions/hangs.py`): ranks from the pods and the scrapes,
heartbeat and progress timeouts.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta

import pytest
from rtj_operator.api.vocabulary import IncidentCause, Reason
from rtj_operator.decisions.hangs import completed_step, oldest_heartbeat, renewed_deadline
from rtj_operator.intents import DeletePod
from rtj_operator.observed import NodeLiveness, RankSample
from unit.decisions_builders import (
    T0,
    Outcome,
    answering,
    beats,
    condition,
    decide,
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


def test_running_pods_without_heartbeats_wait_for_them() -> None:
    j = job()
    first = decide(j, world())
    second = then(first, j, running_world(), now=T0 + timedelta(seconds=10))
    assert [r["state"] for r in second.status["ranks"]] == ["Starting", "Starting"]
    assert second.status["reason"] == Reason.STARTING
    assert condition(second, "Ready")["status"] == "False"


def test_a_job_is_running_once_every_rank_heartbeats() -> None:
    now = T0 + timedelta(seconds=30)
    first = decide(job(), world())
    decision = then(first, job(), running_world(), now=now,
                    liveness=beats(now, step=42, committed=40, goodput=0.931))
    status = decision.status
    assert status["state"] == "Running"
    assert status["nodes"] == "2/2" and status["nodesReady"] == 2
    assert status["step"] == 42
    assert status["lastCheckpoint"] == {"step": 40, "time": "2026-11-29T12:00:30Z"}
    assert status["goodput"] == "93.1%"
    assert condition(decision, "Running")["status"] == "True"
    assert condition(decision, "Ready")["status"] == "True"
    assert condition(decision, "Ready")["observedGeneration"] == 3
    assert [r["state"] for r in status["ranks"]] == ["Running", "Running"]
    assert status["ranks"][1]["node"] == "node-1"
    assert "Running" in events(decision)


def test_a_rank_missing_one_local_rank_is_not_ready() -> None:
    now = T0 + timedelta(seconds=30)
    live = beats(now)
    live[1] = replace(live[1], samples=live[1].samples[:1])
    first = decide(job(), world())
    decision = then(first, job(), running_world(), now=now, liveness=live)
    assert decision.status["nodes"] == "1/2"
    assert decision.status["state"] == "Pending"


def test_a_rank_without_heartbeat_past_both_timeouts_is_replaced() -> None:
    j = job()
    one = running(j)  # heartbeats at T0+30
    now = T0 + timedelta(seconds=30 + 20 + 60 + 1)
    live = beats(now)
    live[1] = beats(T0 + timedelta(seconds=30))[1]  # node 1 stuck at its old heartbeat
    two = then(one, j, running_world(), now=now, liveness=live)
    assert deleted(two) == ["tiny-1"]
    assert two.status["incidents"][-1]["cause"] == IncidentCause.HEARTBEAT_TIMEOUT


def test_a_stale_heartbeat_within_the_launcher_grace_is_left_to_ft_launcher() -> None:
    j = job()
    one = running(j)
    now = T0 + timedelta(seconds=30 + 70)
    live = beats(now)
    live[1] = beats(T0 + timedelta(seconds=30))[1]
    two = then(one, j, running_world(), now=now, liveness=live)
    assert two.of_type(DeletePod) == []
    assert two.status["nodes"] == "1/2"


def test_a_pod_that_cannot_be_read_is_never_hung_and_degrades_observation() -> None:
    # "Could not observe" is not "hung": node 0's endpoint stops answering (an overloaded
    # operator, a slow network). No restart however long; after heartbeatTimeoutSeconds (20 s)
    # of silence the job says so in ObservationDegraded (and one Warning Event).
    j = job()
    one = running(j)  # heartbeats at T0+30
    passes = []
    previous = one
    for seconds in (40, 55, 300, 3000):
        now = T0 + timedelta(seconds=seconds)
        live = {1: beats(now, step=seconds)[1]}  # node 1 answers and trains on
        previous = then(previous, j, running_world(), now=now, liveness=live)
        passes.append(previous)
    assert all(p.of_type(DeletePod) == [] for p in passes)
    assert [condition(p, "ObservationDegraded")["status"] for p in passes] == [
        "False", "False", "True", "True"]
    assert "tiny-0" in condition(passes[2], "ObservationDegraded")["message"]
    assert [events(p).count("ObservationDegraded") for p in passes] == [0, 0, 1, 0]
    # It answers again: the condition clears.
    now = T0 + timedelta(seconds=3003)
    back = then(previous, j, running_world(), now=now, liveness=beats(now, step=3003))
    assert condition(back, "ObservationDegraded")["status"] == "False"
    assert back.of_type(DeletePod) == []


def _silent_pods_job(
    nodes: int, silent: set[int], answering_beat: int, silence: int
) -> tuple[Outcome, Outcome]:
    """A job of `nodes` pods that heartbeat at T0+30; from T0+40 on the `silent` pods' endpoints
    do not answer, and the others answer with a heartbeat at T0+`answering_beat`. Returns the
    first silent pass and the pass `silence` seconds later."""
    j = job(nodes=nodes)
    pods = world(*(trainer(i) for i in range(nodes)), rdzv=rendezvous())
    one = then(decide(j, pods), j, pods, now=T0 + timedelta(seconds=30),
               liveness=beats(T0 + timedelta(seconds=30), pods=pods))

    def heard(now: datetime) -> dict[int, NodeLiveness]:
        live = beats(T0 + timedelta(seconds=answering_beat), pods=pods)
        return {i: n for i, n in live.items() if i not in silent}

    start = T0 + timedelta(seconds=40)
    two = then(one, j, pods, now=start, liveness=heard(start))
    end = start + timedelta(seconds=silence)
    return two, then(two, j, pods, now=end, liveness=heard(end))


@pytest.mark.parametrize(
    ("nodes", "silent", "answering_beat", "silence", "blamed", "degraded"),
    [
        # A minority silent in a stuck job (the others answer, their heartbeats stale): the
        # silent pods are blamed once silent past 20 + 60 s, never the ones waiting for them.
        (2, {1}, 30, 81, ["tiny-1"], "False"),
        (4, {2}, 30, 81, ["tiny-2"], "False"),
        (4, {0, 3}, 30, 81, ["tiny-0", "tiny-3"], "False"),  # half answer: still a minority
        # Silent for less: nobody yet, although the answering pods' heartbeats are already
        # older than 80 s (they only wait for the silent one).
        (2, {1}, 30, 75, [], "False"),
        # The others beat: the job trains, the silent pod takes part: the operator only cannot
        # read it (ObservationDegraded), never a restart.
        (2, {1}, 40 + 3000, 3000, [], "True"),
        # Widespread silence (none, or fewer than half, answer): an observation outage.
        (2, {0, 1}, 30, 3000, [], "True"),
        (3, {0, 1}, 40 + 3000 - 30, 3000, [], "True"),
        (4, {0, 1, 2}, 40 + 3000 - 30, 3000, [], "True"),
    ],
)
def test_silence_is_evidence_against_a_minority_of_silent_pods_in_a_stuck_job(
    nodes: int, silent: set[int], answering_beat: int, silence: int, blamed: list[str],
    degraded: str
) -> None:
    first, last = _silent_pods_job(nodes, silent, answering_beat, silence)
    assert first.of_type(DeletePod) == []
    assert sorted(deleted(last)) == blamed
    assert condition(last, "ObservationDegraded")["status"] == degraded
    for incident in last.status["incidents"]:
        assert incident["cause"] == IncidentCause.HEARTBEAT_TIMEOUT
        assert "stopped answering" in incident["message"]
    assert len(last.status["incidents"]) == len(blamed)  # one incident per blamed pod
    assert last.status["restarts"]["full"] == 0


def test_a_silent_single_pod_job_is_hung_after_twice_both_timeouts_and_keeps_its_node() -> None:
    # Review F13: with `nodes: 1` no pod answers, so the outage rule alone would never blame a
    # pod whose endpoint froze while its kubelet says Ready. It is blamed after 2 x (20 + 60) s
    # of silence (the operator cannot tell its own network trouble from a frozen pod); until
    # then the job shows ObservationDegraded. The evidence is weak: its node is not excluded.
    first, before = _silent_pods_job(1, {0}, 30, 159)
    assert first.of_type(DeletePod) == [] and before.of_type(DeletePod) == []
    assert condition(before, "ObservationDegraded")["status"] == "True"
    assert "incidents" not in before.status or before.status["incidents"] == []
    # A read of the pod is due when its silence reaches the bar (T0+40 + 160 s).
    assert before.decision.recheck == {0: T0 + timedelta(seconds=40 + 160)}
    _, after = _silent_pods_job(1, {0}, 30, 161)
    assert "tiny-0" in deleted(after)
    (incident,) = after.status["incidents"]
    assert incident["cause"] == IncidentCause.HEARTBEAT_TIMEOUT
    assert "stopped answering 161 s ago" in incident["message"]
    assert "single-pod job" in incident["message"]
    assert "= 160 s" in incident["message"]
    assert "excludedNodes" not in after.status
    assert "NodeExcluded" not in events(after)
    assert condition(after, "ObservationDegraded")["status"] == "False"


def test_a_job_whose_every_pod_is_silent_is_still_an_outage_past_the_single_pod_bar() -> None:
    # Two silent pods: nothing tells the operator's trouble from theirs, and the single-pod
    # rule does not apply: no hang, however long, only ObservationDegraded.
    for seconds in (161, 3000):
        _, last = _silent_pods_job(2, {0, 1}, 30, seconds)
        assert last.of_type(DeletePod) == []
        assert condition(last, "ObservationDegraded")["status"] == "True"
        assert last.decision.recheck == {}


def test_a_pod_that_answers_with_a_stale_heartbeat_is_hung_after_silence() -> None:
    # The evidence that counts: the pod answers, its rank's own heartbeat is old. A silence
    # before it does not hide the hang once the pod answers again.
    j = job()
    one = running(j)
    two = then(one, j, running_world(), now=T0 + timedelta(seconds=100),
               liveness={1: beats(T0 + timedelta(seconds=100))[1]})
    assert two.of_type(DeletePod) == []
    now = T0 + timedelta(seconds=30 + 81)
    live = beats(now)
    live[0] = beats(T0 + timedelta(seconds=30))[0]  # node 0 answers: its heartbeat is at +30
    three = then(two, j, running_world(), now=now, liveness=live)
    assert deleted(three) == ["tiny-0"]


@pytest.mark.parametrize(
    ("answered", "beat_age", "hung"),
    [
        # answered?  heartbeat age (s; None: never beat)  declared hung?
        (True, 10, False),     # fresh
        (True, 70, False),     # stale, within heartbeatTimeout + initialHeartbeatTimeout (80)
        (True, 81, True),      # stale past both: evidence
        (True, None, True),    # answers, no rank ever beat, 81 s after the pods started
        (False, 81, False),    # silent with an old heartbeat: no evidence
        (False, None, False),  # silent and never beat: no evidence
    ],
)
def test_a_hang_is_declared_only_on_evidence(
    answered: bool, beat_age: int | None, hung: bool
) -> None:
    j = job()
    first = decide(j, world())
    now = T0 + timedelta(seconds=81)
    live = beats(now)
    if beat_age is not None:
        live[1] = beats(now - timedelta(seconds=beat_age))[1]
    else:
        live[1] = answering()[1]
    if not answered:
        del live[1]
    second = then(first, j, running_world(), now=now, liveness=live)
    assert (deleted(second) == ["tiny-1"]) is hung
    assert all(d.name == "tiny-1" for d in second.of_type(DeletePod))


def test_a_pod_that_never_heartbeats_times_out_after_start() -> None:
    # Its endpoint answers (the launcher runs) but no rank ever sent a heartbeat.
    j = job()
    first = decide(j, world())
    two = then(first, j, running_world(), now=T0 + timedelta(seconds=79), liveness=answering())
    assert two.of_type(DeletePod) == []
    three = then(two, j, running_world(), now=T0 + timedelta(seconds=81), liveness=answering())
    assert sorted(deleted(three)) == ["tiny-0", "tiny-1", "tiny-rdzv"]  # both: a full restart


def test_a_pod_pending_past_its_deadline_is_replaced_not_the_pod_waiting_for_it() -> None:
    # Review C7: a pod Pending for ever used to switch every check off. Its deadline
    # (podStartTimeoutSeconds) comes before the survivor's heartbeat timeout (20 + 60 s here).
    j = job(faultTolerance={"podStartTimeoutSeconds": 70})
    first = decide(j, world())
    pending = world(trainer(0), trainer(1, "Pending"), rdzv=rendezvous())
    within = then(first, j, pending, now=T0 + timedelta(seconds=65))
    assert within.of_type(DeletePod) == []
    late = then(within, j, pending, now=T0 + timedelta(seconds=3000))
    assert deleted(late) == ["tiny-1"]
    assert late.status["incidents"][-1]["cause"] == IncidentCause.POD_START_TIMEOUT


def test_a_stalled_step_restarts_the_job() -> None:
    j = job()
    one = running(j)  # step 10 at T0+30
    mid = T0 + timedelta(seconds=100)
    two = then(one, j, running_world(), now=mid, liveness=beats(mid, step=10))
    assert two.of_type(DeletePod) == []
    now = T0 + timedelta(seconds=30 + 121)
    three = then(two, j, running_world(), now=now, liveness=beats(now, step=10))
    assert sorted(deleted(three)) == ["tiny-0", "tiny-1", "tiny-rdzv"]
    assert three.status["incidents"][-1]["cause"] == IncidentCause.PROGRESS_TIMEOUT


def test_an_advancing_step_is_not_a_stall() -> None:
    j = job()
    one = running(j)
    now = T0 + timedelta(seconds=30 + 121)
    two = then(one, j, running_world(), now=now, liveness=beats(now, step=11))
    assert two.of_type(DeletePod) == []


def test_a_single_lagging_node_is_replaced_alone_on_a_stall() -> None:
    j = job()
    one = running(j)
    now = T0 + timedelta(seconds=30 + 121)
    live = beats(now, step=12)
    live[1] = beats(now, step=10)[1]
    two = then(one, j, running_world(), now=now, liveness=live)
    assert deleted(two) == ["tiny-1"]


def test_a_node_is_known_only_when_every_rank_answered() -> None:
    one = RankSample(local_rank=0, heartbeat=10.0, step=5)
    two = RankSample(local_rank=1, heartbeat=12.0, step=4)
    assert completed_step(
        NodeLiveness(node_index=0, pod_uid="u", samples=(one, two), expected_ranks=2)) == 4
    full = NodeLiveness(node_index=0, pod_uid="u", samples=(one, two), expected_ranks=2)
    assert oldest_heartbeat(full) == 10.0
    half = NodeLiveness(node_index=0, pod_uid="u", samples=(one,), expected_ranks=2)
    assert oldest_heartbeat(half) is None and completed_step(half) is None


def test_the_progress_clock_survives_an_operator_restart() -> None:
    # review C8: progressTimeoutSeconds=120, the step frozen at 10, and the operator restarted
    # (fresh memory) every 100 s: the clock lives in the status, so the stall is still found.
    observed = running_world()
    status: dict[str, object] | None = None
    found = None
    for n in range(5):
        now = T0 + timedelta(seconds=100 * n)
        d = decide(job(status), observed, now=now, liveness=beats(now, step=10))
        incidents = d.status.get("incidents") or []
        if incidents:
            found = incidents[-1]
            break
        status = {k: v for k, v in d.status.items() if v is not None}
    assert found is not None and found["cause"] == "ProgressTimeout"
    assert status is not None and status["progressClock"]["step"] == 10  # type: ignore[index]


def starting(step: int = 0) -> dict[int, NodeLiveness]:
    """Every rank answers (its metrics endpoint is up) but has sent no heartbeat yet: it is
    still importing, building the model or loading the checkpoint."""
    return {index: replace(node, samples=tuple(replace(s, heartbeat=None, step=step)
                                               for s in node.samples))
            for index, node in beats(T0, step=step).items()}


def test_a_slow_start_is_not_a_stall_and_the_progress_clock_starts_at_the_first_heartbeats(
) -> None:
    # Found end to end: the ranks served step 0 from the start of their metrics endpoint, the
    # progress clock started then, and the first heartbeat after a start slower than
    # progressTimeoutSeconds (within initialHeartbeatTimeoutSeconds) was taken for a stall.
    j = job(faultTolerance={"initialHeartbeatTimeoutSeconds": 600})
    d = decide(j, world())
    for seconds in (10, 70, 130, 190):
        d = then(d, j, running_world(), now=T0 + timedelta(seconds=seconds), liveness=starting())
        assert d.of_type(DeletePod) == [], seconds
    first_beat = T0 + timedelta(seconds=200)
    d = then(d, j, running_world(), now=first_beat, liveness=beats(first_beat, step=0))
    assert d.of_type(DeletePod) == [] and not d.status.get("incidents")
    assert d.status["progressClock"]["step"] == 0
    assert d.status["progressClock"]["since"] == "2026-11-29T12:03:20Z"
    # A real stall from then on is still found, progressTimeoutSeconds after the first beats.
    before = first_beat + timedelta(seconds=119)
    d = then(d, j, running_world(), now=before, liveness=beats(before, step=0))
    assert d.of_type(DeletePod) == []
    after = first_beat + timedelta(seconds=121)
    d = then(d, j, running_world(), now=after, liveness=beats(after, step=0))
    assert sorted(deleted(d)) == ["tiny-0", "tiny-1", "tiny-rdzv"]
    assert d.status["incidents"][-1]["cause"] == IncidentCause.PROGRESS_TIMEOUT


# --- detection before action: Unresponsive -----------------------------------------------------


def _frozen(now: datetime, frozen_at: datetime, index: int = 1) -> dict[int, NodeLiveness]:
    """Every pod beats at `now` but pod `index`, whose heartbeat froze at `frozen_at`."""
    live = beats(now)
    live[index] = beats(frozen_at)[index]
    return live


def test_a_stale_heartbeat_is_published_at_the_heartbeat_timeout_and_acted_on_after_both() -> None:
    # heartbeatTimeoutSeconds 20, initialHeartbeatTimeoutSeconds 60: pod 1's heartbeat froze at
    # T0+30. Past 20 s it is Unresponsive (one HeartbeatStale Event, no action: ft_launcher
    # restarts its workers first); past 80 s it is replaced.
    j = job()
    one = running(j)
    frozen = T0 + timedelta(seconds=30)
    at_timeout = T0 + timedelta(seconds=30 + 20)
    still_fresh = then(one, j, running_world(), now=at_timeout,
                       liveness=_frozen(at_timeout, frozen))
    assert [r["state"] for r in still_fresh.status["ranks"]] == ["Running", "Running"]
    stale_at = at_timeout + timedelta(seconds=1)
    stale = then(still_fresh, j, running_world(), now=stale_at,
                 liveness=_frozen(stale_at, frozen))
    rank = stale.status["ranks"][1]
    assert (rank["state"], rank["unresponsiveSince"], rank["lastHeartbeatTime"]) == (
        "Unresponsive", "2026-11-29T12:00:51Z", "2026-11-29T12:00:30Z")
    assert stale.status["rankCounts"] == {"Running": 1, "Unresponsive": 1}
    assert events(stale).count("HeartbeatStale") == 1
    assert "tiny-1" in next(e.message for e in stale.events if e.reason == "HeartbeatStale")
    assert [r.node_index for r in stale.decision.unresponsive] == [1]
    assert stale.of_type(DeletePod) == [] and stale.status["nodes"] == "1/2"
    later_at = T0 + timedelta(seconds=30 + 60)
    later = then(stale, j, running_world(), now=later_at, liveness=_frozen(later_at, frozen))
    assert later.status["ranks"][1]["unresponsiveSince"] == "2026-11-29T12:00:51Z"
    assert "HeartbeatStale" not in events(later) and later.decision.unresponsive == []
    assert later.of_type(DeletePod) == []
    act_at = T0 + timedelta(seconds=30 + 80 + 1)
    acted = then(later, j, running_world(), now=act_at, liveness=_frozen(act_at, frozen))
    assert deleted(acted) == ["tiny-1"]
    assert acted.status["ranks"][1]["state"] == "Restarting"
    assert "unresponsiveSince" not in acted.status["ranks"][1]


def test_an_unresponsive_pod_that_beats_again_is_running_and_says_so() -> None:
    # ft_launcher restarted the workers in time: the heartbeat resumes, no pod is replaced.
    j = job()
    frozen = T0 + timedelta(seconds=30)
    stale_at = T0 + timedelta(seconds=55)
    stale = then(running(j), j, running_world(), now=stale_at,
                 liveness=_frozen(stale_at, frozen))
    assert stale.status["ranks"][1]["state"] == "Unresponsive"
    back_at = T0 + timedelta(seconds=70)
    back = then(stale, j, running_world(), now=back_at, liveness=beats(back_at))
    assert [r["state"] for r in back.status["ranks"]] == ["Running", "Running"]
    assert "unresponsiveSince" not in back.status["ranks"][1]
    assert events(back).count("HeartbeatResumed") == 1 and back.of_type(DeletePod) == []


def test_a_heartbeat_is_as_old_as_it_was_when_read_not_when_the_pass_runs() -> None:
    # A pass that reuses a read from 10 s ago: pod 1's heartbeat was 15 s old at its read,
    # 25 s at the pass. Measured at the read it is fresh (heartbeatTimeoutSeconds 20).
    j = job()
    beat_at = T0 + timedelta(seconds=30)
    now = T0 + timedelta(seconds=55)
    live = _frozen(now, beat_at)
    live[1] = replace(live[1], read_time=(beat_at + timedelta(seconds=15)).timestamp())
    decision = then(running(j), j, running_world(), now=now, liveness=live)
    assert [r["state"] for r in decision.status["ranks"]] == ["Running", "Running"]
    assert "HeartbeatStale" not in events(decision)
    # Read again now, it is stale.
    live[1] = replace(live[1], read_time=now.timestamp())
    decision = then(running(j), j, running_world(), now=now, liveness=live)
    assert decision.status["ranks"][1]["state"] == "Unresponsive"


def test_a_pod_that_does_not_answer_is_never_unresponsive() -> None:
    j = job()
    now = T0 + timedelta(seconds=30 + 50)
    live = {0: beats(now)[0]}  # pod 1's endpoint is silent for 50 s
    decision = then(running(j), j, running_world(), now=now, liveness=live)
    assert decision.status["ranks"][1]["state"] != "Unresponsive"
    assert "HeartbeatStale" not in events(decision) and decision.decision.unresponsive == []


def test_each_answering_pod_is_due_for_a_read_when_its_heartbeat_verdict_would_change() -> None:
    j = job()
    now = T0 + timedelta(seconds=30)
    fresh = running(j, now=now)  # both beat at T0+30
    assert fresh.decision.recheck == {0: now + timedelta(seconds=20),
                                      1: now + timedelta(seconds=20)}
    stale_at = T0 + timedelta(seconds=55)
    stale = then(fresh, j, running_world(), now=stale_at, liveness=_frozen(stale_at, now))
    assert stale.decision.recheck == {0: stale_at + timedelta(seconds=20),
                                      1: now + timedelta(seconds=80)}
    # No heartbeat since the pods started (T0): hung at clock + both timeouts.
    silent_start = then(decide(j, world()), j, running_world(), now=now,
                        liveness=answering())
    assert silent_start.decision.recheck == {0: T0 + timedelta(seconds=80),
                                             1: T0 + timedelta(seconds=80)}
    # Only a deadline that is a Running pod's heartbeat going stale may be moved by a quiet
    # read without a pass (`renewable`, with the heartbeat it is timed from): not pod 1's, stale
    # already, nor the deadlines of pods with no heartbeat since their clock started.
    assert fresh.decision.renewable == {0: now.timestamp(), 1: now.timestamp()}
    assert stale.decision.renewable == {0: stale_at.timestamp()}
    assert silent_start.decision.renewable == {}


def _read(at: datetime, beat: datetime, **changes: object) -> NodeLiveness:
    node = replace(beats(beat)[0], read_time=at.timestamp())
    return replace(node, **changes) if changes else node


def test_a_quiet_read_at_a_deadline_moves_it_only_when_no_verdict_can_change() -> None:
    """At 5,000 pods the healthy pods' deadlines come 500 a second; the job's loop moves one
    with no pass when the pod's read shows a newer heartbeat, fresh at the read, and nothing
    else new. Anything else goes to a pass."""
    before = _read(T0, T0)
    later = T0 + timedelta(seconds=20)
    renew = {"basis": T0.timestamp(), "timeout_seconds": 20.0, "builtin_trainer": True}
    fresh = _read(later, later - timedelta(seconds=1))
    assert renewed_deadline(before, fresh, **renew) == (later + timedelta(seconds=19)).timestamp()
    restarted = replace(fresh, samples=tuple(replace(s, restarts={"inprocess": 1})
                                             for s in fresh.samples))
    spare = replace(fresh, samples=tuple(replace(s, standby=True) for s in fresh.samples))
    needs_a_pass = {
        "no answer": None,
        "no earlier read": fresh,
        "the same heartbeat": _read(later, T0),
        "stale at its read": _read(later + timedelta(seconds=25), later - timedelta(seconds=1)),
        "a rank missing": replace(fresh, samples=fresh.samples[:1]),
        "finished": replace(fresh, finished=True),
        "another pod": replace(fresh, pod_uid="replacement"),
        "a restart counted": restarted,
        "a rank turned standby": spare,
    }
    for why, after in needs_a_pass.items():
        earlier = None if why == "no earlier read" else before
        assert renewed_deadline(earlier, after, **renew) is None, why


# --- the end of training: a pod whose workers all exited 0 ---------------------------------------


def _finished(now: datetime, finished_at: datetime, indexes: tuple[int, ...] = (1,),
              ) -> dict[int, NodeLiveness]:
    """Every pod beats at `now` but the pods in `indexes`, whose workers all exited 0 at
    `finished_at`: their endpoint keeps the last heartbeats and says `finished`."""
    live = beats(now, step=80)
    for index in indexes:
        live[index] = replace(beats(finished_at, step=80)[index], finished=True)
    return live


def test_a_pod_in_its_exit_barrier_is_finished_not_stale_nor_hung() -> None:
    # make demo, 2026-12-03: a survivor of a spare takeover waited 30 s in torchelastic's exit
    # barrier after its workers exited 0; its heartbeats went stale and the operator posted
    # HeartbeatStale and showed Pending. Its endpoint now says finished: the pod is done.
    j = job()
    done_at = T0 + timedelta(seconds=30)
    one = running(j, now=done_at)
    for seconds in (25, 81, 200):  # past heartbeatTimeoutSeconds, past both, long after
        now = done_at + timedelta(seconds=seconds)
        two = then(one, j, running_world(), now=now, liveness=_finished(now, done_at))
        assert [r["state"] for r in two.status["ranks"]] == ["Running", "Succeeded"]
        assert "HeartbeatStale" not in events(two) and two.decision.unresponsive == []
        assert two.of_type(DeletePod) == [] and two.decision.recheck.keys() == {0}
        assert two.status["state"] == "Running"
        assert two.status["message"] == ("Training finished on 1 of 2 pods; waiting for the "
                                         "others to exit.")
    # The same pod without the mark is stale, then hung: the mark is what tells them apart.
    now = done_at + timedelta(seconds=25)
    stale = then(one, j, running_world(), now=now, liveness=_frozen(now, done_at))
    assert stale.status["ranks"][1]["state"] == "Unresponsive"
    assert "HeartbeatStale" in events(stale)


def test_when_every_pod_is_in_its_exit_barrier_no_step_stall_is_declared() -> None:
    # Both pods finished (same step, heartbeats stopped): the progress clock stops watching,
    # however long the barrier lasts; the job succeeds once the pods exit 0.
    j = job()
    done_at = T0 + timedelta(seconds=30)
    one = running(j, now=done_at)
    now = done_at + timedelta(seconds=20 + 60 + 400)
    two = then(one, j, running_world(), now=now, liveness=_finished(now, done_at, (0, 1)))
    assert two.of_type(DeletePod) == [] and not two.status["incidents"]
    assert [r["state"] for r in two.status["ranks"]] == ["Succeeded", "Succeeded"]
    assert two.status["message"].startswith("Training finished on 2 of 2 pods")
    # nvrx-control closed the rendezvous after the first launcher finished: no RendezvousLost.
    closed = world(trainer(0), trainer(1), rdzv=rendezvous("Succeeded", exit_code=0))
    three = then(two, j, closed, now=now, liveness=_finished(now, done_at, (0, 1)))
    assert "FullRestart" not in events(three) and not three.of_type(DeletePod)
    done = world(trainer(0, "Succeeded", exit_code=0), trainer(1, "Succeeded", exit_code=0),
                 rdzv=rendezvous("Succeeded", exit_code=0))
    assert then(three, j, done, now=now + timedelta(seconds=5)).status["state"] == "Succeeded"


def test_a_finished_mark_from_the_pods_previous_attempt_counts_for_nothing() -> None:
    # The mark belongs to the pod that served it: a replacement (another uid) is judged on its
    # own heartbeats.
    j = job()
    done_at = T0 + timedelta(seconds=30)
    one = running(j, now=done_at)
    now = done_at + timedelta(seconds=25)
    live = _finished(now, done_at)
    live[1] = replace(live[1], pod_uid="uid-1-0-old")
    two = then(one, j, running_world(), now=now, liveness=live)
    assert two.status["ranks"][1]["state"] != "Succeeded"
