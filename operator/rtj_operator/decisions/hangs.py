"""Rule 7, finding hangs: the ranks' state from the pods and the scraped metrics
(`observe_ranks`), and the hangs in them: a rank without a heartbeat for
`heartbeatTimeoutSeconds + initialHeartbeatTimeoutSeconds` (ft_launcher had its chance to restart
the workers inside the pod first), or a job whose slowest step did not advance for
`progressTimeoutSeconds` although every rank sends heartbeats (`hang_faults`).

The heartbeat timeout counts per pod (`pod_clock`): from the latest of the pod's own start, the
start of every other training pod that runs, the rendezvous pod's start and the last recovery;
so a pod that is Terminating, being replaced or on a lost node does not switch hang detection off
for the others. Only a pod still Pending within `podStartTimeoutSeconds` holds the others'
heartbeat timeouts (their launchers wait for it in the rendezvous), and that deadline bounds the
wait (`starting_peer`). The job-wide progress timeout (`clock_start`) still needs every active
pod and the rendezvous pod Running: the slowest step means nothing while a pod is missing.

A hang is declared only on evidence (`silence`, `hang_faults`):
- a pod that answers, with its ranks' heartbeat stale (or none of them ever sent one);
- a SILENT pod (its endpoint did not answer: a frozen or wedged host whose kubelet still
  reports Ready) that stays silent for `heartbeatTimeoutSeconds +
  initialHeartbeatTimeoutSeconds` while it is a minority of the job's running pods (at least
  half of them answer) and some answering pod's heartbeat is stale too (the job is stuck: the
  answering pods' workers wait for it in the collective). Then only the silent pods are blamed,
  never the answering ones waiting for them; while such a silence is younger than that, no
  answering pod is blamed for a stale heartbeat either.
A pod whose launcher reports that every local worker exited 0 (`finishing`: it waits in
torchelastic's exit barrier for the other launchers) is done training: its stopped heartbeats are
neither stale nor a hang, and the job's step is no longer watched.
Widespread silence (none, or fewer than half, of the job's running pods answer) is an
observation outage, not evidence: no hang is declared for a silent pod, and after
heartbeatTimeoutSeconds of it the job gets the `ObservationDegraded` condition
(`degraded_observation`); so does a minority of silent pods while every answering pod beats (the
job trains, so the silent pods take part in it: only the operator cannot read them).
One exception (`Silence.alone`, review F13): when the job's only pod that could hang is silent
(`nodes: 1`, or its other pods finished or do not count), no answering pod can ever tell the
operator's own trouble from a frozen pod, so an outage rule alone would leave it unblamed for
ever. That pod is declared hung once silent for `LONE_SILENCE_FACTOR` (2) x
(heartbeatTimeoutSeconds + initialHeartbeatTimeoutSeconds); until then the job shows
`ObservationDegraded`. The evidence is weak, so its node is not excluded (`node=None`).

The whole hang policy lives here, including how one pod's ranks add up (`oldest_heartbeat`,
`completed_step`: only a pod whose every local rank answered counts); `observed.py` holds only what
was scraped. The faults of the pods themselves (failed, vanished, evicted, lost with their node,
not starting; the rendezvous pod lost) are `podfaults.py`, which looks for hangs only when the pods
show none; what the operator does about a fault is `recovery.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from rtj_operator import naming
from rtj_operator.api.vocabulary import IncidentCause, RankState
from rtj_operator.decisions.clocks import (
    clock_start,
    completed_step,
    finishing,
    fresh,
    node_heartbeat,
    node_liveness,
    not_reporting,
    oldest_heartbeat,
    pod_clock,
    read_moment,
    starting_peer,
)
from rtj_operator.decisions.state import DetectedFault, Pass, iso, some
from rtj_operator.observed import NodeLiveness

__all__ = ["LONE_SILENCE_FACTOR", "completed_step", "degraded_observation", "finishing",
           "hang_faults", "heartbeat_deadlines", "mark_unresponsive", "node_heartbeat",
           "not_reporting", "observe_ranks", "oldest_heartbeat", "renewed_deadline", "silence"]

LONE_SILENCE_FACTOR = 2
"""A job's only pod that could hang, silent, is declared hung after this many times
heartbeatTimeoutSeconds + initialHeartbeatTimeoutSeconds (`Silence.alone`): with no answering
pod, the operator cannot tell its own network trouble from a frozen pod, so it waits longer."""


def _standby(p: Pass, index: int, node: NodeLiveness | None) -> bool:
    """Whether the pod trains nothing now: its every rank says it is a warm spare, or it is a
    replacement still waiting for the next launcher round (no worker answers yet; once its
    ranks answer, it joined a round and is no longer waiting)."""
    if not_reporting(p, index):
        p.waiting.discard(index)  # it never answers with ranks: its pod running is all we know
        return False
    answered = node is not None and node.complete and len(node.samples) == node.expected_ranks
    if index in p.waiting:
        if answered:
            p.waiting.discard(index)
        else:
            return True
    return answered and node is not None and all(sample.standby for sample in node.samples)


def observe_ranks(p: Pass) -> None:
    """Fill ranks[] from the pods and the scraped metrics."""
    for index in range(p.pods):
        pod = p.observed.trainer_pods.get(index)
        if pod is None:
            if index in p.waiting:
                p.standby.add(index)  # its replacement is about to be created
            p.rank(index, pod=None, node=None)
            continue
        node = node_liveness(p, index)
        beat = node_heartbeat(p, index)
        step = completed_step(node) if node is not None else None
        previous = p.prev_ranks.get(index)
        if step is None and previous is not None and previous.attempt == pod.attempt:
            step = previous.step
        state = {"Pending": RankState.PENDING, "Succeeded": RankState.SUCCEEDED,
                 "Failed": RankState.FAILED}.get(pod.phase, RankState.STARTING)
        if pod.deleting:
            state = RankState.RESTARTING
        elif (pod.phase == "Running" or index in p.waiting) and _standby(p, index, node):
            p.standby.add(index)
            step, beat = None, None
            if pod.phase == "Running":
                state = RankState.STANDBY
        elif finishing(p, index):
            state = RankState.SUCCEEDED
        elif pod.phase == "Running" and not_reporting(p, index):
            state = RankState.RUNNING  # its processes run; that is all it tells
        p.rank(index, pod=pod.name, node=pod.node_name, attempt=pod.attempt,
               last_heartbeat_time=beat, step=step, state=state, unresponsive_since=None)
    for index in p.active():
        clock = pod_clock(p, index)
        beat = p.ranks[index].last_heartbeat_time
        if (clock is not None and beat is not None and beat >= clock and fresh(p, index, beat)
                and p.ranks[index].state != RankState.SUCCEEDED):
            p.rank(index, state=RankState.RUNNING)
        pod = p.observed.trainer_pods.get(index)
        if clock is not None and pod is not None and node_liveness(p, index) is None:
            p.unobserved_since[pod.uid] = p.memory.unobserved_since.get(pod.uid, p.now)


@dataclass(frozen=True)
class Silence:
    """Which of the job's pods that could hang (running, their clocks counting) answered in
    this pass and which stayed silent, and what their silence means."""

    silent: tuple[int, ...]
    """Node indexes of the pods whose endpoint did not answer."""
    answering: tuple[int, ...]
    outage: bool
    """None, or fewer than half, of the pods answered: the operator cannot see the job (its
    network, its load, the API server): silence is no evidence against any pod."""
    stuck: bool
    """Some answering pod's heartbeat is stale (older than heartbeatTimeoutSeconds, or none
    since its clock started): the job does not train."""

    @property
    def evidence(self) -> bool:
        """Whether the silent pods are the suspects: a minority of silent pods in a stuck job
        (the answering pods' workers wait for theirs)."""
        return bool(self.silent) and not self.outage and self.stuck

    @property
    def alone(self) -> bool:
        """Whether the job's only pod that could hang is silent (a single-pod job, or its other
        pods finished or do not count): an outage by the rule above, but one no answering pod
        can ever end, so that pod is blamed after a longer silence (`LONE_SILENCE_FACTOR`)."""
        return len(self.silent) == 1 and not self.answering


def silence(p: Pass) -> Silence:
    """Sort the job's pods that could hang in this pass into silent and answering ones. Asked
    up to four times a pass: computed again only when what it reads changed (`Pass.clock_key`)."""
    key = p.clock_key()
    if p.silence_memo is not None and p.silence_memo[0] == key:
        heard: Silence = p.silence_memo[1]
        return heard
    heard = _silence(p)
    p.silence_memo = (key, heard)
    return heard


def _silence(p: Pass) -> Silence:
    starting = starting_peer(p)
    silent: list[int] = []
    answering: list[int] = []
    stuck = False
    for index in p.active():
        clock = pod_clock(p, index)
        if (clock is None or (starting is not None and starting != index) or finishing(p, index)
                or not_reporting(p, index)):
            continue  # not counting, held by a starting peer, done training, or never reports
        if node_liveness(p, index) is None:
            silent.append(index)
            continue
        answering.append(index)
        beat = p.ranks[index].last_heartbeat_time
        if beat is None or beat < clock or not fresh(p, index, beat):
            stuck = True
    outage = not answering or 2 * len(answering) < len(silent) + len(answering)
    return Silence(tuple(silent), tuple(answering), outage, stuck)


def _silent_for(p: Pass, index: int) -> timedelta:
    """How long the pod has been silent, counted from its clock at the earliest."""
    pod = p.observed.trainer_pods[index]
    clock = pod_clock(p, index)
    since = p.unobserved_since.get(pod.uid, p.now)
    if clock is not None and clock > since:
        since = clock
    return p.now - since


def _hang_after(p: Pass) -> timedelta:
    """heartbeatTimeoutSeconds + initialHeartbeatTimeoutSeconds."""
    ft = p.spec.fault_tolerance
    return timedelta(seconds=ft.heartbeat_timeout_seconds + ft.initial_heartbeat_timeout_seconds)


def degraded_observation(p: Pass) -> str | None:
    """Why observation is degraded: running pods whose liveness could not be read for longer
    than heartbeatTimeoutSeconds, when that silence is no evidence against them (`Silence`:
    an outage, or a job that trains on without them being read); None when every pod could
    be read recently, or the silent pods are the suspects of a stuck job. A pod this pass
    replaces (a silent one declared hung: `Silence.alone`) is not named. Every node NotReady
    at once (`Observed.nodes_disrupted`) is said too: no pod is taken for lost meanwhile."""
    disrupted = p.observed.nodes_disrupted
    silent_pods = _silent_pods(p)
    if disrupted is not None and silent_pods is not None:
        return f"{disrupted}; {silent_pods}"
    return disrupted if disrupted is not None else silent_pods


def _silent_pods(p: Pass) -> str | None:
    if silence(p).evidence:
        return None
    limit = timedelta(seconds=p.spec.fault_tolerance.heartbeat_timeout_seconds)
    names = {pod.uid: pod.name for index, pod in p.observed.trainer_pods.items()
             if not (index in p.ranks and p.ranks[index].state == RankState.RESTARTING)}
    silent = sorted(names[uid] for uid, since in p.unobserved_since.items()
                    if p.now - since >= limit and uid in names)
    if not silent:
        return None
    shown = some(silent)
    return (f"the liveness of {len(silent)} running pod(s) could not be read for over "
            f"heartbeatTimeoutSeconds={p.spec.fault_tolerance.heartbeat_timeout_seconds} s: "
            f"{shown}; a pod is declared hung only on its own stale heartbeat")


def mark_unresponsive(p: Pass) -> None:
    """Publish a stale heartbeat as soon as it is one (rule 7, detection): a pod that answers,
    whose clock counts (`silence`) and whose ranks' newest heartbeat since that clock was older
    than heartbeatTimeoutSeconds when it was read, is `Unresponsive` (with `unresponsiveSince`)
    and gets one `HeartbeatStale` Warning Event per episode; `HeartbeatResumed` when it beats
    again. Nothing is done about it yet: ft_launcher restarts the workers inside the pod at
    heartbeatTimeoutSeconds, and the operator replaces the pod only after heartbeatTimeoutSeconds
    + initialHeartbeatTimeoutSeconds (`hang_faults`). A pod that does not answer is never
    Unresponsive: could not observe is not a stale heartbeat."""
    ft = p.spec.fault_tolerance
    for index in silence(p).answering:
        clock = pod_clock(p, index)
        rank = p.ranks[index]
        beat = rank.last_heartbeat_time
        if clock is None or beat is None or beat < clock or fresh(p, index, beat):
            continue
        previous = p.prev_ranks.get(index)
        ongoing = (previous is not None and previous.state == RankState.UNRESPONSIVE
                   and previous.attempt == rank.attempt and previous.pod == rank.pod)
        since = previous.unresponsive_since if ongoing and previous is not None else None
        updated = p.rank(index, state=RankState.UNRESPONSIVE, unresponsive_since=since or p.now)
        if not ongoing:
            p.unresponsive.append(updated)
            act_at = beat + timedelta(seconds=ft.heartbeat_timeout_seconds
                                      + ft.initial_heartbeat_timeout_seconds)
            p.event("Warning", "HeartbeatStale",
                    f"Pod {rank.pod}: no heartbeat from its ranks since {iso(beat)} "
                    f"(heartbeatTimeoutSeconds={ft.heartbeat_timeout_seconds}); ft_launcher "
                    f"restarts its workers, and the operator replaces the pod if none arrives "
                    f"by {iso(act_at)}")
    for index in p.active():
        rank = p.ranks[index]
        previous = p.prev_ranks.get(index)
        if (rank.state == RankState.RUNNING and previous is not None
                and previous.state == RankState.UNRESPONSIVE and previous.pod == rank.pod
                and previous.attempt == rank.attempt):
            p.event("Normal", "HeartbeatResumed",
                    f"Pod {rank.pod}: its ranks send heartbeats again")


def heartbeat_deadlines(p: Pass) -> dict[int, datetime]:
    """For each pod that answers and whose clock counts, the next moment its heartbeat verdict
    changes if its heartbeat stays where it is: it turns `Unresponsive` after newest heartbeat +
    heartbeatTimeoutSeconds, and is hung after that + initialHeartbeatTimeoutSeconds (or, with no
    heartbeat since its clock started, clock + both). A read of the pod just after that moment
    decides it: the operator schedules one there instead of waiting for its next full pass. The
    job's only pod that could hang, silent (`Silence.alone`), is due when its silence reaches
    the longer bar (`LONE_SILENCE_FACTOR`)."""
    ft = p.spec.fault_tolerance
    stale_after = timedelta(seconds=ft.heartbeat_timeout_seconds)
    hang_after = _hang_after(p)
    deadlines: dict[int, datetime] = {}
    heard = silence(p)
    if heard.alone:
        index = heard.silent[0]
        if p.ranks[index].state in (RankState.RUNNING, RankState.UNRESPONSIVE,
                                    RankState.STARTING):
            due = p.now - _silent_for(p, index) + LONE_SILENCE_FACTOR * hang_after
            if due >= p.now:
                deadlines[index] = due
    for index in heard.answering:
        if p.ranks[index].state not in (RankState.RUNNING, RankState.UNRESPONSIVE,
                                        RankState.STARTING):
            continue  # being replaced in this pass
        clock = pod_clock(p, index)
        if clock is None:
            continue
        beat = p.ranks[index].last_heartbeat_time
        moments = ([beat + stale_after, beat + hang_after] if beat is not None and beat >= clock
                   else [clock + hang_after])
        read = read_moment(p, index)
        upcoming = [m for m in moments if m >= read]
        if upcoming:
            deadlines[index] = min(upcoming)
            if (beat is not None and deadlines[index] == beat + stale_after
                    and p.ranks[index].state == RankState.RUNNING and not heard.evidence):
                p.renewable[index] = beat.timestamp()
    return deadlines


def renewed_deadline(before: NodeLiveness | None, after: NodeLiveness | None, *, basis: float,
                     timeout_seconds: float, builtin_trainer: bool) -> float | None:
    """A renewable pod's read at its deadline (`Decision.renewable`: Running, its deadline only
    its heartbeat `basis` going stale) that changes no verdict: every rank answered with a
    heartbeat newer than `basis` and fresh at the read, none finished, turned standby or
    counted a restart since the read `before`. Returns the pod's next deadline (that heartbeat
    + `timeout_seconds`, Unix time), which the job's loop takes without a pass; None when the
    read needs a pass (anything else, a pod that did not answer included). At 5,000 pods these
    reads are 500 a second, and a pass for each batch kept detection seconds behind."""
    if after is None or before is None or after.finished or after.read_time is None:
        return None
    if after.pod_uid != before.pod_uid or any(s.standby for s in after.samples):
        return None
    if {s.local_rank: dict(s.restarts) for s in after.samples} != {
            s.local_rank: dict(s.restarts) for s in before.samples}:
        return None
    beat = oldest_heartbeat(after, listed_only=not builtin_trainer)
    if beat is None or beat <= basis or after.read_time - beat > timeout_seconds:
        return None
    return beat + timeout_seconds


def hang_faults(p: Pass) -> list[DetectedFault]:
    """Hangs: no heartbeat (per pod), or no progress although every rank sends heartbeats."""
    hang_after = _hang_after(p)
    heard = silence(p)
    if heard.evidence:
        # A minority of silent pods in a stuck job: the silent ones are the suspects, once
        # their silence outlasts both timeouts; the answering ones wait for them meanwhile.
        return _silent_pod_faults(p, heard, hang_after)
    if heard.alone:
        # The job's only pod that could hang is silent: nothing else answers, so after a
        # longer silence it is blamed (not its node).
        return _lone_silent_pod_fault(p, heard, LONE_SILENCE_FACTOR * hang_after)
    # Without silent suspects: each answering pod on its own heartbeat. A silent pod is not
    # observed in this pass: no evidence either way (an outage, or a job that trains on).
    return _stale_heartbeat_faults(p, heard, hang_after) or _progress_faults(p)


def _silent_pod_faults(p: Pass, heard: Silence, hang_after: timedelta) -> list[DetectedFault]:
    """The silent pods of a stuck job whose silence outlasted both timeouts."""
    faults: list[DetectedFault] = []
    for index in heard.silent:
        quiet = _silent_for(p, index)
        if quiet > hang_after:
            pod = p.observed.trainer_pods[index]
            faults.append(DetectedFault(
                IncidentCause.HEARTBEAT_TIMEOUT, index, p.now,
                f"no heartbeat from pod {pod.name}: it stopped answering "
                f"{int(quiet.total_seconds())} s ago while "
                f"{len(heard.answering)} of the job's "
                f"{len(heard.answering) + len(heard.silent)} running pods answer, with "
                f"stale heartbeats (their workers wait for it) "
                f"(heartbeatTimeoutSeconds + initialHeartbeatTimeoutSeconds = "
                f"{int(hang_after.total_seconds())} s)",
                node=pod.node_name,
            ))
    return faults


def _lone_silent_pod_fault(p: Pass, heard: Silence, bar: timedelta) -> list[DetectedFault]:
    """The job's only pod that could hang, silent for longer than `bar`. Its node is not
    excluded: with no answering pod, the silence may be the operator's own network."""
    (index,) = heard.silent
    quiet = _silent_for(p, index)
    if quiet <= bar:
        return []
    pod = p.observed.trainer_pods[index]
    return [DetectedFault(
        IncidentCause.HEARTBEAT_TIMEOUT, index, p.now,
        f"no heartbeat from pod {pod.name}: it stopped answering "
        f"{int(quiet.total_seconds())} s ago and it is the job's only running pod whose "
        f"heartbeat counts (a single-pod job): with no other pod answering, the operator cannot "
        f"tell its own network trouble from a frozen pod, so it waited "
        f"{LONE_SILENCE_FACTOR} x (heartbeatTimeoutSeconds + initialHeartbeatTimeoutSeconds) = "
        f"{int(bar.total_seconds())} s; its node is not excluded (silence alone is weak "
        f"evidence against it)",
        node=None,
    )]


def _stale_heartbeat_faults(
    p: Pass, heard: Silence, hang_after: timedelta
) -> list[DetectedFault]:
    """The answering pods whose newest heartbeat since their clock (or the clock itself, with
    none since) was older than both timeouts when it was read."""
    faults: list[DetectedFault] = []
    for index in heard.answering:
        clock = pod_clock(p, index)
        if clock is None:
            continue
        beat = p.ranks[index].last_heartbeat_time
        evidence = beat if beat is not None and beat >= clock else clock
        if read_moment(p, index) - evidence > hang_after:
            seen = f"since {iso(beat)}" if beat is not None and beat >= clock else (
                f"since the pods started at {iso(clock)}")
            faults.append(DetectedFault(
                IncidentCause.HEARTBEAT_TIMEOUT, index, p.now,
                f"no heartbeat from pod {naming.trainer_pod_name(p.job.name, index)} {seen} "
                f"(heartbeatTimeoutSeconds + initialHeartbeatTimeoutSeconds = "
                f"{int(hang_after.total_seconds())} s)",
                node=p.observed.trainer_pods[index].node_name,
            ))
    return faults


def _progress_faults(p: Pass) -> list[DetectedFault]:
    """The job's slowest step did not advance for progressTimeoutSeconds although every rank
    sends heartbeats (the step and since when it stood are kept in `p.progress_*`)."""
    ft = p.spec.fault_tolerance
    clock = clock_start(p)
    if clock is None or any(finishing(p, i) for i in p.active()):
        # No job-wide step to watch: a pod is missing, or the training is ending.
        p.progress_step, p.progress_since = None, None
        return []

    steps = {i: p.ranks[i].step for i in p.active()}
    nodes = [node_liveness(p, i) for i in p.active()]
    if any(n is None or completed_step(n) is None for n in nodes):
        return []
    if any(n is not None and oldest_heartbeat(n) is None for n in nodes):
        # A rank that answers but has not sent its first heartbeat is still starting (imports,
        # model, checkpoint load: initialHeartbeatTimeoutSeconds covers that); the step it
        # shows is no stall. The progress clock starts at the first heartbeats.
        p.progress_step, p.progress_since = None, None
        return []
    job_step = min(s for s in steps.values() if s is not None)
    if p.progress_step is None or job_step > p.progress_step or p.progress_since is None:
        p.progress_step, p.progress_since = job_step, p.now
        return []
    all_beating = all(
        (b := p.ranks[i].last_heartbeat_time) is not None and b >= clock and fresh(p, i, b)
        for i in p.active()
    )
    stalled_since = max(p.progress_since, clock)
    if not all_beating or p.now - stalled_since <= timedelta(seconds=ft.progress_timeout_seconds):
        return []
    slowest = min(steps, key=lambda i: steps[i] or 0)
    laggard = (steps[slowest] or 0) < max(s or 0 for s in steps.values())
    message = (f"step {job_step} has not advanced since {iso(p.progress_since)} "
               f"(progressTimeoutSeconds={ft.progress_timeout_seconds})")
    p.progress_step, p.progress_since = None, None
    if laggard:
        return [DetectedFault(IncidentCause.PROGRESS_TIMEOUT, slowest, p.now, message)]
    return [DetectedFault(IncidentCause.PROGRESS_TIMEOUT, None, p.now, message, whole_job=True)]
