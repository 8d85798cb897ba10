"""Which pod events prove that a trainer pod's processes are gone, and which pods to tell.

Why: a job with in-process restart (and warm spares) recovers from a lost pod inside the other
pods' processes, but NVRx's wrapper in them learns of the loss only from sibling heartbeats, after
`resiliency.inprocess_pod_loss_timeout_seconds` (docs/operator.md, "Warm spares"). Kubernetes
says it sooner, and on evidence: a pod whose phase is `Failed` has no container left running
(restartPolicy Never; the container runtime kills what a container leaves behind). The operator
tells the job's other running trainer pods at once, from the pod's watch event, not at the next
reconcile pass (`handlers.announce_pod_loss`); the trainers mark the lost ranks the way NVRx's
sibling monitor would (rtj_trainer.podloss).

Only `Failed` counts. A pod that is merely deleted or Terminating may still run (a graceful
stop commits a checkpoint with every rank first), a pod on an unreachable node may still run
cut off, and a pod that ended with exit code 0 finished or was stopped on purpose (a suspend):
none of them is announced, and NVRx's heartbeats decide as before. A pod is announced once.
"""

from __future__ import annotations

from collections.abc import Iterable

from rtj_wire import env as wire_env

from rtj_operator import naming
from rtj_operator.api.vocabulary import IncidentCause
from rtj_operator.intents import AnnouncePodLoss
from rtj_operator.observed import PodView

SPARES_ENV = wire_env.SPARE_NODES
"""The trainer variable (trainerenv.trainer_env) with the job's number of warm spare pods."""
IN_PROCESS_RESTART_ENV = wire_env.INPROCESS_RESTART
"""The trainer variable (trainerenv.trainer_env) that says the pod's workers run NVRx's in-process
wrapper: only they can use an announcement."""


def announcement(
    pod: PodView,
    *,
    in_process_restart: bool,
    peers: Iterable[PodView],
    already_announced: bool,
    spares: int = 0,
) -> AnnouncePodLoss | None:
    """What to tell whom after a watch event that shows `pod` (None: nothing).

    `peers` are the job's pods as the operator's watch cache has them (consumed only when
    `pod` failed: the handler views them lazily); the running trainer pods among them other than
    `pod` are told. Only a job with warm spares (`spares`, the
    pods' RTJ_SPARE_NODES) is told: without a spare to fill the lost ranks, marking them
    terminated lets NVRx's wrapper go on with a smaller world (measured: the job finished with
    a NaN loss), where the launchers must restart with the replacement pod instead."""
    if (already_announced or not in_process_restart or spares <= 0
            or pod.role != naming.ROLE_TRAINER or pod.phase != "Failed"):
        return None
    targets = sorted({
        peer.pod_ip for peer in peers
        if peer.uid != pod.uid and peer.role == naming.ROLE_TRAINER and peer.phase == "Running"
        and not peer.deleting and peer.pod_ip
    })
    if not targets:
        return None
    return AnnouncePodLoss(uid=pod.uid, name=pod.name, cause=IncidentCause.POD_FAILED,
                           peers=tuple(targets))
