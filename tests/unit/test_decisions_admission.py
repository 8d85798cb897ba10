"""A create the API server refuses (403: Pod Security admission, an admission policy, a quota)
becomes the `AdmissionRefused` condition and a Warning Event (`decisions.with_refusals`), not a
retry loop; the refused pods are created again by later passes and never count as vanished."""

from __future__ import annotations

from datetime import timedelta

import pytest
from rtj_operator import decisions as d
from rtj_operator.intents import CreateRefused
from unit.decisions_builders import (
    T0,
    Outcome,
    condition,
    created,
    decide,
    events,
    job,
    rendezvous,
    status_model,
    world,
)

pytestmark = pytest.mark.unit

PSA = ('pods "tiny-0" is forbidden: violates PodSecurity "baseline:latest": non-default '
       'capabilities (container "trainer" must not include "IPC_LOCK" in securityContext'
       '.capabilities.add)')


def refused_pass(previous: Outcome | None = None, now: object = T0) -> Outcome:
    """A pass whose trainer pod creates the API server refused (the rendezvous pod went in)."""
    j = job()
    memory = previous.memory if previous is not None else None
    observed = world(rdzv=rendezvous("Pending")) if previous is not None else world()
    decided = decide(j, observed, now=now, memory=memory)  # type: ignore[arg-type]
    refusals = [CreateRefused("Pod", name, PSA.replace("tiny-0", name))
                for name in ("tiny-0", "tiny-1")]
    outcome = Outcome(d.with_refusals(decided.decision, refusals, now))  # type: ignore[arg-type]
    status_model(outcome.status)
    return outcome


def test_a_refused_create_sets_the_condition_naming_the_policy_and_posts_a_warning() -> None:
    outcome = refused_pass()
    refused = condition(outcome, "AdmissionRefused")
    assert refused["status"] == "True" and refused["reason"] == "PodSecurity"
    assert 'Pod tiny-0: pods "tiny-0" is forbidden: violates PodSecurity "baseline:latest"' \
        in refused["message"] and "IPC_LOCK" in refused["message"]
    assert "Pod tiny-1" in refused["message"]
    warning = next(e for e in outcome.events if e.reason == "AdmissionRefused")
    assert warning.type == "Warning" and "violates PodSecurity" in warning.message
    assert outcome.memory.status is outcome.decision.status, "the next pass starts from it"


def test_a_refused_pod_is_created_again_and_never_counts_as_vanished() -> None:
    first = refused_pass()
    later = refused_pass(first, now=T0 + timedelta(seconds=30))
    assert created(later) == ["Pod/tiny-0", "Pod/tiny-1"]
    assert later.status["incidents"] == [] and later.status["restarts"]["total"] == 0
    assert later.status["state"] == "Pending"
    # Same refusal again: the condition keeps its time and no second Warning is posted.
    assert condition(later, "AdmissionRefused")["lastTransitionTime"] == \
        condition(first, "AdmissionRefused")["lastTransitionTime"]
    assert "AdmissionRefused" not in events(later)


def test_the_condition_clears_once_the_creates_go_through() -> None:
    first = refused_pass()
    j = job()
    now = T0 + timedelta(seconds=30)
    decided = decide(j, world(rdzv=rendezvous("Pending")), now=now, memory=first.memory)
    accepted = Outcome(d.with_refusals(decided.decision, [], now))
    cleared = condition(accepted, "AdmissionRefused")
    assert cleared["status"] == "False" and cleared["reason"] == "Admitted"
    assert cleared["lastTransitionTime"] == "2026-11-29T12:00:30Z"
    assert "Admitted" in events(accepted)


def test_another_403_is_forbidden_and_a_pass_without_refusals_changes_nothing() -> None:
    decided = decide(job(), world())
    quota = [CreateRefused("Pod", "tiny-0", 'pods "tiny-0" is forbidden: exceeded quota')]
    outcome = Outcome(d.with_refusals(decided.decision, quota, T0))
    assert condition(outcome, "AdmissionRefused")["reason"] == "Forbidden"
    assert d.with_refusals(decided.decision, [], T0) is decided.decision
    assert condition(decided, "AdmissionRefused")["status"] == "False"


def test_a_name_held_by_an_object_that_is_not_the_jobs_is_name_taken() -> None:
    decided = decide(job(), world())
    taken = [CreateRefused("Service", "tiny-rdzv", "a Service named tiny-rdzv already exists "
                           "and is not this job's (owners: none)", name_taken=True)]
    outcome = Outcome(d.with_refusals(decided.decision, taken, T0))
    refused = condition(outcome, "AdmissionRefused")
    assert refused["status"] == "True" and refused["reason"] == "NameTaken"
    assert "Service tiny-rdzv: a Service named tiny-rdzv already exists" in refused["message"]
    assert next(e for e in outcome.events if e.reason == "AdmissionRefused").type == "Warning"
