"""What a team's own image needs in its trainer pods, from `spec.podTemplate`: extra volumes and
their mounts, init containers, image pull secrets, `envFrom`, the working directory
(docs/byo.md). The builders (`builders.trainer_pod`, `builders.rendezvous_pod`) add them; the
API checks the names (`api/spec_pods.py`).
"""

from __future__ import annotations

import copy

from rtj_operator.api.models import ResilientTrainingJob
from rtj_operator.intents import Manifest


def extra_volumes(job: ResilientTrainingJob) -> list[Manifest]:
    template = job.spec.pod_template
    return copy.deepcopy(template.volumes) if template is not None else []


def extra_mounts(job: ResilientTrainingJob) -> list[Manifest]:
    template = job.spec.pod_template
    return [m.to_api() for m in template.volume_mounts] if template is not None else []


def init_containers(job: ResilientTrainingJob, security_context: Manifest) -> list[Manifest]:
    """The template's init containers, each with `security_context` (the trainer container's
    defaults) under the fields it sets itself."""
    template = job.spec.pod_template
    containers = []
    for container in (template.init_containers if template is not None else []):
        made = copy.deepcopy(container)
        made["securityContext"] = {**copy.deepcopy(security_context),
                                   **(made.get("securityContext") or {})}
        containers.append(made)
    return containers


def image_pull_secrets(job: ResilientTrainingJob) -> list[Manifest]:
    template = job.spec.pod_template
    return [{"name": name} for name in template.image_pull_secrets] if template else []


def container_extras(job: ResilientTrainingJob) -> Manifest:
    """The trainer container's `envFrom` and `workingDir`, when the template sets them."""
    template = job.spec.pod_template
    extras: Manifest = {}
    if template is not None and template.env_from:
        extras["envFrom"] = copy.deepcopy(template.env_from)
    if template is not None and template.working_dir:
        extras["workingDir"] = template.working_dir
    return extras
