"""Rule 7, finding faults: the ranks' state from the pods and the scraped metrics, and the
faults in them.

A fault is a trainer pod that failed, vanished or was deleted by someone else; a pod whose node
is lost (NotReady/unreachable, tainted by the node controller) and whose heartbeats stopped
(`NodeLost`); a pod still Pending `podStartTimeoutSeconds` after it was created
(`PodStartTimeout`); the rendezvous pod lost (gone, deleting, ended, on a lost node, or never
started); a rank without a heartbeat for `heartbeatTimeoutSeconds +
initialHeartbeatTimeoutSeconds` (ft_launcher had its chance to restart the workers inside the pod
first); or a job whose slowest step did not advance for `progressTimeoutSeconds` although every
rank sends heartbeats.

The heartbeat timeout counts per pod (`_pod_clock`): from the latest of the pod's own start, the
start of every other training pod that runs, the rendezvous pod's start and the last recovery;
so a pod that is Terminating, being replaced or on a lost node does not switch hang detection off
for the others. Only a pod still Pending within `podStartTimeoutSeconds` holds the others'
heartbeat timeouts (their launchers wait for it in the rendezvous), and that deadline bounds the
wait (`_starting_peer`). The job-wide progress timeout (`_clock_start`) still needs every active
pod and the rendezvous pod Running: the slowest step means nothing while a pod is missing.

A hang is declared only on evidence (`silence`, `_liveness_faults`):
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

The whole hang policy lives here, including how one pod's ranks add up (`oldest_heartbeat`,
`completed_step`: only a pod whose every local rank answered counts); `observed.py` holds only what
was scraped. What the operator does about a fault is `recovery.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from rtj_operator import naming
from rtj_operator.api.status import ConditionType, IncidentCause, RankState
from rtj_operator.decisions.state import DetectedFault, Pass, from_unix, iso
from rtj_operator.launcher import NO_RESTART_EXIT_CODE
from rtj_operator.observed import NodeLiveness, PodView


def oldest_heartbeat(node: NodeLiveness) -> float | None:
    """The oldest heartbeat (Unix time) of the pod's ranks, when every rank answered with one."""
    beats = [s.heartbeat for s in node.samples if s.heartbeat is not None]
    if not node.complete or len(beats) != node.expected_ranks:
        return None
    return min(beats)


def completed_step(node: NodeLiveness) -> int | None:
    """The step every rank of the pod has completed, when every rank answered."""
    steps = [s.step for s in node.samples if s.step is not None]
    if not node.complete or len(steps) != node.expected_ranks:
        return None
    return min(steps)


# --- rule 7: faults -----------------------------------------------------------------------------


def _node_heartbeat(p: Pass, index: int) -> datetime | None:
    """The node's newest known heartbeat: scraped now, else what status remembers."""
    node = p.liveness.get(index)
    pod = p.observed.trainer_pods.get(index)
    if node is not None and pod is not None and node.pod_uid == pod.uid:
        beat = oldest_heartbeat(node)
        if beat is not None:
            return from_unix(beat)
    previous = p.prev_ranks.get(index)
    if previous is not None and pod is not None and previous.attempt == pod.attempt:
        return previous.last_heartbeat_time
    return None


def _node_liveness(p: Pass, index: int) -> NodeLiveness | None:
    node = p.liveness.get(index)
    pod = p.observed.trainer_pods.get(index)
    if node is None or pod is None or node.pod_uid != pod.uid:
        return None
    return node


def finishing(p: Pass, index: int) -> bool:
    """The pod runs, but its launcher reports that every local worker exited 0: its training is
    done and the launcher waits in torchelastic's exit barrier for the others (5 s in a job
    with spares). Its heartbeats stopped for that reason: it is neither hung nor stale."""
    pod = p.observed.trainer_pods.get(index)
    node = _node_liveness(p, index)
    return (pod is not None and pod.phase == "Running" and not pod.deleting
            and node is not None and node.finished)


def training_finished(p: Pass, index: int) -> bool:
    """The pod finished its training: it exited 0 at the end of training (not a stop), or it
    is `finishing`."""
    pod = p.observed.trainer_pods.get(index)
    return pod is not None and (pod.completed_training or finishing(p, index))


def training_done(p: Pass) -> bool:
    """Every rank of the job finished its training and committed its final checkpoint: a trainer
    pod said `Succeeded` in its termination message, or its launcher reports that every local
    worker exited 0 (`finishing`). The trainer gets there only past its end-of-training barrier,
    which every rank passes once every final checkpoint is committed (rtj_trainer.trainer
    `finish`). From then on a pod that fails, vanishes or is lost has lost nothing: there is no
    fault to recover, only a job to finish (lifecycle.completion)."""
    return any(
        (pod.completed_training and pod.outcome is not None and pod.outcome.outcome == "Succeeded")
        or finishing(p, index)
        for index, pod in p.observed.trainer_pods.items()
    )


def failure_reason(pod: PodView) -> str:
    """How a failed pod's failure is named in messages: its exit code, else the kubelet's reason."""
    return f"exit code {pod.exit_code}" if pod.exit_code is not None else (
        pod.reason or "unknown reason")


BENIGN_WAITING = frozenset({"ContainerCreating", "PodInitializing"})
"""Reasons a container waits that are a normal part of starting (not shown at once)."""


def _read_moment(p: Pass, index: int) -> datetime:
    """When what the pass knows of the pod's heartbeat was read: its liveness read's own time
    (a pass may reuse a read from a moment ago), else the pass's clock. A heartbeat's age is
    measured at its read: an old read never makes a heartbeat look staler than it was."""
    node = _node_liveness(p, index)
    if node is not None and node.read_time is not None:
        return from_unix(node.read_time)
    return p.now


def _fresh(p: Pass, index: int, beat: datetime) -> bool:
    """Whether heartbeat `beat` of the pod was younger than heartbeatTimeoutSeconds when it was
    read."""
    limit = timedelta(seconds=p.spec.fault_tolerance.heartbeat_timeout_seconds)
    return _read_moment(p, index) - beat <= limit


def _beating(p: Pass, index: int) -> bool:
    """Whether the pod's newest heartbeat is younger than heartbeatTimeoutSeconds."""
    beat = _node_heartbeat(p, index)
    return beat is not None and _fresh(p, index, beat)


def lost_pods(p: Pass) -> None:
    """Record (`p.lost`) the pods that are safe to force-delete: a trainer pod on a lost node
    whose heartbeats stopped (a pod that still answers with heartbeats is still running, and a
    second pod of its name would join the job beside it), and the rendezvous pod on a lost node
    (the trainers reach the rendezvous through its Service, never the old pod). Runs before
    every rule: suspending, failing or finishing a job force-deletes these pods too."""
    limit = timedelta(seconds=p.spec.fault_tolerance.heartbeat_timeout_seconds)
    for index, pod in p.observed.trainer_pods.items():
        # Measured against now, not at the pod's last read: a pod on a lost node is not read
        # any more (it does not answer, or it is Terminating), and its last read, however
        # fresh then, is no evidence that it still runs.
        beat = _node_heartbeat(p, index)
        if pod.node_lost and (beat is None or p.now - beat > limit):
            p.lost[pod.uid] = pod.node_name or ""
    rendezvous = p.observed.rendezvous_pod
    if rendezvous is not None and rendezvous.node_lost:
        p.lost[rendezvous.uid] = rendezvous.node_name or ""


def _pod_clock(p: Pass, index: int) -> datetime | None:
    """When the pod's heartbeat timeout starts counting: the latest of its own (re)start, the
    start of every other training pod that runs (its workers wait for theirs), the rendezvous
    pod's start and the last recovery. None while the pod or the rendezvous pod is not
    running: a pod that is not running has no heartbeats to miss."""
    pod = p.observed.trainer_pods.get(index)
    rendezvous = p.observed.rendezvous_pod
    if pod is None or pod.phase != "Running" or pod.deleting:
        return None
    if rendezvous is None or rendezvous.phase != "Running" or rendezvous.deleting:
        return None
    moments = [m for m in (_shared_clock(p), pod.started_at) if m is not None]
    return max(moments) if moments else None


def _shared_clock(p: Pass) -> datetime | None:
    """The part of every pod's clock that does not depend on the pod: the latest start of the
    training (not standby) pods that run, the rendezvous pod's start and the last recovery.
    Computed once per pass (`_pod_clock` runs for every pod, several times): again only when
    the standby pods or the incidents changed since."""
    key = (len(p.standby), len(p.incidents))
    if p.shared_clock is not None and p.shared_clock[0] == key:
        return p.shared_clock[1]
    starts = [pod.started_at for i, pod in p.observed.trainer_pods.items()
              if i not in p.standby and pod.phase == "Running" and not pod.deleting
              and pod.started_at is not None]
    rendezvous = p.observed.rendezvous_pod
    if rendezvous is not None and rendezvous.started_at is not None:
        starts.append(rendezvous.started_at)
    acted = [i.acted_time for i in p.incidents if i.acted_time is not None]
    moments = starts + acted
    clock = max(moments) if moments else None
    p.shared_clock = (key, clock)
    return clock


def _starting_peer(p: Pass) -> int | None:
    """An active pod that is Pending within podStartTimeoutSeconds of its creation, if any.
    Every launcher waits for it in the rendezvous, so the others send no heartbeats meanwhile:
    their heartbeat timeouts wait, for at most podStartTimeoutSeconds (then the Pending pod is
    a `PodStartTimeout` fault). A pod Terminating or on a lost node holds no clock."""
    timeout = timedelta(seconds=p.spec.fault_tolerance.pod_start_timeout_seconds)
    for index in p.active():
        pod = p.observed.trainer_pods.get(index)
        if (pod is not None and pod.phase == "Pending" and not pod.deleting
                and pod.uid not in p.lost
                and (pod.created_at is None or p.now - pod.created_at <= timeout)):
            return index
    return None


def _clock_start(p: Pass) -> datetime | None:
    """When every trainer pod was last (re)started or the last recovery began: the reference
    from which the job-wide progress timeout counts. None while some active pod or the
    rendezvous pod is not running (the job's slowest step means nothing then); heartbeat
    timeouts count per pod instead (`_pod_clock`)."""
    # Standby pods (warm spares, replacements waiting for a round) train nothing: one that is
    # pending or restarting does not stop the clocks of the pods that do.
    pods = {i: pod for i, pod in p.observed.trainer_pods.items() if i not in p.standby}
    if any(i not in pods for i in p.active()) or any(
        pod.phase != "Running" or pod.deleting for pod in pods.values()
    ):
        return None
    rendezvous = p.observed.rendezvous_pod
    if rendezvous is None or rendezvous.phase != "Running" or rendezvous.deleting:
        return None
    starts = [pod.started_at for pod in pods.values() if pod.started_at is not None]
    acted = [i.acted_time for i in p.incidents if i.acted_time is not None]
    moments = starts + acted
    return max(moments) if moments else None


def _standby(p: Pass, index: int, node: NodeLiveness | None) -> bool:
    """Whether the pod trains nothing now: its every rank says it is a warm spare, or it is a
    replacement still waiting for the next launcher round (no worker answers yet; once its
    ranks answer, it joined a round and is no longer waiting)."""
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
        node = _node_liveness(p, index)
        beat = _node_heartbeat(p, index)
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
        p.rank(index, pod=pod.name, node=pod.node_name, attempt=pod.attempt,
               last_heartbeat_time=beat, step=step, state=state, unresponsive_since=None)
    for index in p.active():
        clock = _pod_clock(p, index)
        beat = p.ranks[index].last_heartbeat_time
        if (clock is not None and beat is not None and beat >= clock and _fresh(p, index, beat)
                and p.ranks[index].state != RankState.SUCCEEDED):
            p.rank(index, state=RankState.RUNNING)
        pod = p.observed.trainer_pods.get(index)
        if clock is not None and pod is not None and _node_liveness(p, index) is None:
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


def silence(p: Pass) -> Silence:
    """Sort the job's pods that could hang in this pass into silent and answering ones."""
    starting = _starting_peer(p)
    silent: list[int] = []
    answering: list[int] = []
    stuck = False
    for index in p.active():
        clock = _pod_clock(p, index)
        if clock is None or (starting is not None and starting != index) or finishing(p, index):
            continue  # not counting, held by a starting peer, or done training
        if _node_liveness(p, index) is None:
            silent.append(index)
            continue
        answering.append(index)
        beat = p.ranks[index].last_heartbeat_time
        if beat is None or beat < clock or not _fresh(p, index, beat):
            stuck = True
    outage = not answering or 2 * len(answering) < len(silent) + len(answering)
    return Silence(tuple(silent), tuple(answering), outage, stuck)


def _silent_for(p: Pass, index: int) -> timedelta:
    """How long the pod has been silent, counted from its clock at the earliest."""
    pod = p.observed.trainer_pods[index]
    clock = _pod_clock(p, index)
    since = p.unobserved_since.get(pod.uid, p.now)
    if clock is not None and clock > since:
        since = clock
    return p.now - since


def degraded_observation(p: Pass) -> str | None:
    """Why observation is degraded: running pods whose liveness could not be read for longer
    than heartbeatTimeoutSeconds, when that silence is no evidence against them (`Silence`:
    an outage, or a job that trains on without them being read); None when every pod could
    be read recently, or the silent pods are the suspects of a stuck job."""
    if silence(p).evidence:
        return None
    limit = timedelta(seconds=p.spec.fault_tolerance.heartbeat_timeout_seconds)
    names = {pod.uid: pod.name for pod in p.observed.trainer_pods.values()}
    silent = sorted(names[uid] for uid, since in p.unobserved_since.items()
                    if p.now - since >= limit and uid in names)
    if not silent:
        return None
    shown = ", ".join(silent[:5]) + (f" and {len(silent) - 5} more" if len(silent) > 5 else "")
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
    + initialHeartbeatTimeoutSeconds (`_liveness_faults`). A pod that does not answer is never
    Unresponsive: could not observe is not a stale heartbeat."""
    ft = p.spec.fault_tolerance
    for index in silence(p).answering:
        clock = _pod_clock(p, index)
        rank = p.ranks[index]
        beat = rank.last_heartbeat_time
        if clock is None or beat is None or beat < clock or _fresh(p, index, beat):
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
    decides it: the operator schedules one there instead of waiting for its next full pass."""
    ft = p.spec.fault_tolerance
    stale_after = timedelta(seconds=ft.heartbeat_timeout_seconds)
    hang_after = stale_after + timedelta(seconds=ft.initial_heartbeat_timeout_seconds)
    deadlines: dict[int, datetime] = {}
    for index in silence(p).answering:
        if p.ranks[index].state not in (RankState.RUNNING, RankState.UNRESPONSIVE,
                                        RankState.STARTING):
            continue  # being replaced in this pass
        clock = _pod_clock(p, index)
        if clock is None:
            continue
        beat = p.ranks[index].last_heartbeat_time
        moments = ([beat + stale_after, beat + hang_after] if beat is not None and beat >= clock
                   else [clock + hang_after])
        read = _read_moment(p, index)
        upcoming = [m for m in moments if m >= read]
        if upcoming:
            deadlines[index] = min(upcoming)
    return deadlines


def _lost_node_fault(p: Pass, index: int, pod: PodView) -> DetectedFault:
    beat = _node_heartbeat(p, index)
    seen = f"since {iso(beat)}" if beat is not None else "ever"
    return DetectedFault(
        IncidentCause.NODE_LOST, index, p.now,
        f"node {pod.node_name} of pod {pod.name} is lost (Ready={pod.node_ready}, tainted "
        f"unreachable/not-ready) and the pod sent no heartbeat {seen}: force-deleting it",
        node=pod.node_name,
    )


def _not_starting(p: Pass, pod: PodView, index: int | None) -> DetectedFault | None:
    """Record why a Pending pod does not start (shown at once in the PodsNotStarting
    condition); past podStartTimeoutSeconds from its creation it is a fault."""
    if pod.phase != "Pending" or pod.deleting:
        return None
    timeout = p.spec.fault_tolerance.pod_start_timeout_seconds
    problem = pod.start_problem
    late = pod.created_at is not None and p.now - pod.created_at > timedelta(seconds=timeout)
    if problem is not None and (late or problem[0] not in BENIGN_WAITING):
        p.not_starting.append((pod.name, problem[0], problem[1]))
    elif late:
        p.not_starting.append((pod.name, IncidentCause.POD_START_TIMEOUT, "still Pending"))
    if not late or pod.created_at is None:
        return None
    why = f"{problem[0]}: {problem[1]}" if problem is not None else "no reason given"
    where = f"on node {pod.node_name}" if pod.node_name else "unscheduled"
    return DetectedFault(
        IncidentCause.POD_START_TIMEOUT, index, p.now,
        f"pod {pod.name} is still Pending {where} since {iso(pod.created_at)} "
        f"(podStartTimeoutSeconds={timeout}): {why}",
        whole_job=index is None, node=pod.node_name,
    )


PEER_VERDICT_GRACE = timedelta(seconds=15)
"""How long a launcher's bare no-restart exit waits for the pod that caused it to report."""


def following_a_peer(p: Pass, pod: PodView) -> bool:
    """A launcher that exited 93 without a message of its own stopped because another launcher
    of the job said "do not restart" (rtj_trainer.ftlaunch): the reason is in that pod's
    termination message, which may reach the API a moment later. While another trainer pod has
    not ended yet, wait for it, up to PEER_VERDICT_GRACE after this pod ended."""
    if pod.exit_code != NO_RESTART_EXIT_CODE or pod.outcome is not None:
        return False
    if pod.finished_at is not None and p.now >= pod.finished_at + PEER_VERDICT_GRACE:
        return False
    return any(other.phase not in ("Succeeded", "Failed")
               for other in p.observed.trainer_pods.values() if other is not pod)


def _closed_after_training(p: Pass, rendezvous: PodView | None) -> bool:
    """The rendezvous pod exited 0 after a trainer pod completed its training (exit 0, not a
    stop, or `finishing`): a launcher whose workers finished closes the rendezvous for good and
    nvrx-control then exits, while the other launchers may still wait in torchelastic's exit
    barrier (30 s when a standby spare never reaches it). That is the job ending (rule 6 finishes
    it once they exit), not a lost store."""
    if rendezvous is None or rendezvous.deleting or rendezvous.phase != "Succeeded":
        return False
    return any(training_finished(p, index) for index in p.observed.trainer_pods)


def find_faults(p: Pass) -> list[DetectedFault]:
    if training_done(p):
        # Nothing is left to recover: a pod lost now is finished by rule 6 (completion), and
        # a lost rendezvous only ends the exit barrier early.
        return []
    faults: list[DetectedFault] = []
    pods = p.observed.trainer_pods
    refused_before = any(c.type == ConditionType.ADMISSION_REFUSED and c.status == "True"
                         for c in p.prev.conditions)
    for index in range(p.pods):
        pod = pods.get(index)
        state = (p.prev_ranks.get(index).state  # type: ignore[union-attr]
                 if index in p.prev_ranks else None)
        if pod is not None and pod.uid in p.lost:
            if pod.deleting and state in (RankState.RESTARTING, RankState.SUSPENDED, None):
                # Already being replaced, but its kubelet will never confirm: free its name.
                p.delete_pod(pod, "its replacement waits for the name")
            else:
                faults.append(_lost_node_fault(p, index, pod))
            continue
        if pod is not None:
            late = _not_starting(p, pod, index)
            if late is not None:
                faults.append(late)
                continue
        if pod is None:
            if state == RankState.PENDING and refused_before:
                continue  # its create was refused (AdmissionRefused): created again, no fault
            if state in (RankState.STARTING, RankState.RUNNING, RankState.PENDING,
                     RankState.STANDBY, RankState.UNRESPONSIVE):
                gone_evicted = _evicted_before_seen(p, index)
                faults.append(_eviction(p, index, gone_evicted) if gone_evicted is not None else
                              DetectedFault(IncidentCause.POD_VANISHED, index, p.now,
                                            f"pod {naming.trainer_pod_name(p.job.name, index)} "
                                            "is gone"))
            continue
        if pod.deleting:
            if state not in (RankState.RESTARTING, RankState.SUSPENDED, None):
                faults.append(_eviction(p, index, pod) if pod.voluntarily_disrupted else
                              DetectedFault(IncidentCause.POD_DELETED, index, p.now,
                                            f"pod {pod.name} was deleted by someone else"))
            continue
        if pod.phase == "Failed" and not following_a_peer(p, pod):
            faults.append(DetectedFault(IncidentCause.POD_FAILED, index, pod.finished_at or p.now,
                                f"pod {pod.name} failed ({failure_reason(pod)})"))
    rendezvous = p.observed.rendezvous_pod
    live_trainers = [pod for pod in pods.values() if not pod.deleting]
    lost = rendezvous is not None and rendezvous.uid in p.lost
    rendezvous_evicted = _rendezvous_eviction(p)
    if live_trainers and rendezvous_evicted is not None:
        # Every pod starts again: the other faults of this pass need nothing more.
        return [rendezvous_evicted]
    if live_trainers and not _closed_after_training(p, rendezvous) and (
        rendezvous is None or rendezvous.deleting or rendezvous.terminated or lost
    ):
        # The store and the rounds are gone: every launcher fails; restart everything.
        detail = "is gone" if rendezvous is None else (
            f"is on lost node {rendezvous.node_name} (Ready={rendezvous.node_ready})" if lost
            else "is being deleted" if rendezvous.deleting else f"ended ({rendezvous.phase})")
        faults.append(DetectedFault(IncidentCause.RENDEZVOUS_LOST, None, p.now,
                            f"rendezvous pod {naming.rendezvous_name(p.job.name)} {detail}",
                            whole_job=True,
                            node=rendezvous.node_name if lost and rendezvous else None))
    elif rendezvous is not None and rendezvous.deleting and lost:
        p.delete_pod(rendezvous, "a new rendezvous pod waits for the name")
    elif rendezvous is not None:
        late = _not_starting(p, rendezvous, None)
        if late is not None and live_trainers:
            faults.append(late)
    if not faults:
        faults.extend(_liveness_faults(p))
    return faults


def _eviction(p: Pass, index: int, pod: PodView) -> DetectedFault:
    """A trainer pod a voluntary disruption ends (a drain's eviction, the scheduler's
    preemption): not a fault of the pod or its node."""
    where = f" from node {pod.node_name}" if pod.node_name else ""
    how = "preempted" if pod.disruption == "PreemptionByScheduler" else "evicted"
    return DetectedFault(
        IncidentCause.POD_EVICTED, index, p.now,
        f"pod {pod.name} was {how}{where} ({pod.disruption}): its trainers commit a checkpoint "
        "of the current step before they stop",
    )


def _evicted_before_seen(p: Pass, index: int) -> PodView | None:
    """The pod of `index` the pod watch saw evicted, when it went away before a pass saw it
    deleting: the same attempt the status shows, so an older eviction never counts."""
    previous = p.prev_ranks.get(index)
    if previous is None or previous.attempt is None:
        return None
    for seen in reversed(p.observed.stops):
        pod = seen.pod
        if (pod.role == naming.ROLE_TRAINER and pod.node_index == index
                and pod.attempt == previous.attempt and pod.voluntarily_disrupted):
            return pod
    return None


RENDEZVOUS_EVICTION_SEEN_SECONDS = 120
"""How recent an eviction of the rendezvous pod the pod watch saw must be to explain that the
rendezvous pod is gone (its pods carry no attempt to match, unlike trainer pods)."""


def _rendezvous_eviction(p: Pass) -> DetectedFault | None:
    """The rendezvous pod was evicted (Terminating with a voluntary `DisruptionTarget`, or gone
    while the pod watch saw it evicted recently) and this is not being recovered from yet:
    every pod is replaced, without spending a budget."""
    rendezvous = p.observed.rendezvous_pod
    evicted: PodView | None = None
    if rendezvous is not None and rendezvous.deleting and rendezvous.voluntarily_disrupted:
        evicted = rendezvous
    elif rendezvous is None:
        since = p.now - timedelta(seconds=RENDEZVOUS_EVICTION_SEEN_SECONDS)
        recent = [seen for seen in p.observed.stops
                  if seen.pod.role == naming.ROLE_RENDEZVOUS and seen.pod.voluntarily_disrupted
                  and seen.seen_at >= since]
        if recent and not any(i.cause == IncidentCause.POD_EVICTED and i.node_index is None
                              and i.acted_time is not None
                              and i.acted_time >= recent[-1].seen_at for i in p.incidents):
            evicted = recent[-1].pod
    if evicted is None:
        return None
    if any(i.cause == IncidentCause.POD_EVICTED and i.node_index is None
           and i.recovered_time is None for i in p.incidents):
        return None  # already being recovered from
    where = f" from node {evicted.node_name}" if evicted.node_name else ""
    return DetectedFault(
        IncidentCause.POD_EVICTED, None, p.now,
        f"rendezvous pod {evicted.name} was evicted{where} ({evicted.disruption}): every "
        "launcher lost the store and its trainers commit a checkpoint of the current step; every "
        "pod starts again",
        whole_job=True,
    )


def _liveness_faults(p: Pass) -> list[DetectedFault]:
    """Hangs: no heartbeat (per pod), or no progress although every rank sends heartbeats."""
    ft = p.spec.fault_tolerance
    hang_after = timedelta(
        seconds=ft.heartbeat_timeout_seconds + ft.initial_heartbeat_timeout_seconds
    )
    faults: list[DetectedFault] = []
    heard = silence(p)
    if heard.evidence:
        # A minority of silent pods in a stuck job: the silent ones are the suspects, once
        # their silence outlasts both timeouts; the answering ones wait for them meanwhile.
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
    # Without silent suspects: each answering pod on its own heartbeat. A silent pod is not
    # observed in this pass: no evidence either way (an outage, or a job that trains on).
    for index in heard.answering:
        clock = _pod_clock(p, index)
        if clock is None:
            continue
        beat = p.ranks[index].last_heartbeat_time
        evidence = beat if beat is not None and beat >= clock else clock
        if _read_moment(p, index) - evidence > hang_after:
            seen = f"since {iso(beat)}" if beat is not None and beat >= clock else (
                f"since the pods started at {iso(clock)}")
            faults.append(DetectedFault(
                IncidentCause.HEARTBEAT_TIMEOUT, index, p.now,
                f"no heartbeat from pod {naming.trainer_pod_name(p.job.name, index)} {seen} "
                f"(heartbeatTimeoutSeconds + initialHeartbeatTimeoutSeconds = "
                f"{int(hang_after.total_seconds())} s)",
                node=p.observed.trainer_pods[index].node_name,
            ))
    if faults:
        return faults
    clock = _clock_start(p)
    if clock is None or any(finishing(p, i) for i in p.active()):
        # No job-wide step to watch: a pod is missing, or the training is ending.
        p.progress_step, p.progress_since = None, None
        return []

    steps = {i: p.ranks[i].step for i in p.active()}
    nodes = [_node_liveness(p, i) for i in p.active()]
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
        (b := p.ranks[i].last_heartbeat_time) is not None and b >= clock and _fresh(p, i, b)
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
