"""The Kueue side of a job queued through Kueue, as pure functions: its Workload, the placement an
admission gives it, and the patches of the job that start, stop and restore it.

This is what Kueue's jobframework does for the kinds it knows (pkg/controller/jobframework in
Kueue v0.17), written for ours:

- `workload` builds the Workload: named as jobframework names it (`naming.workload_name`), owned
  by the job (controller), labelled `kueue.x-k8s.io/job-uid`, in the job's LocalQueue, with two
  pod sets built from the very pods the operator would create: `trainer` (`nodes` + `spares`
  pods, each asking for a whole instance: GPUs, EFA devices, hugepages, CPU and memory) and
  `rendezvous` (one small pod). Each pod set carries the pod's containers with their requests
  and limits, its node selector, tolerations, affinity and priority class: what Kueue's flavor
  assignment and quota read.
- The job's placement (`spec.podTemplate.nodeSelector` and `tolerations`) is shared by both pod
  sets. On admission it becomes the job's own placement plus what every assigned ResourceFlavor
  adds (`nodeLabels`, `tolerations`) and what admission checks add (`podSetUpdates`), merged as
  jobframework merges them (a node label that two of them set differently is a conflict); the
  job's own placement from before is kept in an annotation (`naming.PLACEMENT_ANNOTATION`) and
  restored after an eviction. The pod sets are always built from that own placement, so an
  admitted job still matches its Workload.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from rtj_operator import builders, kueueapi, naming
from rtj_operator.api.models import ResilientTrainingJob
from rtj_operator.api.spec_pods import PodTemplate, Toleration
from rtj_operator.config import OperatorSettings
from rtj_operator.intents import Manifest
from rtj_operator.observed import FlavorView, Placement, WorkloadView
from rtj_operator.podplan import plan_for

POD_SET_SPEC_FIELDS = ("nodeSelector", "tolerations", "affinity", "priorityClassName")
"""The pod spec fields a pod set keeps besides the containers (what Kueue reads)."""


# --- placement ------------------------------------------------------------------------------------


def placement_of(job: ResilientTrainingJob) -> Placement:
    """The job's placement as its spec has it now."""
    template = job.spec.pod_template
    if template is None:
        return Placement()
    return Placement(node_selector=dict(template.node_selector),
                     tolerations=tuple(t.to_api() for t in template.tolerations))


def own_placement(job: ResilientTrainingJob) -> Placement:
    """The job's placement before any admission: the annotation an admission left, else its
    current placement (also when the annotation is not one the operator could have written)."""
    saved = job.metadata.annotations.get(naming.PLACEMENT_ANNOTATION)
    if saved:
        try:
            data = json.loads(saved)
            return Placement(
                node_selector={str(k): str(v) for k, v in (data.get("nodeSelector") or {}).items()},
                tolerations=tuple(Toleration.model_validate(t).to_api()
                                  for t in data.get("tolerations") or []),
            )
        except (ValueError, TypeError, AttributeError):
            pass
    return placement_of(job)


def with_placement(job: ResilientTrainingJob, placement: Placement) -> ResilientTrainingJob:
    """`job` with its podTemplate's nodeSelector and tolerations replaced by `placement`."""
    template = job.spec.pod_template or PodTemplate()
    template = template.model_copy(update={
        "node_selector": dict(placement.node_selector),
        "tolerations": [Toleration.model_validate(t) for t in placement.tolerations],
    })
    return job.model_copy(update={"spec": job.spec.model_copy(update={"pod_template": template})})


def _merge(into: Placement, node_selector: Mapping[str, str],
           tolerations: Sequence[Mapping[str, Any]], source: str) -> Placement | str:
    """`into` plus a flavor's or an admission check's placement; a node label it sets to another
    value is a conflict (returned as the reason, a string)."""
    for key, value in node_selector.items():
        if key in into.node_selector and into.node_selector[key] != value:
            return (f"{source} sets node label {key}={value}, but the job's placement already "
                    f"has {key}={into.node_selector[key]}")
    merged = list(into.tolerations)
    for toleration in tolerations:
        try:  # as the job's spec will store it, so that an admitted job compares equal
            normal = Toleration.model_validate(dict(toleration)).to_api()
        except ValueError as error:
            return f"{source} has a toleration the job cannot take ({toleration}): {error}"
        if normal not in merged:
            merged.append(normal)
    return Placement(node_selector={**into.node_selector, **node_selector},
                     tolerations=tuple(merged))


def admitted_placement(own: Placement, workload: WorkloadView,
                       flavors: Mapping[str, FlavorView]) -> Placement | str:
    """The job's placement once admitted: its own plus every assigned flavor's and every
    admission check's, pod set by pod set (jobframework's `getPodSetsInfoFromStatus` and
    `podset.Merge`); or why it cannot be built (a string)."""
    placement = own
    for pod_set in (kueueapi.TRAINER_POD_SET, kueueapi.RENDEZVOUS_POD_SET):
        flavor_labels: dict[str, str] = {}
        flavor_tolerations: list[Mapping[str, Any]] = []
        for name in workload.flavors.get(pod_set, ()):
            flavor = flavors.get(name)
            if flavor is None:
                return f"ResourceFlavor {name} (assigned to pod set {pod_set}) cannot be read"
            flavor_labels.update(flavor.node_labels)
            flavor_tolerations.extend(t for t in flavor.tolerations
                                      if t not in flavor_tolerations)
        merged = _merge(placement, flavor_labels, flavor_tolerations,
                        f"the flavor of pod set {pod_set}")
        if isinstance(merged, str):
            return merged
        for update in workload.check_updates.get(pod_set, ()):
            merged = _merge(merged, update.node_selector, update.tolerations,
                            f"an admission check of pod set {pod_set}")
            if isinstance(merged, str):
                return merged
        placement = merged
    return placement


# --- the Workload ---------------------------------------------------------------------------------


def _pod_set(name: str, count: int, pod: Manifest) -> Manifest:
    spec = pod["spec"]
    containers = [{"name": c["name"], "image": c["image"],
                   "resources": c.get("resources") or {}} for c in spec["containers"]]
    kept = {key: spec[key] for key in POD_SET_SPEC_FIELDS if spec.get(key)}
    return {"name": name, "count": count,
            "template": {"spec": {"containers": containers, **kept}}}


def pod_sets(job: ResilientTrainingJob, *, settings: OperatorSettings) -> list[Manifest]:
    """The Workload's pod sets: the trainer pods (`nodes` + `spares`) and the rendezvous pod,
    built from the pods themselves with the job's own placement (`own_placement`)."""
    placed = with_placement(job, own_placement(job))
    plan = plan_for(placed, settings)
    trainer = builders.trainer_pod(placed, plan=plan, node_index=0, attempt=0,
                                   settings=settings)
    rendezvous = builders.rendezvous_pod(placed, plan=plan, settings=settings)
    return [_pod_set(kueueapi.TRAINER_POD_SET, plan.pods, trainer),
            _pod_set(kueueapi.RENDEZVOUS_POD_SET, 1, rendezvous)]


def workload(job: ResilientTrainingJob, *, queue_name: str,
             settings: OperatorSettings) -> Manifest:
    """The job's Kueue Workload (see the module docstring). It carries no finalizer: deleting
    the job releases its quota at once, while its pods may still be stopping."""
    if job.metadata.uid is None or job.metadata.namespace is None:
        raise ValueError("the job's metadata.uid and namespace must be set")
    return {
        "apiVersion": kueueapi.API_VERSION,
        "kind": "Workload",
        "metadata": {
            "name": naming.workload_name(job.name, job.metadata.uid),
            "namespace": job.metadata.namespace,
            "labels": {kueueapi.JOB_UID_LABEL: job.metadata.uid},
            "ownerReferences": [builders.owner_reference(job)],
        },
        "spec": {"queueName": queue_name, "podSets": pod_sets(job, settings=settings)},
    }


def _shape(pod_set: Mapping[str, Any]) -> str:
    """What decides whether a stored pod set still matches the job (stable JSON)."""
    spec = (pod_set.get("template") or {}).get("spec") or {}
    return json.dumps({
        "name": pod_set.get("name"), "count": pod_set.get("count"),
        "containers": [{"name": c.get("name"), "image": c.get("image"),
                        "resources": c.get("resources") or {}}
                       for c in spec.get("containers") or []],
        **{key: spec.get(key) or None for key in POD_SET_SPEC_FIELDS},
    }, sort_keys=True)


def pod_sets_match(desired: Sequence[Mapping[str, Any]],
                   stored: Sequence[Mapping[str, Any]]) -> bool:
    """Whether the Workload's pod sets (`stored`) are still the job's (`desired`)."""
    return [_shape(p) for p in desired] == [_shape(p) for p in stored]


# --- patches of the job ---------------------------------------------------------------------------


SUSPEND_PATCH: Manifest = {"spec": {"suspend": True}}


def eviction_patch(reason: str) -> Manifest:
    """The update that suspends a job whose Workload Kueue evicted: for a preemption it also
    sets the stop-reason annotation, so that `status.lastStop` says `Preempted`
    (decisions/stops.py); a start removes it again (`start_patch`)."""
    if reason != kueueapi.EVICTED_BY_PREEMPTION:
        return SUSPEND_PATCH
    return {"metadata": {"annotations": {naming.STOP_REASON_ANNOTATION: "Preempted"}},
            "spec": {"suspend": True}}


def _placement_patch(current: Placement, wanted: Placement) -> Manifest:
    """The merge patch of `spec.podTemplate` that turns placement `current` into `wanted`."""
    selector: dict[str, str | None] = {key: None for key in current.node_selector
                                       if key not in wanted.node_selector}
    selector.update(wanted.node_selector)
    return {"nodeSelector": selector, "tolerations": [dict(t) for t in wanted.tolerations]}


def start_patch(job: ResilientTrainingJob, *, own: Placement, admitted: Placement) -> Manifest:
    """One update that starts an admitted job: its placement becomes the admitted one, its own
    is kept in the annotation, and `suspend` is false (allowed in one update: the CRD lets the
    placement change while the stored job is suspended)."""
    return {
        "metadata": {"annotations": {naming.PLACEMENT_ANNOTATION: json.dumps(
            {"nodeSelector": dict(own.node_selector),
             "tolerations": [dict(t) for t in own.tolerations]}, sort_keys=True),
            naming.STOP_REASON_ANNOTATION: None}},
        "spec": {"suspend": False,
                 "podTemplate": _placement_patch(placement_of(job), admitted)},
    }


def restore_patch(job: ResilientTrainingJob, *, own: Placement) -> Manifest:
    """The update of a suspended job whose admission ended: its own placement back, the
    annotation gone."""
    return {
        "metadata": {"annotations": {naming.PLACEMENT_ANNOTATION: None}},
        "spec": {"podTemplate": _placement_patch(placement_of(job), own)},
    }
