"""Rule 0 (decisions/queueing.py) and the Workload it keeps (workloads.py): a job labelled
`kueue.x-k8s.io/queue-name` runs only while Kueue admits its Workload. Each case builds the job,
its pods and the Workload as kueueobserve.observe_queue would see them, and checks the actions
(what the job and its Workload become) and the status."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest
from rtj_operator import naming, workloads
from rtj_operator.api.models import ResilientTrainingJob
from rtj_operator.intents import CreateObject, PatchJob, PatchWorkload
from rtj_operator.kueueobserve import flavor_view, workload_view
from rtj_operator.observed import FlavorView, Placement, QueueView, WorkloadView
from unit.decisions_builders import (
    SETTINGS,
    T0,
    condition,
    created,
    decide,
    deleted,
    events,
    job,
    rendezvous,
    running_world,
    status_model,
    trainer,
    world,
)

pytestmark = pytest.mark.unit

QUEUE = "team-a"
WORKLOAD = "resilienttrainingjob-tiny-fce37"
"""`jobframework.GetWorkloadNameForOwnerWithGVK("tiny", "job-uid", ResilientTrainingJob GVK)`,
computed with Kueue v0.17.0's own Go code."""
P5 = {"node.kubernetes.io/instance-type": "p5.48xlarge"}
RESERVED = {"key": "example.com/reserved", "operator": "Exists", "effect": "NoSchedule"}
FLAVOR = FlavorView(name="p5", node_labels={**P5, "pool": "reserved"}, tolerations=(RESERVED,))
OWN = {"nodeSelector": {"team": "a"}}
ADMITTED_SELECTOR = {"team": "a", **P5, "pool": "reserved"}


def queued_job(*, annotations: dict[str, str] | None = None, status: dict[str, Any] | None = None,
               **spec: Any) -> ResilientTrainingJob:
    """`decisions_builders.job` labelled for LocalQueue QUEUE."""
    spec.setdefault("podTemplate", OWN)
    base = job(status, **spec)
    meta = base.metadata.model_copy(update={
        "labels": {"kueue.x-k8s.io/queue-name": QUEUE}, "annotations": annotations or {}})
    return base.model_copy(update={"metadata": meta})


def started_job(**spec: Any) -> ResilientTrainingJob:
    """A queued job started by an admission to FLAVOR: merged placement, own one annotated."""
    template = {"nodeSelector": ADMITTED_SELECTOR, "tolerations": [RESERVED]}
    return queued_job(annotations={naming.PLACEMENT_ANNOTATION: json.dumps(
        {"nodeSelector": OWN["nodeSelector"], "tolerations": []})}, podTemplate=template, **spec)


def conditions(**kinds: tuple[str, str, str]) -> list[dict[str, Any]]:
    return [{"type": kind, "status": status, "reason": reason, "message": message,
             "lastTransitionTime": "2026-11-29T11:00:00Z"}
            for kind, (status, reason, message) in kinds.items()]


def a_workload(j: ResilientTrainingJob | None = None, *, admitted: bool = False,
               flavor: str = "p5", **kinds: tuple[str, str, str]) -> WorkloadView:
    """The job's Workload as kueueobserve.workload_view reads it from the API server."""
    manifest = workloads.workload(j or queued_job(), queue_name=QUEUE, settings=SETTINGS)
    manifest["metadata"].update(resourceVersion="7", generation=1)
    if admitted:
        kinds = {"QuotaReserved": ("True", "QuotaReserved", "Quota reserved in ClusterQueue cq"),
                 "Admitted": ("True", "Admitted", "The workload is admitted"), **kinds}
        manifest["status"] = {"admission": {"clusterQueue": "cq", "podSetAssignments": [
            {"name": "trainer", "flavors": {"cpu": flavor, "nvidia.com/gpu": flavor}},
            {"name": "rendezvous", "flavors": {"cpu": flavor}}]}}
    manifest.setdefault("status", {})["conditions"] = conditions(**kinds)
    return workload_view(manifest)


def queue(workload: WorkloadView | None = None, **flavors: FlavorView) -> QueueView:
    return QueueView(queue_name=QUEUE, workload=workload, flavors=flavors or {"p5": FLAVOR})


def patches(outcome: Any) -> list[dict[str, Any]]:
    return [a.patch for a in outcome.of_type(PatchJob)]


# --- the Workload ---------------------------------------------------------------------------------


def test_the_workload_is_named_owned_and_labelled_as_kueues_jobframework_does() -> None:
    manifest = workloads.workload(queued_job(), queue_name=QUEUE, settings=SETTINGS)
    assert naming.workload_name("tiny", "job-uid") == WORKLOAD
    assert manifest["apiVersion"] == "kueue.x-k8s.io/v1beta2" and manifest["kind"] == "Workload"
    assert manifest["metadata"]["name"] == WORKLOAD
    assert manifest["metadata"]["namespace"] == "ns"
    assert manifest["metadata"]["labels"] == {"kueue.x-k8s.io/job-uid": "job-uid"}
    assert manifest["metadata"]["ownerReferences"] == [{
        "apiVersion": "training.resilient.dev/v1alpha1", "kind": "ResilientTrainingJob",
        "name": "tiny", "uid": "job-uid", "controller": True, "blockOwnerDeletion": True}]
    assert "finalizers" not in manifest["metadata"]
    assert manifest["spec"]["queueName"] == QUEUE


def test_the_trainer_pod_set_asks_for_a_whole_p5_per_pod_spares_included() -> None:
    j = queued_job(podTemplate={"nodeSelector": {"team": "a"}, "tolerations": [RESERVED]},
                   faultTolerance={"spares": 1, "inProcessRestart": "Enabled"})
    trainer_set, rendezvous_set = workloads.pod_sets(j, settings=SETTINGS)
    assert (trainer_set["name"], trainer_set["count"]) == ("trainer", 3)  # 2 nodes + 1 spare
    spec = trainer_set["template"]["spec"]
    (container,) = spec["containers"]
    assert container["name"] == "trainer" and container["image"] == "img"
    assert container["resources"] == {
        "requests": {"cpu": "184", "memory": "1800Gi", "nvidia.com/gpu": "8",
                     "vpc.amazonaws.com/efa": "32", "hugepages-2Mi": "5120Mi"},
        "limits": {"nvidia.com/gpu": "8", "vpc.amazonaws.com/efa": "32",
                   "hugepages-2Mi": "5120Mi"},
    }
    assert spec["nodeSelector"] == {**P5, "team": "a"}
    assert spec["tolerations"] == [
        {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
        {"key": "vpc.amazonaws.com/efa", "operator": "Exists", "effect": "NoSchedule"},
        RESERVED]
    assert (rendezvous_set["name"], rendezvous_set["count"]) == ("rendezvous", 1)
    rendezvous_spec = rendezvous_set["template"]["spec"]
    assert rendezvous_spec["containers"][0]["resources"] == {
        "requests": {"cpu": "250m", "memory": "512Mi"}}
    assert rendezvous_spec["nodeSelector"] == {"team": "a"}


def test_an_admitted_job_still_matches_its_workload() -> None:
    """The pod sets are built from the job's own placement, not the admitted one."""
    before = workloads.pod_sets(queued_job(), settings=SETTINGS)
    assert workloads.pod_sets(started_job(), settings=SETTINGS) == before
    assert not workloads.pod_sets_match(
        workloads.pod_sets(queued_job(nodes=3), settings=SETTINGS), before)


def test_the_admitted_placement_merges_every_flavor_and_admission_check_update() -> None:
    own = Placement(node_selector={"team": "a"})
    view = a_workload(admitted=True)
    placement = workloads.admitted_placement(own, view, {"p5": FLAVOR})
    assert placement == Placement(node_selector=ADMITTED_SELECTOR, tolerations=(RESERVED,))
    checked = WorkloadView(**{**view.__dict__, "check_updates": {
        "trainer": (Placement(node_selector={"zone": "b"}),)}})
    merged = workloads.admitted_placement(own, checked, {"p5": FLAVOR})
    assert isinstance(merged, Placement) and merged.node_selector["zone"] == "b"
    conflict = workloads.admitted_placement(Placement(node_selector={"pool": "spot"}), view,
                                            {"p5": FLAVOR})
    assert conflict == ("the flavor of pod set trainer sets node label pool=reserved, but the "
                        "job's placement already has pool=spot")
    assert workloads.admitted_placement(own, view, {}) == (
        "ResourceFlavor p5 (assigned to pod set trainer) cannot be read")


def test_start_and_restore_patches_swap_the_placement_and_keep_the_jobs_own() -> None:
    j = queued_job()
    own = workloads.own_placement(j)
    admitted = Placement(node_selector=ADMITTED_SELECTOR, tolerations=(RESERVED,))
    start = workloads.start_patch(j, own=own, admitted=admitted)
    assert start["spec"] == {"suspend": False, "podTemplate": {
        "nodeSelector": ADMITTED_SELECTOR, "tolerations": [RESERVED]}}
    saved = json.loads(start["metadata"]["annotations"][naming.PLACEMENT_ANNOTATION])
    # A stop reason left by an earlier preemption goes with the start.
    assert start["metadata"]["annotations"][naming.STOP_REASON_ANNOTATION] is None
    assert saved == {"nodeSelector": {"team": "a"}, "tolerations": []}
    restore = workloads.restore_patch(started_job(), own=own)
    assert restore == {
        "metadata": {"annotations": {naming.PLACEMENT_ANNOTATION: None}},
        "spec": {"podTemplate": {"nodeSelector": {"team": "a", "node.kubernetes.io/instance-type":
                                                  None, "pool": None}, "tolerations": []}}}


# --- rule 0 ---------------------------------------------------------------------------------------


def test_a_new_queued_job_gets_a_workload_and_is_held_without_pods() -> None:
    first = decide(queued_job(), world(services=False), queue=queue())
    assert [type(a).__name__ for a in first.actions][:2] == ["CreateObject", "PatchJob"]
    assert created(first)[0] == f"Workload/{WORKLOAD}"
    assert not [name for name in created(first) if name.startswith("Pod/")]
    assert patches(first) == [{"spec": {"suspend": True}}]
    assert first.status["state"] == "Queued"
    assert first.status["reason"] == "WaitingForAdmission"
    queued = condition(first, "Queued")
    assert (queued["status"], queued["reason"]) == ("True", "WaitingForAdmission")
    assert "WorkloadCreated" in events(first) and "Suspended" not in events(first)
    # The same job without the label starts its pods at once, and has no Queued condition.
    plain = decide(job(podTemplate=OWN), world(services=False))
    assert "Pod/tiny-rdzv" in created(plain)
    assert not [c for c in plain.status["conditions"] if c["type"] == "Queued"]


def test_a_pending_workload_holds_the_job_with_kueues_message() -> None:
    message = ("couldn't assign flavors to pod set trainer: insufficient unused quota for "
               "nvidia.com/gpu in flavor p5, 16 more needed")
    view = a_workload(QuotaReserved=("False", "Pending", message))
    outcome = decide(queued_job(suspend=True), world(), queue=queue(view))
    assert not outcome.of_type(PatchJob) and not outcome.of_type(PatchWorkload)
    assert outcome.status["state"] == "Queued"
    assert outcome.status["message"] == (
        f"Workload {WORKLOAD} waits in LocalQueue {QUEUE}: {message}")
    assert condition(outcome, "Queued")["message"] == outcome.status["message"]
    assert condition(outcome, "Suspended")["status"] == "True"


def test_a_job_changed_while_queued_gets_its_workload_updated_unless_quota_is_reserved() -> None:
    view = a_workload(queued_job())  # built for 2 nodes
    changed = queued_job(suspend=True, nodes=3)
    (update,) = decide(changed, world(), queue=queue(view)).of_type(PatchWorkload)
    assert (update.name, update.resource_version, update.status) == (WORKLOAD, "7", False)
    assert update.patch["spec"]["podSets"][0]["count"] == 3
    reserved = a_workload(queued_job(), QuotaReserved=("True", "QuotaReserved", "reserved"))
    assert not decide(changed, world(), queue=queue(reserved)).of_type(PatchWorkload)


def test_an_admitted_workload_starts_the_job_in_one_update_then_lets_it_run() -> None:
    j = queued_job(suspend=True)
    starting = decide(j, world(), queue=queue(a_workload(admitted=True)))
    (start,) = patches(starting)
    assert start["spec"] == {"suspend": False, "podTemplate": {
        "nodeSelector": ADMITTED_SELECTOR, "tolerations": [RESERVED]}}
    assert naming.PLACEMENT_ANNOTATION in start["metadata"]["annotations"]
    assert not [name for name in created(starting) if name.startswith("Pod/")]
    assert condition(starting, "Queued")["reason"] == "Admitted"
    assert "Admitted" in events(starting)
    # Once the update shows: the pods are created with the admitted placement, nothing patched.
    running = decide(started_job(), world(), queue=queue(a_workload(admitted=True)),
                     memory=starting.memory)
    assert not running.of_type(PatchJob)
    assert "Pod/tiny-rdzv" in created(running)
    pods = [a.manifest for a in running.of_type(CreateObject) if a.kind == "Pod"]
    assert all(p["spec"]["nodeSelector"]["pool"] == "reserved" for p in pods)
    assert all(RESERVED in p["spec"]["tolerations"] for p in pods)
    queued = condition(running, "Queued")
    assert (queued["status"], queued["reason"]) == ("False", "Admitted")
    assert "admitted in ClusterQueue cq (flavors: p5)" in queued["message"]


def test_a_running_job_not_started_by_the_admission_is_suspended_first() -> None:
    """A job that ran before it was labelled (or a cache behind the operator's own suspend)."""
    outcome = decide(queued_job(), running_world(), queue=queue(a_workload(admitted=True)))
    assert patches(outcome) == [{"spec": {"suspend": True}}]
    assert sorted(deleted(outcome)) == ["tiny-0", "tiny-1", "tiny-rdzv"]
    # Even when its placement happens to be the admitted one: only a start records the own one.
    placed = queued_job(podTemplate={"nodeSelector": ADMITTED_SELECTOR, "tolerations": [RESERVED]})
    outcome = decide(placed, running_world(), queue=queue(a_workload(admitted=True)))
    assert patches(outcome) == [{"spec": {"suspend": True}}]


@pytest.mark.parametrize(("reason", "requeued"), [("Preempted", "True"),
                                                  ("Deactivated", "False")])
def test_an_eviction_suspends_the_job_then_requeues_it_once_no_pod_is_left(
    reason: str, requeued: str
) -> None:
    evicted = a_workload(admitted=True, Evicted=("True", reason, "Preempted to make room"))
    stopping = decide(started_job(), running_world(), queue=queue(evicted))
    # A preemption says so to the stop record (status.lastStop.reason Preempted).
    stop_reason = ({"metadata": {"annotations": {naming.STOP_REASON_ANNOTATION: "Preempted"}}}
                   if reason == "Preempted" else {})
    assert patches(stopping) == [{**stop_reason, "spec": {"suspend": True}}]
    assert sorted(deleted(stopping)) == ["tiny-0", "tiny-1", "tiny-rdzv"]
    assert [e.type for e in stopping.events if e.reason == "Evicted"] == ["Warning"]
    assert stopping.status["state"] == "Suspended"  # pods are still stopping
    assert condition(stopping, "Queued")["reason"] == "Evicted"
    # Suspended, pods still terminating: wait.
    terminating = world(trainer(0, deleting=True), trainer(1, deleting=True))
    waiting = decide(started_job(suspend=True), terminating, queue=queue(evicted),
                     memory=stopping.memory)
    assert not waiting.of_type(PatchJob) and not waiting.of_type(PatchWorkload)
    # No pod left: the job's own placement back and the Workload's admission cleared.
    gone = decide(started_job(suspend=True), world(), queue=queue(evicted),
                  memory=waiting.memory, now=T0 + timedelta(seconds=40))
    (restore,) = patches(gone)
    assert restore["spec"]["podTemplate"]["nodeSelector"] == {
        "team": "a", "node.kubernetes.io/instance-type": None, "pool": None}
    (requeue,) = gone.of_type(PatchWorkload)
    assert (requeue.name, requeue.resource_version, requeue.status) == (WORKLOAD, "7", True)
    assert requeue.patch["status"]["admission"] is None
    by_type = {c["type"]: c for c in requeue.patch["status"]["conditions"]}
    assert (by_type["QuotaReserved"]["status"], by_type["QuotaReserved"]["reason"]) == (
        "False", "Pending")
    assert by_type["Admitted"]["status"] == "False"
    assert (by_type["Requeued"]["status"], by_type["Requeued"]["reason"]) == (requeued, reason)
    assert by_type["Evicted"]["status"] == "True"  # Kueue's own, untouched
    assert gone.status["state"] == "Queued" and gone.status["reason"] == "Evicted"
    # Requeued: it waits as any queued job, in Kueue's words, until Kueue admits it again.
    requeued = a_workload(QuotaReserved=("False", "Pending", "insufficient unused quota"),
                          Evicted=("True", reason, "Preempted to make room"))
    waiting = decide(queued_job(suspend=True), world(), queue=queue(requeued),
                     memory=gone.memory)
    assert not waiting.of_type(PatchJob) and not waiting.of_type(PatchWorkload)
    assert waiting.status["reason"] == "WaitingForAdmission"
    assert waiting.status["message"].endswith("insufficient unused quota")


def test_a_finished_job_marks_its_workload_finished_once() -> None:
    j = started_job()
    done = world(trainer(0, "Succeeded", exit_code=0), trainer(1, "Succeeded", exit_code=0),
                 rdzv=rendezvous())
    view = a_workload(admitted=True)
    decided = decide(j, done, queue=queue(view))
    assert decided.status["state"] == "Succeeded"
    # Not in the pass that decides it: Kueue must not start the next job before this one's
    # status says it finished (a reader would see two jobs running on one job's quota).
    assert not decided.of_type(PatchWorkload)
    j = started_job(status=decided.status)
    outcome = decide(j, done, queue=queue(view), memory=decided.memory)
    assert outcome.status["state"] == "Succeeded"
    (finish,) = outcome.of_type(PatchWorkload)
    assert finish.status
    (finished,) = [c for c in finish.patch["status"]["conditions"] if c["type"] == "Finished"]
    assert (finished["status"], finished["reason"]) == ("True", "Succeeded")
    marked = a_workload(admitted=True, Finished=("True", "Succeeded", "done"))
    again = decide(j, done, queue=queue(marked), memory=outcome.memory)
    assert not again.of_type(PatchWorkload)


def test_a_queued_job_in_a_cluster_without_kueue_stays_suspended_and_says_why() -> None:
    missing = QueueView(queue_name=QUEUE, unavailable="the API server does not serve "
                        "kueue.x-k8s.io/v1beta2 workloads: Kueue (v0.17 or later) is not installed")
    outcome = decide(queued_job(), world(), queue=missing)
    assert patches(outcome) == [{"spec": {"suspend": True}}]
    assert f"Workload/{WORKLOAD}" not in created(outcome)
    queued = condition(outcome, "Queued")
    assert queued["reason"] == "KueueUnavailable" and "not installed" in queued["message"]


def test_conflicting_flavors_or_a_finished_workload_hold_the_job() -> None:
    conflicted = decide(queued_job(suspend=True, podTemplate={"nodeSelector": {"pool": "spot"}}),
                        world(), queue=queue(a_workload(admitted=True)))
    assert not conflicted.of_type(PatchJob)
    assert condition(conflicted, "Queued")["reason"] == "PlacementConflict"
    finished = decide(queued_job(suspend=True), world(),
                      queue=queue(a_workload(Finished=("True", "Failed", "by hand"))))
    assert condition(finished, "Queued")["reason"] == "WorkloadFinished"


def test_a_job_whose_label_was_removed_loses_the_queued_condition() -> None:
    held = decide(queued_job(), world(), queue=queue())
    later = decide(job(suspend=True, podTemplate=OWN), world(), memory=held.memory)
    assert not [c for c in later.status["conditions"] if c["type"] == "Queued"]
    status_model(later.status)


def test_observe_reads_the_assignment_the_checks_and_the_flavor() -> None:
    view = workload_view({
        "metadata": {"name": "w", "resourceVersion": "9", "generation": 2},
        "spec": {"queueName": "q", "active": False, "podSets": [{"name": "trainer"}]},
        "status": {
            "conditions": [{"type": "Admitted", "status": "True", "reason": "Admitted",
                            "message": "ok"}],
            "admission": {"clusterQueue": "cq", "podSetAssignments": [
                {"name": "trainer", "flavors": {"cpu": "b", "nvidia.com/gpu": "a"}}]},
            "admissionChecks": [{"name": "c", "podSetUpdates": [
                {"name": "trainer", "nodeSelector": {"zone": "z"}}]}],
        },
    })
    assert (view.name, view.resource_version, view.generation, view.queue_name) == (
        "w", "9", 2, "q")
    assert view.active is False and view.true("Admitted") and view.cluster_queue == "cq"
    assert view.flavors == {"trainer": ("a", "b")}
    assert view.check_updates == {"trainer": (Placement(node_selector={"zone": "z"}),)}
    flavor = flavor_view({"metadata": {"name": "a"},
                          "spec": {"nodeLabels": {"x": "y"}, "tolerations": [RESERVED]}})
    assert flavor == FlavorView(name="a", node_labels={"x": "y"}, tolerations=(RESERVED,))
