"""Rule 7, finding the faults of the pods themselves.

A fault is a trainer pod that failed, vanished or was deleted by someone else; a trainer pod a
voluntary disruption ends (a drain's eviction, the scheduler's preemption: `PodEvicted`); a pod
whose node is lost (NotReady/unreachable, tainted by the node controller) and whose heartbeats
stopped (`NodeLost`); a pod still Pending `podStartTimeoutSeconds` after it was created
(`PodStartTimeout`); or the rendezvous pod lost (gone, deleting, ended, on a lost node, or never
started) or evicted. `lost_pods` records, before every rule, which pods are safe to force-delete.

Once training is done on every rank (`training_done`) nothing is a fault any more: a pod lost
then has lost nothing (rule 6 finishes the job). When the pods show no fault, `find_faults` looks
for hangs (`hangs.py`). What the operator does about a fault is `recovery.py`.
"""

from __future__ import annotations

from datetime import timedelta

from rtj_operator import naming
from rtj_operator.api.vocabulary import ConditionType, IncidentCause, RankState
from rtj_operator.decisions.clocks import (
    completed_step,
    node_liveness,
    oldest_heartbeat,
    read_moment,
)
from rtj_operator.decisions.hangs import finishing, hang_faults, node_heartbeat
from rtj_operator.decisions.state import DetectedFault, Pass, from_unix, iso, some
from rtj_operator.launcher import NO_RESTART_EXIT_CODE
from rtj_operator.observed import PodView


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
NOT_THE_NODES_FAULT = BENIGN_WAITING | {"InvalidImageName", "CreateContainerConfigError"}
"""Waiting reasons after which a `PodStartTimeout` excludes no node: the kubelet says
`ContainerCreating` while it pulls the image (a cold pull of a 20-30 GB trainer image can take
longer than the timeout on a good node: review-2 F11), and a bad image name or a container
config naming a missing Secret fails on every node alike. A pull that failed (`ErrImagePull`,
`ImagePullBackOff`) still excludes the node: the same image pulls elsewhere when the node's
disk or its way to the registry is what failed."""


def lost_pods(p: Pass) -> None:
    """Record (`p.lost`) the pods that are safe to force-delete: a trainer pod on a lost node
    whose heartbeats stopped (a pod that still answers with heartbeats is still running, and a
    second pod of its name would join the job beside it), and the rendezvous pod on a lost node
    (the trainers reach the rendezvous through its Service, never the old pod). Runs before
    every rule: suspending, failing or finishing a job force-deletes these pods too. Nothing is
    lost while every node is NotReady at once (`Observed.nodes_disrupted`): that is the control
    plane's or the network's failure, and the pods most likely train on."""
    if p.observed.nodes_disrupted is not None:
        return
    limit = timedelta(seconds=p.spec.fault_tolerance.heartbeat_timeout_seconds)
    for index, pod in p.observed.trainer_pods.items():
        # Measured against now, not at the pod's last read: a pod on a lost node is not read
        # any more (it does not answer, or it is Terminating), and its last read, however
        # fresh then, is no evidence that it still runs.
        beat = node_heartbeat(p, index)
        if (pod.node_lost and (beat is None or p.now - beat > limit)
                and peers_train_on(p, index) is None):
            p.lost[pod.uid] = pod.node_name or ""
    rendezvous = p.observed.rendezvous_pod
    if rendezvous is not None and rendezvous.node_lost:
        p.lost[rendezvous.uid] = rendezvous.node_name or ""


def peers_train_on(p: Pass, index: int) -> int | None:
    """The peers' word that the pod on a lost node still takes part in the collectives
    (review-2 F6: a node cut off from the control plane but not from its peers keeps training):
    the slowest step every other training pod of the job completed, read in this pass, when it
    is more than one step past the last step the pod itself reported, and those pods' ranks
    leave exactly room for the pod's own in the world (`spec.nodes` x procs per node). In
    synchronous training no step completes without every rank of the world, and every other pod
    answered, so the missing ranks are the pod's: it still trains, and a second pod of its name
    would wait beside it in a rendezvous nobody opens, be declared hung, and cost budget and a
    healthy node, again and again.

    The peers must still beat (every peer's heartbeats at most `heartbeatTimeoutSeconds` old
    at their read): peers stuck in a collective, waiting for a pod that froze with its node, also
    stand a few steps past the pod's last report (the steps it took after its last read), and
    stay there; their stopped heartbeats tell that they do not train on with it (the campaign of
    2026-12-05: without this, such a pod was held for ~290 s, until a HeartbeatTimeout replaced
    its peers).

    With warm spares, a pod whose every rank is standby trains nothing and is left out; NVRx's
    `FillGaps` moves a spare into the ranks of a pod that left the world, and that spare then
    reports its ranks as training: the peers then fill the world without the pod, and there is
    no word. The word also needs a spare still standby (with none left, NVRx may go on with a
    smaller world, which the peers' progress cannot tell from the pod's). A spare's read is up
    to a sweep old: until its takeover is read, the pod may be held for that long, no longer.

    None (no such word: the pod may be force-deleted) when a peer does not answer for every
    rank, or the pod never reported a step in its attempt."""
    pod = p.observed.trainer_pods[index]
    previous = p.prev_ranks.get(index)
    if previous is None or previous.step is None or previous.attempt != pod.attempt:
        return None
    procs = p.plan.procs_per_node
    limit = timedelta(seconds=p.spec.fault_tolerance.heartbeat_timeout_seconds)
    training_ranks = 0
    spare_standing_by = False
    steps = []
    for other in range(p.pods):
        if other == index:
            continue
        node = node_liveness(p, other)
        if node is None or not node.complete:
            return None  # every peer must answer for the word to count
        if all(sample.standby for sample in node.samples):
            spare_standing_by = True
            continue
        step = completed_step(node)
        beat = oldest_heartbeat(node, listed_only=not p.builtin_trainer)
        if step is None or beat is None or read_moment(p, other) - from_unix(beat) > limit:
            return None  # no step, or stuck: its heartbeats stopped too
        steps.append(step)
        training_ranks += len(node.samples)
    if p.spec.fault_tolerance.spares and not spare_standing_by:
        return None
    if training_ranks + procs > p.spec.nodes * procs:
        return None  # the peers fill the world: the pod's ranks were given to a spare
    if not steps or min(steps) <= previous.step + 1:
        return None
    return min(steps)


def _lost_node_fault(p: Pass, index: int, pod: PodView) -> DetectedFault:
    beat = node_heartbeat(p, index)
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
    blame_node = problem is None or problem[0] not in NOT_THE_NODES_FAULT
    return DetectedFault(
        IncidentCause.POD_START_TIMEOUT, index, p.now,
        f"pod {pod.name} is still Pending {where} since {iso(pod.created_at)} "
        f"(podStartTimeoutSeconds={timeout}): {why}"
        + ("" if blame_node or not pod.node_name else
           " (its node is not excluded: an image pull or container start is not its fault)"),
        whole_job=index is None, node=pod.node_name if blame_node else None,
    )


PEER_VERDICT_GRACE = timedelta(seconds=15)
"""How long a launcher's bare no-restart exit waits for the pod that caused it to report."""


def following_a_peer(p: Pass, pod: PodView) -> bool:
    """A launcher that exited 93 without a message of its own stopped because another launcher
    of the job said "do not restart" (rtj_trainer.launcher): the reason is in that pod's
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
    """The faults of this pass: the pods' own, else the hangs (`hangs.hang_faults`)."""
    if training_done(p):
        # Nothing is left to recover: a pod lost now is finished by rule 6 (completion), and
        # a lost rendezvous only ends the exit barrier early.
        return []
    drifted = _built_from_another_spec(p)
    if drifted is not None:
        return [drifted]  # every pod starts again: nothing else of this pass matters
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
        faults.extend(hang_faults(p))
    return faults


def _built_from_another_spec(p: Pass) -> DetectedFault | None:
    """A pod still running that was built from another spec than the job's (its spec-hash
    label): the job restarts every pod from the new spec (`recovery.restart_for_new_spec`).
    Pods without the label (made by an older operator) are taken as current (review-2 F4)."""
    current = p.job.spec.pod_spec_hash()
    pods = [*p.observed.trainer_pods.values(), p.observed.rendezvous_pod]
    stale = sorted(pod.name for pod in pods
                   if pod is not None and not pod.deleting and not pod.terminated
                   and pod.spec_hash is not None and pod.spec_hash != current)
    if not stale:
        return None
    return DetectedFault(
        IncidentCause.SPEC_CHANGED, None, p.now,
        f"pod(s) {some(stale)} run(s) an older spec (a setting that may change only while "
        f"suspended changed without a suspend seen by the operator): every pod starts again "
        f"from the new spec", whole_job=True)


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
