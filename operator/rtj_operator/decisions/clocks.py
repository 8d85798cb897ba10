"""The clocks and readings the hang rules (hangs.py) and the pod faults (podfaults.py) share:
what a pod's scraped ranks say (`oldest_heartbeat`, `completed_step`, `node_heartbeat`, whether it
is `finishing` or `not_reporting`), when a heartbeat counts as fresh (`read_moment`, `fresh`) and
from when each pod's heartbeat timeout and the job's progress timeout count (`pod_clock`,
`shared_clock`, `starting_peer`, `clock_start`). Pure functions of the pass (`state.Pass`).
"""

from __future__ import annotations

from datetime import datetime, timedelta

from rtj_operator.decisions.state import Pass, from_unix
from rtj_operator.observed import NodeLiveness


def oldest_heartbeat(node: NodeLiveness, *, listed_only: bool = False) -> float | None:
    """The oldest heartbeat (Unix time) of the pod's ranks, when every rank answered with one
    (`listed_only`, a team's own script: every rank the pod lists, when it lists any)."""
    beats = [s.heartbeat for s in node.samples if s.heartbeat is not None]
    if listed_only:
        return min(beats) if node.samples and len(beats) == len(node.samples) else None
    if not node.complete or len(beats) != node.expected_ranks:
        return None
    return min(beats)


def not_reporting(p: Pass, index: int) -> bool:
    """The pod's workers report nothing: a team's own script (not the built-in trainer) whose pod
    answers with no rank listed (none serves a metrics page, none connected to its NVRx rank
    monitor). Such a pod is supervised as processes only (exits, lost pods): it is never
    declared hung or stale, and the job's `HangDetection` condition says so (docs/byo.md)."""
    if p.builtin_trainer:
        return False
    node = node_liveness(p, index)
    return node is not None and not node.samples


def completed_step(node: NodeLiveness) -> int | None:
    """The step every rank of the pod has completed, when every rank answered."""
    steps = [s.step for s in node.samples if s.step is not None]
    if not node.complete or len(steps) != node.expected_ranks:
        return None
    return min(steps)


def node_heartbeat(p: Pass, index: int) -> datetime | None:
    """The node's newest known heartbeat: scraped now, else what status remembers."""
    node = p.liveness.get(index)
    pod = p.observed.trainer_pods.get(index)
    if node is not None and pod is not None and node.pod_uid == pod.uid:
        beat = oldest_heartbeat(node, listed_only=not p.builtin_trainer)
        if beat is not None:
            return from_unix(beat)
    previous = p.prev_ranks.get(index)
    if previous is not None and pod is not None and previous.attempt == pod.attempt:
        return previous.last_heartbeat_time
    return None


def node_liveness(p: Pass, index: int) -> NodeLiveness | None:
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
    node = node_liveness(p, index)
    return (pod is not None and pod.phase == "Running" and not pod.deleting
            and node is not None and node.finished)


def read_moment(p: Pass, index: int) -> datetime:
    """When what the pass knows of the pod's heartbeat was read: its liveness read's own time
    (a pass may reuse a read from a moment ago), else the pass's clock. A heartbeat's age is
    measured at its read: an old read never makes a heartbeat look staler than it was."""
    node = node_liveness(p, index)
    if node is not None and node.read_time is not None:
        return from_unix(node.read_time)
    return p.now


def fresh(p: Pass, index: int, beat: datetime) -> bool:
    """Whether heartbeat `beat` of the pod was younger than heartbeatTimeoutSeconds when it was
    read."""
    limit = timedelta(seconds=p.spec.fault_tolerance.heartbeat_timeout_seconds)
    return read_moment(p, index) - beat <= limit


def pod_clock(p: Pass, index: int) -> datetime | None:
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
    moments = [m for m in (shared_clock(p), pod.started_at) if m is not None]
    if not p.builtin_trainer:
        # A script's rank monitor times a worker from its connection (its initial heartbeat
        # timeout applies until its first heartbeat): so does the operator.
        node = node_liveness(p, index)
        moments += [from_unix(s.connected_time) for s in (node.samples if node else ())
                    if s.connected_time]
    return max(moments) if moments else None


def shared_clock(p: Pass) -> datetime | None:
    """The part of every pod's clock that does not depend on the pod: the latest start of the
    training (not standby) pods that run, the rendezvous pod's start and the last recovery.
    Computed once per pass (`pod_clock` runs for every pod, several times): again only when
    the standby pods or the incidents changed since (`Pass.clock_key`)."""
    key = p.clock_key()
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


def starting_peer(p: Pass) -> int | None:
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


def clock_start(p: Pass) -> datetime | None:
    """When every trainer pod was last (re)started or the last recovery began: the reference
    from which the job-wide progress timeout counts. None while some active pod or the
    rendezvous pod is not running (the job's slowest step means nothing then); heartbeat
    timeouts count per pod instead (`pod_clock`)."""
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
