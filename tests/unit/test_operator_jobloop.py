"""When a job's pass runs and what it reads (`rtj_operator.jobloop.next_pass`), and which pod
changes wake the job's loop (`pod_changed`). Pure: times are given, nothing sleeps."""

from __future__ import annotations

import math
from typing import Any

import kopf
import kubernetes.client
import pytest
from rtj_operator import jobloop
from rtj_operator.jobloop import DEADLINE_MARGIN_SECONDS, EVENT_PASS_GAP_SECONDS, next_pass
from rtj_operator.reconcile import READ_EVERY_POD, READ_NONE, Reads

pytestmark = pytest.mark.unit

WALL = 1_800_000_000.0
"""Unix time at monotonic 100.0 in these tests."""


def plan(**given: Any) -> jobloop.NextPass:
    """next_pass at monotonic 100.0 (Unix WALL), the next read of every pod due at 102.0, no
    read under way, nothing woken, no deadlines, the last pass started at WALL - 1.2;
    `given` overrides."""
    args: dict[str, Any] = {
        "now": 100.0, "wall_now": WALL, "full_due": 102.0, "full_requested": False,
        "reading": False, "read_done": False, "pods_changed": False,
        "last_pods_start": -math.inf, "last_pods_seconds": 0.0,
        "last_start_wall": WALL - 1.2, "recheck": {},
    }
    args.update(given)
    return next_pass(**args)


def test_a_new_job_or_a_spec_change_gets_a_full_pass_at_once() -> None:
    chosen = plan(full_requested=True, full_due=math.inf)
    assert (chosen.at, chosen.reads, chosen.trigger) == (100.0, READ_EVERY_POD, "start")
    assert chosen.may_list


def test_without_news_the_next_thing_is_reading_every_pod_at_the_interval() -> None:
    chosen = plan()
    assert (chosen.at, chosen.reads, chosen.trigger) == (102.0, READ_EVERY_POD, "read")


def test_the_intervals_pass_runs_as_soon_as_its_read_is_in_and_may_list() -> None:
    chosen = plan(reading=False, read_done=True, pods_changed=True)
    assert (chosen.at, chosen.reads, chosen.trigger) == (100.0, READ_NONE, "interval")
    assert chosen.may_list


def test_while_every_pod_is_being_read_a_pod_change_is_acted_on_without_waiting() -> None:
    assert plan(reading=True).at == math.inf  # nothing to do until the read is in
    chosen = plan(reading=True, pods_changed=True, full_due=99.0)
    assert (chosen.at, chosen.reads, chosen.trigger) == (100.0, READ_NONE, "pods")


def test_a_pod_change_wakes_a_pass_that_reads_nothing_and_lists_nothing() -> None:
    chosen = plan(pods_changed=True)
    assert (chosen.at, chosen.reads, chosen.trigger) == (100.0, READ_NONE, "pods")
    assert not chosen.may_list


def test_pod_changes_in_a_burst_are_coalesced() -> None:
    # The last pass woken by a pod change started a moment ago: the next one waits for the
    # gap; a long one (2 s) makes the gap its own duration.
    assert plan(pods_changed=True, last_pods_start=99.9, full_due=105.0).at == \
        99.9 + EVENT_PASS_GAP_SECONDS
    assert plan(pods_changed=True, last_pods_start=99.9, last_pods_seconds=2.0,
                full_due=105.0).at == 101.9


def test_passes_woken_by_deadlines_or_pods_are_spaced_by_their_own_cost() -> None:
    """A 5,000-pod job's heartbeat deadlines, spread over its timeout, ran its passes back to
    back (0.3 s each: the operator's whole core). The next such pass now waits
    PASS_SPACING_FACTOR x the last one's work, and reads every pod due by then at once."""
    recheck = {7: WALL + 0.1, 8: WALL + 0.3, 9: WALL + 0.44, 10: WALL + 30.0}
    spaced = plan(full_due=105.0, recheck=recheck, last_quick_start=99.9,
                  last_quick_seconds=0.2)
    assert spaced.at == pytest.approx(99.9 + jobloop.PASS_SPACING_FACTOR * 0.2)
    assert (spaced.reads, spaced.trigger) == (Reads(pods=frozenset({7, 8, 9})), "deadline")
    # A pod change waits as long; a small job's passes (milliseconds) are not held back.
    assert plan(pods_changed=True, full_due=105.0, last_quick_start=99.9,
                last_quick_seconds=0.2).at == pytest.approx(100.5)
    quick = plan(full_due=105.0, recheck=recheck, last_quick_start=99.9,
                 last_quick_seconds=0.004)
    assert quick.at == pytest.approx(100.1 + DEADLINE_MARGIN_SECONDS)
    assert quick.reads == Reads(pods=frozenset({7}))


def test_a_sweep_skips_the_pods_read_at_their_deadlines_since_the_last_sweep() -> None:
    """At 5,000 pods every pod was read twice a heartbeat timeout: at its deadline and by the
    sweep. A sweep now reads only the pods not read (with an answer) since the last one."""
    from rtj_operator.observed import NodeLiveness, PodView

    def view(index: int, uid: str = "", phase: str = "Running") -> PodView:
        return PodView(name=f"j-{index}", uid=uid or f"u{index}", role="trainer",
                       node_index=index, phase=phase, pod_ip="127.0.0.2")

    pods = [view(0), view(1), view(2, uid="replaced"), view(3), view(4, phase="Pending")]
    read = {i: NodeLiveness(node_index=i, pod_uid=f"u{i}", samples=(), expected_ranks=8,
                            read_time=WALL + t) for i, t in ((0, 5.0), (1, -5.0), (2, 5.0))}
    assert jobloop.sweep_targets(pods, read, None) == pods[:4]  # the first sweep: every pod
    # Pod 0 was read after the last sweep ended; pod 1 before it; pod 2's read was of the pod
    # it replaced; pod 3 did not answer its last read (no read kept); pod 4 has no endpoint.
    assert [p.name for p in jobloop.sweep_targets(pods, read, WALL)] == ["j-1", "j-2", "j-3"]


def test_a_heartbeat_deadline_reads_only_the_pods_due_just_after_it() -> None:
    recheck = {7: WALL + 1.0, 8: WALL + 1.0, 9: WALL + 30.0}
    chosen = plan(full_due=105.0, recheck=recheck)
    assert chosen.at == pytest.approx(101.0 + DEADLINE_MARGIN_SECONDS)
    assert (chosen.reads, chosen.trigger) == (Reads(pods=frozenset({7, 8})), "deadline")
    assert not chosen.may_list
    # ...also while every pod is being read.
    assert plan(reading=True, recheck=recheck).trigger == "deadline"


def test_a_deadline_passed_meanwhile_is_read_at_once_with_a_pod_change() -> None:
    chosen = plan(pods_changed=True, full_due=105.0, recheck={3: WALL - 0.5, 4: WALL + 20.0})
    assert (chosen.at, chosen.reads) == (100.0, Reads(pods=frozenset({3})))


def test_a_deadline_a_pass_has_already_handled_wakes_nothing() -> None:
    # The pass that read pod 3 started after its deadline (and decided nothing new about it, or
    # failed): the interval comes next, not a loop of passes.
    chosen = plan(recheck={3: WALL - 0.5}, last_start_wall=WALL - 0.4)
    assert (chosen.at, chosen.trigger) == (102.0, "read")


def test_only_a_change_of_what_the_decisions_read_of_a_pod_wakes_its_job() -> None:
    loop = jobloop.JobLoop()
    loops = {("ns", "job"): loop}
    pod_memo = kopf.Memo()
    running = {"metadata": {"name": "job-0"}, "status": {"phase": "Running"}}
    jobloop.pod_changed(loops, pod_memo, key=("ns", "job"), view=running)
    assert loop.pods_changed and loop.nudge.is_set()
    loop.pods_changed = False
    jobloop.pod_changed(loops, pod_memo, key=("ns", "job"), view=dict(running))
    assert not loop.pods_changed  # the same view again (a Ready condition, an annotation)
    failed = {"metadata": {"name": "job-0"}, "status": {"phase": "Failed"}}
    jobloop.pod_changed(loops, pod_memo, key=("ns", "job"), view=failed)
    assert loop.pods_changed
    loop.pods_changed = False
    jobloop.pod_changed(loops, pod_memo, key=("ns", "job"), view=None)  # gone
    assert loop.pods_changed
    jobloop.pod_changed(loops, kopf.Memo(), key=("ns", "other"), view=running)  # no loop yet


def test_a_spec_change_asks_for_a_full_pass() -> None:
    loop = jobloop.JobLoop()
    loop.full_requested = False
    loop.wake(full=True)
    assert loop.full_requested and loop.nudge.is_set() and not loop.pods_changed


def test_a_pass_failed_by_an_unreachable_api_server_is_told_in_one_short_line() -> None:
    """During a 90 s kube-apiserver outage every job's pass failed with a 40-line traceback that
    held the whole URL; the log line now names the cause only."""
    import urllib3

    refused = urllib3.exceptions.MaxRetryError(
        None, "/apis/training.resilient.dev/v1alpha1/namespaces/n/resilienttrainingjobs/j/status",
        urllib3.exceptions.NewConnectionError(
            None, "HTTPSConnection(host='127.0.0.1', port=41957): Failed to establish a new "
                  "connection: [Errno 111] Connection refused"))
    assert jobloop.unreachable_reason(refused) == (
        "NewConnectionError: [Errno 111] Connection refused")
    assert jobloop.unreachable_reason(ConnectionResetError(104, "Connection reset by peer")) == (
        "ConnectionResetError: [Errno 104] Connection reset by peer")


def test_sweeps_are_spaced_so_that_every_pod_read_fits_the_budget() -> None:
    """100 jobs x 50 pods read every 3 s were 1,667 liveness reads a second and 0.85 of the
    operator's cores (bench.scale, issue #33). The sweeps now keep to
    `sweep_reads_per_second` in all; small installations keep the reconcile interval."""
    from rtj_operator.config import OperatorSettings

    settings = OperatorSettings(reconcile_interval_seconds=3.0, sweep_reads_per_second=500.0)
    assert jobloop.sweep_interval(settings, 16) == 3.0
    assert jobloop.sweep_interval(settings, 1_500) == 3.0
    assert jobloop.sweep_interval(settings, 5_000) == 10.0
    assert jobloop.sweep_interval(settings, 40_000) == 80.0


def test_renewable_deadlines_are_read_by_the_loop_and_the_rest_by_passes() -> None:
    recheck = {1: WALL - 1.0, 2: WALL - 1.0, 3: WALL + 4.0, 4: WALL - 1.0, 5: WALL - 3.0,
               6: WALL - 3.0}
    renewable = {1: 0.0, 2: 0.0, 3: 0.0, 5: 0.0, 6: 0.0}
    read_times = {1: WALL - 11.0, 5: WALL - 2.0}
    due, upcoming = jobloop.quiet_due(recheck, renewable, {2}, wall_now=WALL,
                                      read_times=read_times)
    # 1 (read before its deadline) and 6 (no read kept) are due; 2's quiet read needed a pass;
    # 3 is not due yet; 4 is not renewable (a pass reads it); 5 was read after its deadline
    # (by a sweep: the pass after it decides anew).
    assert due == frozenset({1, 6})
    assert upcoming == pytest.approx(WALL + 4.0 + DEADLINE_MARGIN_SECONDS)
    assert jobloop.quiet_due({}, {}, (), wall_now=WALL, read_times={}) == (
        frozenset(), math.inf)


def test_the_intervals_pass_reads_the_pods_whose_deadline_passed_since_the_read_began() -> None:
    """100 x 50 (bench.scale, 2026-12-05): an interval pass that started just after a hung
    pod's deadline decided on the background read from before it, and counted as handling the
    deadline: the hang was acted on a whole sweep (12 s) late. It now reads that pod again."""
    chosen = plan(read_done=True, recheck={3: WALL - 0.5, 4: WALL + 5.0},
                  last_start_wall=WALL - 2.0)
    assert (chosen.trigger, chosen.reads) == ("interval", Reads(pods=frozenset({3})))


def test_a_quiet_read_moves_a_healthy_pods_deadline_and_hands_a_stale_one_to_a_pass() -> None:
    """The loop's own reads at renewable deadlines (`renew_quietly`): pod 0 beats on, and its
    deadline moves with no pass; pod 1's heartbeat is stale at its read and pod 2 does not
    answer: both go to the next pass (`eventful`), which `next_pass` then schedules."""
    import asyncio
    import time

    from rtj_operator import reconcile
    from rtj_operator.config import OperatorSettings
    from rtj_operator.observed import NodeLiveness, RankSample

    now = time.time()

    def node(index: int, beat: float) -> NodeLiveness:
        return NodeLiveness(node_index=index, pod_uid=f"u{index}", expected_ranks=1,
                            read_time=now, samples=(RankSample(local_rank=0, heartbeat=beat),))

    class Pods:
        """The pods' answers as the scraper returns them (the HTTP reads are tested with real
        servers in tests/integration and tests/e2e)."""

        asked: list[int] = []

        async def scrape(self, pods: Any, **_: Any) -> dict[int, NodeLiveness]:
            read = [p.node_index for p in pods]
            self.asked.extend(read)
            return {i: a for i, a in {0: node(0, now - 1.0), 1: node(1, now - 25.0)}.items()
                    if i in read}

    def pod(index: int) -> dict[str, Any]:
        return {"metadata": {"name": f"j-{index}", "uid": f"u{index}", "labels": {
            "training.resilient.dev/job": "j", "training.resilient.dev/role": "trainer",
            "training.resilient.dev/node-index": str(index)}},
            "status": {"phase": "Running", "podIP": "127.0.0.2"}}

    job = reconcile.JobMemo(procs_per_node=1, heartbeat_timeout_seconds=20.0,
                            recheck={0: now - 1.0, 1: now - 1.0, 2: now - 1.0},
                            renewable={0: now - 21.0, 1: now - 21.0, 2: now - 21.0},
                            liveness={i: node(i, now - 21.0) for i in range(3)})
    loop = jobloop.JobLoop()
    scraper = Pods()
    asyncio.run(jobloop.renew_quietly(
        frozenset({0, 1, 2}), job_name="j", scraper=scraper, job=job,  # type: ignore[arg-type]
        eventful=loop.eventful, children=lambda: ([pod(0), pod(1), pod(2)], [], []),
        settings=OperatorSettings()))
    assert sorted(scraper.asked) == [0, 1, 2]
    assert job.recheck[0] == pytest.approx(now - 1.0 + 20.0) and job.renewable[0] == now - 1.0
    assert loop.eventful == {1, 2}
    assert job.recheck[1] == now - 1.0 and job.recheck[2] == now - 1.0  # left to the pass
    assert set(job.liveness) == {0, 1}  # the reads are kept; pod 2 is silent now
    plan = next_pass(now=100.0, wall_now=now, full_due=105.0, full_requested=False,
                     reading=False, read_done=False, pods_changed=False,
                     last_pods_start=-math.inf, last_pods_seconds=0.0,
                     last_start_wall=now - 10.0,
                     recheck={i: at for i, at in job.recheck.items()
                              if i not in job.renewable or i in loop.eventful})
    assert (plan.trigger, plan.reads) == ("deadline", Reads(pods=frozenset({1, 2})))


def _status_pass(job: Any, seen: dict[str, Any], step: int, settings: Any) -> dict[str, Any]:
    """A pass's status patch for a Running job at `step`, written as jobloop.run_pass writes it
    (through `jobloop.actions.patch_status`, which the tests replace)."""
    import asyncio

    from rtj_operator import reconcile
    from rtj_operator.api.status import ResilientTrainingJobStatus

    observed_at = jobloop.time.monotonic()
    patch = reconcile._status_to_write(
        job, reconcile.with_unseen_writes(seen, job.written),
        ResilientTrainingJobStatus(state="Running", step=step), settings)
    if patch:
        asyncio.run(jobloop._write_status({"api": None}, job, "ns", "job", patch, settings,
                                          observed_at=observed_at))
    return patch


def test_a_status_write_that_failed_is_tried_again_by_the_next_pass(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.chaos apiserver-stop (32 s): the status caught up 11.6 s after kube-apiserver was
    back, and the failed passes were logged 12 s apart, not at the 3 s retry. A pass stamped its
    status write when it computed the patch, before the write: once the write failed, the
    retries computed progress alone and held it back for `status_progress_interval_seconds`
    (10 s), so a write failed once a progress interval, and the first after the return could
    wait the whole interval. Only a write the API server took holds progress back now."""

    import urllib3
    from rtj_operator import reconcile
    from rtj_operator.config import OperatorSettings

    settings = OperatorSettings(status_progress_interval_seconds=10.0)
    job = reconcile.JobMemo(last_status_write=-math.inf)  # the last write is long past
    seen = {"state": "Running", "step": 10, "conditions": [], "incidents": [], "ranks": []}
    api_up = False
    took: list[dict[str, Any]] = []

    async def patch_status(_api: Any, *, status: dict[str, Any], **_: Any) -> bool:
        if not api_up:
            raise urllib3.exceptions.MaxRetryError(
                None, "/status", urllib3.exceptions.NewConnectionError(
                    None, "Failed to establish a new connection: [Errno 111] Connection "
                          "refused"))
        took.append(status)
        return True

    monkeypatch.setattr(jobloop.actions, "patch_status", patch_status)

    def one_pass(step: int) -> dict[str, Any]:
        return _status_pass(job, seen, step, settings)

    with pytest.raises(urllib3.exceptions.MaxRetryError):
        one_pass(11)  # the API server is down
    with pytest.raises(urllib3.exceptions.MaxRetryError):
        one_pass(12)  # the retry 3 s later tries the write again (it computed {} before)
    api_up = True
    assert one_pass(13) == {"step": 13}  # back: the first pass catches the status up
    assert took == [{"step": 13}]
    # its values may have been observed just before the return (bench.chaos apiserver-stop at
    # 6aff325: 11.08 s): the next pass writes fresh ones, then progress waits again
    assert one_pass(14) == {"step": 14}
    assert one_pass(15) == {}
    assert took == [{"step": 13}, {"step": 14}]


def _clocked_status(monkeypatch: pytest.MonkeyPatch, hold: Any = lambda: 0.0) -> tuple[
        list[float], Any, Any, dict[str, Any], list[dict[str, Any]]]:
    """A fake monotonic clock (jobloop's and reconcile's) at 1000, 10 s progress interval
    settings, a job last written long ago, what the watch shows of its status (Running, step
    10), and the status patches the API server took: each one it holds `hold()` seconds."""
    from rtj_operator import reconcile
    from rtj_operator.config import OperatorSettings

    clock = [1000.0]
    monkeypatch.setattr(jobloop.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(reconcile.time, "monotonic", lambda: clock[0])
    took: list[dict[str, Any]] = []

    async def patch_status(_api: Any, *, status: dict[str, Any], **_: Any) -> bool:
        clock[0] += hold()
        took.append(status)
        return True

    monkeypatch.setattr(jobloop.actions, "patch_status", patch_status)
    seen = {"state": "Running", "step": 10, "conditions": [], "incidents": [], "ranks": []}
    return (clock, OperatorSettings(status_progress_interval_seconds=10.0),
            reconcile.JobMemo(last_status_write=-math.inf), seen, took)


def test_a_status_write_that_hung_through_an_outage_holds_progress_back_from_its_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.chaos etcd-restart (ec6bf89): the status caught up 11.7 and 11.9 s after etcd was
    back. During etcd's outage kube-apiserver holds a write instead of refusing it; the write
    went through when etcd returned, carrying the step of 8 s before, and progress then waited
    a whole interval from its end. The interval counts from when the patch was computed."""

    holds = iter([8.0])  # the first write is held by kube-apiserver until etcd is back
    clock, settings, job, seen, took = _clocked_status(monkeypatch, lambda: next(holds, 0.0))

    def one_pass(step: int) -> dict[str, Any]:
        return _status_pass(job, seen, step, settings)

    assert one_pass(11) == {"step": 11}  # computed at 1000, taken at 1008 (etcd back)
    clock[0] += 3.0  # the next pass, 3 s after etcd's return: 11 s after the patch's values
    assert one_pass(15) == {"step": 15}
    assert took == [{"step": 11}, {"step": 15}]
    clock[0] += 3.0
    assert one_pass(16) == {}  # progress alone waits for the interval again


def test_a_status_write_held_briefly_through_an_outage_is_followed_by_a_fresh_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.chaos etcd-restart (d8c8598): the status caught up 10.8 s after etcd was back. A
    write computed shortly before etcd's return was held until then and went through with the
    step of when it was computed; counted from then, progress waited most of an interval. A
    write held longer than `HELD_WRITE_SECONDS` is followed by a fresh one at the next pass."""

    from rtj_operator import reconcile

    held = [reconcile.HELD_WRITE_SECONDS + 0.5]  # kube-apiserver holds the write until etcd is back
    clock, settings, job, seen, took = _clocked_status(monkeypatch, lambda: held[0])

    def one_pass(step: int) -> dict[str, Any]:
        return _status_pass(job, seen, step, settings)

    assert one_pass(11) == {"step": 11}  # computed at 1000, taken at 1001.5 (etcd back)
    held[0] = 0.01  # writes are quick again
    clock[0] += 3.0  # the next pass, 4.5 s after the patch's values: writes the step now
    assert one_pass(15) == {"step": 15}
    assert took == [{"step": 11}, {"step": 15}]
    clock[0] += 3.0
    assert one_pass(16) == {}  # a quick write holds progress back for the interval again
    assert took == [{"step": 11}, {"step": 15}]


def test_a_slow_pass_holds_progress_back_from_its_observation_not_its_write(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pass that observed the trainers and then took a while before its quick write (the API
    server held one of its requests, or a scrape waited on a silent pod) wrote values of its
    observation: the next progress is due an interval after the observation, not after the
    write. Only a write that was itself held is followed by a fresh one at once (a slow pass of
    a large job must not triple its status writes)."""
    import asyncio

    from rtj_operator import reconcile
    from rtj_operator.api.status import ResilientTrainingJobStatus

    clock, settings, job, seen, took = _clocked_status(monkeypatch)
    observed_at = clock[0]
    patch = reconcile._status_to_write(job, reconcile.with_unseen_writes(seen, job.written),
                                       ResilientTrainingJobStatus(state="Running", step=11),
                                       settings)
    clock[0] += 6.0  # the pass was slow before its write
    asyncio.run(jobloop._write_status({"api": None}, job, "ns", "job", patch, settings,
                                      observed_at=observed_at))
    assert took == [{"step": 11}]
    clock[0] += 3.0  # 9 s after the observation: progress still waits
    assert _status_pass(job, seen, 15, settings) == {}
    clock[0] += 1.5  # 10.5 s after it (4.5 s after the write): due
    assert _status_pass(job, seen, 16, settings) == {"step": 16}
    assert took == [{"step": 11}, {"step": 16}]


def test_a_status_patch_answered_404_counts_as_not_written(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A status patch answered 404 (the job is gone, or a kube-apiserver just started does not
    serve the resource yet) wrote nothing: it neither holds progress back nor counts as an own
    write the watch should show."""
    import asyncio

    from kubernetes.client.exceptions import ApiException
    from rtj_operator import actions, reconcile
    from rtj_operator.config import OperatorSettings

    api = kubernetes.client.ApiClient()

    def not_found(*_: Any, **__: Any) -> None:
        raise ApiException(status=404, reason="Not Found")

    monkeypatch.setattr(api, "call_api", not_found)
    assert actions._patch_status(api, "ns", "job", {"step": 3}, 1.0) is False
    job = reconcile.JobMemo()
    asyncio.run(jobloop._write_status({"api": api}, job, "ns", "job", {"step": 3},
                                      OperatorSettings(), observed_at=0.0))
    assert job.last_status_write is None and job.written == {}
