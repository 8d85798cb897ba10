"""Pods built from another spec than the job's (review-2 F4): `suspend`, an edit of a field that
may change only while suspended, and `suspend: false` can reach the operator as one update (sent
back to back, during a leader failover, or while a large job's pass scrapes). The pods then run
the old spec while replacements would get the new one (`Sync` ranks next to `Async` ones: a
hang). Every pod carries the hash of the spec it was built from; a running pod with another hash
makes the job stop every pod with its checkpoint and start them all from the new spec, without
spending a budget."""

from __future__ import annotations

from datetime import timedelta

import pytest
from rtj_operator import builders, naming
from rtj_operator.api.vocabulary import IncidentCause
from rtj_operator.config import OperatorSettings
from rtj_operator.intents import CreateObject, DeletePod
from rtj_operator.podplan import plan_for
from unit.decisions_builders import (
    T0,
    beats,
    decide,
    deleted,
    job,
    rendezvous,
    running,
    then,
    trainer,
    world,
)

pytestmark = pytest.mark.unit


def test_every_pod_carries_the_hash_of_the_spec_it_was_built_from() -> None:
    j = job()
    settings = OperatorSettings()
    plan = plan_for(j, settings)
    pod = builders.trainer_pod(j, plan=plan, node_index=0, attempt=0, settings=settings)
    rdzv = builders.rendezvous_pod(j, plan=plan, settings=settings)
    for made in (pod, rdzv):
        assert made["metadata"]["labels"][naming.SPEC_HASH_LABEL] == j.spec.pod_spec_hash()


def test_the_hash_moves_with_what_pods_read_and_not_with_operator_side_policy() -> None:
    base = job().spec.pod_spec_hash()
    assert job(checkpoint={"claimName": "ckpt", "mode": "Sync"}).spec.pod_spec_hash() != base
    assert job(image="img:2").spec.pod_spec_hash() != base
    assert job(faultTolerance={"inProcessRestart": "Disabled"}).spec.pod_spec_hash() != base
    # Budgets, keep, suspend and the like change at any time and reach no pod.
    assert job(faultTolerance={"rankRestartBudget": {"max": 9, "windowSeconds": 60}}
               ).spec.pod_spec_hash() == base
    assert job(checkpoint={"claimName": "ckpt", "keep": 7}).spec.pod_spec_hash() == base
    assert job(suspend=True).spec.pod_spec_hash() == base
    # A value set to its default is the default.
    assert job(checkpoint={"claimName": "ckpt", "mode": "Async"}).spec.pod_spec_hash() == base


def test_pods_of_an_older_spec_are_all_stopped_and_started_again_without_a_budget() -> None:
    old = job()
    first = running(old)
    stamped = old.spec.pod_spec_hash()
    new = job(checkpoint={"claimName": "ckpt", "mode": "Sync"})  # the edit slipped through
    now = T0 + timedelta(seconds=40)
    pods = world(trainer(0, spec_hash=stamped), trainer(1, spec_hash=stamped),
                 rdzv=rendezvous(spec_hash=stamped))
    drift = then(first, new, pods, now=now, liveness=beats(now))
    assert sorted(deleted(drift)) == ["tiny-0", "tiny-1", "tiny-rdzv"]
    # Stopped with their own grace period (the trainers commit a stop checkpoint), not forced.
    assert all(not a.force and a.grace_seconds is None for a in drift.of_type(DeletePod))
    incident = drift.status["incidents"][-1]
    assert incident["cause"] == IncidentCause.SPEC_CHANGED and incident["action"] == "Reschedule"
    assert "tiny-0" in incident["message"] and "older spec" in incident["message"]
    assert drift.status["restarts"]["total"] == 0
    assert any(e.reason == IncidentCause.SPEC_CHANGED and e.type == "Warning"
               for e in drift.events)
    # Once they are gone every pod is created from the new spec.
    later = now + timedelta(seconds=30)
    gone = then(drift, new, world(), now=later)
    made = [a.manifest for a in gone.of_type(CreateObject) if a.kind == "Pod"]
    assert made and all(m["metadata"]["labels"][naming.SPEC_HASH_LABEL] ==
                        new.spec.pod_spec_hash() for m in made)
    trainer_env = {e["name"]: e.get("value") for m in made if m["metadata"]["name"] == "tiny-0"
                   for e in m["spec"]["containers"][0]["env"]}
    assert trainer_env.get("RTJ_CHECKPOINT_MODE") == "sync", trainer_env


def test_pods_of_the_current_spec_or_of_an_older_operator_are_left_alone() -> None:
    j = job()
    first = running(j)
    now = T0 + timedelta(seconds=40)
    for stamp in (j.spec.pod_spec_hash(), None):  # None: made before pods were stamped
        pods = world(trainer(0, spec_hash=stamp), trainer(1, spec_hash=stamp),
                     rdzv=rendezvous(spec_hash=stamp))
        same = then(first, j, pods, now=now, liveness=beats(now))
        assert deleted(same) == [] and same.status["state"] == "Running"


def test_a_pod_already_ending_is_not_a_drift() -> None:
    old, new = job(), job(image="img:2")
    first = running(old)
    now = T0 + timedelta(seconds=40)
    stamped = old.spec.pod_spec_hash()
    pods = world(trainer(0, spec_hash=new.spec.pod_spec_hash()),
                 trainer(1, deleting=True, spec_hash=stamped),
                 rdzv=rendezvous(spec_hash=new.spec.pod_spec_hash()))
    outcome = decide(new, pods, now=now, liveness=beats(now), memory=first.memory)
    assert all(i["cause"] != IncidentCause.SPEC_CHANGED for i in outcome.status["incidents"])
