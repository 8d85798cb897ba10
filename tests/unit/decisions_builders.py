"""Builders shared by the decision-table tests (tests/unit/test_decisions_*.py).

`decide` is pure, so each case builds the job, the children the API server would return, the
scraped rank metrics and the clock, and checks the actions and the status. Passes are chained by
feeding a decision's `memory` into the next call, as the operator does. `decide` here returns an
`Outcome`: the decision, with its status as the camelCase dict the operator writes to the API.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta
from typing import Any

from rtj_operator import builders
from rtj_operator import decisions as d
from rtj_operator.api.models import parse_job, parse_status
from rtj_operator.api.status import ResilientTrainingJobStatus
from rtj_operator.config import OperatorSettings
from rtj_operator.intents import CreateObject, DeletePod
from rtj_operator.observed import (
    ClaimView,
    NodeLiveness,
    Observed,
    PodView,
    QueueView,
    RankSample,
    StopSeen,
)
from rtj_operator.podplan import plan_for
from rtj_operator.reconcile import api_status

T0 = datetime(2026, 11, 29, 12, 0, 0, tzinfo=UTC)
SETTINGS = OperatorSettings()
NAME = "tiny"


@dataclass(frozen=True)
class Outcome:
    """One decision, with its status as written to the API (camelCase, null = remove)."""

    decision: d.Decision
    status: dict[str, Any] = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", api_status(self.decision.status))

    @property
    def actions(self) -> list[Any]:
        return list(self.decision.actions)

    @property
    def events(self) -> list[Any]:
        return list(self.decision.events)

    @property
    def memory(self) -> d.Memory:
        return self.decision.memory

    def of_type(self, kind: type) -> list[Any]:
        return self.decision.of_type(kind)


def status_model(status: dict[str, Any]) -> ResilientTrainingJobStatus:
    """Parse a status the operator wrote (checks it is valid for the API)."""
    return parse_status({k: v for k, v in status.items() if v is not None})


def job(status: dict[str, Any] | None = None, **spec: Any) -> Any:
    ft = {"heartbeatTimeoutSeconds": 20, "initialHeartbeatTimeoutSeconds": 60,
          "progressTimeoutSeconds": 120, "rankRestartBudget": {"max": 2, "windowSeconds": 600},
          "fullRestartBudget": {"max": 1, "windowSeconds": 600}}
    ft.update(spec.pop("faultTolerance", {}))
    body: dict[str, Any] = {
        "apiVersion": "training.resilient.dev/v1alpha1",
        "kind": "ResilientTrainingJob",
        "metadata": {"name": NAME, "namespace": "ns", "uid": "job-uid", "generation": 3},
        "spec": {"nodes": 2, "procsPerNode": 2, "image": "img",
                 "checkpoint": {"claimName": "ckpt"}, "faultTolerance": ft, **spec},
    }
    if status is not None:
        body["status"] = status
    return parse_job(body)


LOST_NODE: dict[str, Any] = {"node_ready": "Unknown", "node_unreachable": True}
"""PodView fields of a pod whose node is lost (NotReady, tainted unreachable)."""


def trainer(index: int, phase: str = "Running", *, attempt: int = 0, exit_code: int | None = None,
            deleting: bool = False, started: datetime = T0, **view: Any) -> PodView:
    """A trainer pod on node `node-<index>`, created at `started`; `view` sets other PodView
    fields (`node_ready`, `waiting_reason`, ...)."""
    fields: dict[str, Any] = {
        "name": f"{NAME}-{index}", "uid": f"uid-{index}-{attempt}", "role": "trainer",
        "node_index": index, "attempt": attempt, "phase": phase, "deleting": deleting,
        "exit_code": exit_code, "started_at": started if phase != "Pending" else None,
        "finished_at": started + timedelta(seconds=30) if exit_code is not None else None,
        "node_name": f"node-{index}", "pod_ip": f"127.1.0.{index + 2}", "created_at": started,
        "node_ready": "True",
    }
    fields.update(view)
    return PodView(**fields)


def rendezvous(phase: str = "Running", deleting: bool = False, **view: Any) -> PodView:
    fields: dict[str, Any] = {"node_name": "node-r", "created_at": T0, "node_ready": "True"}
    fields.update(view)
    return PodView(name=f"{NAME}-rdzv", uid="uid-rdzv", role="rendezvous", phase=phase,
                   deleting=deleting, started_at=T0 if phase != "Pending" else None, **fields)


def world(*pods: PodView, rdzv: PodView | None = None, claim: ClaimView | None = None,
          services: bool = True, stops: tuple[StopSeen, ...] = ()) -> Observed:
    return Observed(
        trainer_pods={p.node_index: p for p in pods if p.node_index is not None},
        rendezvous_pod=rdzv, rendezvous_service=services, headless_service=services,
        claim=claim, stops=stops,
    )


def running_world(attempts: tuple[int, int] = (0, 0), started: datetime = T0) -> Observed:
    return world(trainer(0, attempt=attempts[0], started=started),
                 trainer(1, attempt=attempts[1], started=started), rdzv=rendezvous())


def beats(at: datetime, step: int = 10, *, pods: Observed | None = None,
          committed: int | None = None, goodput: float | None = None,
          restarts: dict[str, int] | None = None) -> dict[int, NodeLiveness]:
    """Every rank of every pod answered with a heartbeat at `at` and step `step`."""
    observed = pods or running_world()
    result = {}
    for index, pod in observed.trainer_pods.items():
        samples = tuple(
            RankSample(local_rank=r, rank=index * 2 + r, heartbeat=at.timestamp(), step=step,
                       committed_step=committed,
                       committed_time=at.timestamp() if committed is not None else None,
                       goodput_ratio=goodput, restarts=restarts or {})
            for r in range(2)
        )
        result[index] = NodeLiveness(node_index=index, pod_uid=pod.uid, samples=samples,
                                     expected_ranks=2)
    return result


def answering(observed: Observed | None = None) -> dict[int, NodeLiveness]:
    """Every pod's liveness endpoint answered, but none of its ranks has answered it yet."""
    observed = observed or running_world()
    return {index: NodeLiveness(node_index=index, pod_uid=pod.uid, samples=(), expected_ranks=2)
            for index, pod in observed.trainer_pods.items()}


def decide(j: Any, observed: Observed, *, now: datetime = T0, liveness: Any = None,
           memory: d.Memory | None = None, queue: QueueView | None = None) -> Outcome:
    plan = plan_for(j, SETTINGS)
    if observed.headless_service and observed.network_policy is None:
        # The headless Service as this operator makes it: it records the job's policy digest.
        digest = builders.network_policy_digest(
            builders.network_policy(j, plan=plan, settings=SETTINGS))
        observed = replace(observed, network_policy=digest)
    decision = Outcome(d.decide(job=j, plan=plan, observed=observed,
                                liveness=liveness or {}, now=now,
                                memory=memory or d.Memory(), settings=SETTINGS, queue=queue))
    status_model(decision.status)  # every status we write is valid for the API
    return decision


def created(decision: Outcome) -> list[str]:
    return [f"{a.kind}/{a.name}" for a in decision.of_type(CreateObject)]


def deleted(decision: Outcome) -> list[str]:
    return [a.name for a in decision.of_type(DeletePod)]


def events(decision: Outcome) -> list[str]:
    return [e.reason for e in decision.events]


def condition(decision: Outcome, kind: str) -> dict[str, Any]:
    return next(c for c in decision.status["conditions"] if c["type"] == kind)


def then(previous: Outcome, j: Any, observed: Observed, **kwargs: Any) -> Outcome:
    """The next pass, remembering what the previous one decided."""
    return decide(j, observed, memory=previous.memory, **kwargs)


def running(j: Any | None = None, now: datetime = T0 + timedelta(seconds=30)) -> Outcome:
    """A job whose two pods run and heartbeat."""
    j = j or job()
    first = decide(j, world())
    return then(first, j, running_world(), now=now, liveness=beats(now))
