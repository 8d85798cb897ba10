"""`status.lastCheckpoint` moving back (review-2 F14): it only moves up as the ranks commit,
except when a pass proves that the job no longer stands on it (`fallen_back`)."""

from __future__ import annotations

from rtj_operator.api.status import LastCheckpoint
from rtj_operator.decisions.clocks import node_liveness
from rtj_operator.decisions.state import Pass, from_unix, whole_second


def fallen_back(p: Pass, known: LastCheckpoint | None) -> LastCheckpoint | None:
    """The checkpoint the ranks went back to, when this pass proves that the job no longer
    stands on `known` (status.lastCheckpoint; review F14): every active pod answered with every
    rank, each rank names its newest committed checkpoint and its step, the newest of those
    checkpoints is older than `known` and every rank's step is below it. No process that knew
    `known` is left (a process never forgets a commit), and no rank trained from it: the ranks
    are a new attempt that resumed from an older checkpoint (the trainer fell back from one it
    could not read). None otherwise: a scrape that missed a pod or a rank, a rank that has not
    loaded its checkpoint yet, or ranks that lag behind a commit are no such evidence."""
    if known is None or not p.active():
        return None
    newest: tuple[int, float | None] | None = None
    for index in p.active():
        node = node_liveness(p, index)
        if node is None or not node.complete or len(node.samples) != node.expected_ranks:
            return None
        for sample in node.samples:
            if (sample.standby or sample.committed_step is None or sample.step is None
                    or sample.step >= known.step):
                return None
            if newest is None or sample.committed_step > newest[0]:
                newest = (sample.committed_step, sample.committed_time)
    if newest is None or newest[0] >= known.step:
        return None
    step, moment = newest
    p.event("Warning", CHECKPOINT_FELL_BACK,
            f"status.lastCheckpoint moves back from step {known.step} to step {step}: every "
            f"rank reports step {step} as its newest committed checkpoint and trains below step "
            f"{known.step} (the trainers resumed from an older checkpoint than step "
            f"{known.step}; see their logs for why it was rejected)")
    return LastCheckpoint(step=step, time=whole_second(from_unix(moment)) if moment else None)


CHECKPOINT_FELL_BACK = "CheckpointFellBack"
"""The Event when status.lastCheckpoint moves back to an older checkpoint (`fallen_back`)."""
