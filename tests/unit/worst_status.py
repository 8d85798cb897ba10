"""The largest status the operator writes for a job of `nodes` trainer pods (issue #33: an
8,192-node job's status must stay far below etcd's 1.5 MiB object limit): every list at the size
the operator keeps, every string at the length the operator writes. Shared by the unit test (its
size) and the integration test (the real API server stores it)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from rtj_operator import reconcile
from rtj_operator.api.models import MAX_JOB_NAME_LENGTH
from rtj_operator.api.status import (
    MAX_EXCLUDED_NODES,
    MAX_INCIDENTS,
    MAX_RESTART_RECORDS,
    Condition,
    ExcludedNode,
    Incident,
    LastCheckpoint,
    LastStop,
    ProgressClock,
    RankStatus,
    ResilientTrainingJobStatus,
    RestartCounts,
    RestartRecords,
    SpareStatus,
)
from rtj_operator.api.vocabulary import ConditionType
from rtj_operator.decisions.status import MESSAGE_LIMIT

T = datetime(2026, 12, 5, 12, 0, 0, tzinfo=UTC)
NODE = "ip-10-123-234-145.us-west-2.compute.internal"  # an EKS node name (46 characters)


def worst_status(nodes: int, spares: int = 64) -> dict[str, Any]:
    """The status as the operator writes it (`reconcile.api_status`)."""
    job = "j" * MAX_JOB_NAME_LENGTH
    conditions = [Condition(type=kind, status="True", observed_generation=99,
                            last_transition_time=T, reason="R" * 64, message="m" * MESSAGE_LIMIT)
                  for kind in ConditionType]
    ranks = [RankStatus(node_index=i, pod=f"{job}-{i}", node=NODE, state="Pending",
                        last_heartbeat_time=T, unresponsive_since=T, step=10**9, restarts=999,
                        attempt=999) for i in range(nodes)]
    incidents = [Incident(cause="HeartbeatTimeout", node_index=nodes - 1, rank=nodes * 8 - 1,
                          detected_time=T, acted_time=T, recovered_time=T, seconds=12345.6,
                          action="RankRestart", message="i" * 1024)
                 for _ in range(MAX_INCIDENTS)]
    excluded = [ExcludedNode(node=f"{i}-{NODE}", reason="NodeLost", since=T,
                             node_index=nodes - 1, message="e" * 1024)
                for i in range(MAX_EXCLUDED_NODES)]
    status = ResilientTrainingJobStatus(
        observed_generation=99, conditions=conditions, state="Recovering",
        nodes_ready=0, nodes_desired=nodes, nodes=f"{nodes}/{nodes}", step=10**9,
        last_checkpoint=LastCheckpoint(step=10**9, time=T),
        last_stop=LastStop(reason="Preempted", step=10**9, checkpoint="/c" * 512, time=T,
                           message="s" * 1024),
        restarts=RestartCounts(total=10**6, rank=10**6, full=10**6, launcher=10**6,
                               in_process=10**6, spare=10**6),
        progress_clock=ProgressClock(step=10**9, since=T),
        restart_records=RestartRecords(rank=[T] * MAX_RESTART_RECORDS,
                                       full=[T] * MAX_RESTART_RECORDS),
        spares=SpareStatus(desired=spares, ready=spares,
                           waiting=list(range(nodes, nodes + spares))),
        rank_counts={"Pending": nodes},
        ranks=ranks, incidents=incidents, excluded_nodes=excluded, goodput="100.0%",
        start_time=T, completion_time=T, reason="R" * 64, message="m" * MESSAGE_LIMIT,
    )
    return reconcile.api_status(status)
