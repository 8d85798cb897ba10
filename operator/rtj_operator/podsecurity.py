"""The securityContext of every pod and container the operator builds: what Pod Security
`restricted` asks (docs/security.md), each field the job's podTemplate sets replacing the
default, and IPC_LOCK for the trainer container with podTemplate.memoryLock."""

from __future__ import annotations

import copy

from rtj_operator.api.models import ResilientTrainingJob
from rtj_operator.intents import Manifest

POD_SECURITY_DEFAULTS: Manifest = {
    "runAsNonRoot": True,
    "seccompProfile": {"type": "RuntimeDefault"},
}
"""Every pod's securityContext unless podTemplate.securityContext replaces a field: what Pod
Security `restricted` asks of a pod (the trainer image runs as user 10001)."""
CONTAINER_SECURITY_DEFAULTS: Manifest = {
    "allowPrivilegeEscalation": False,
    "capabilities": {"drop": ["ALL"]},
}
"""Every container's securityContext unless podTemplate.containerSecurityContext replaces a
field: what Pod Security `restricted` asks of a container."""
MEMORY_LOCK_CAPABILITY = "IPC_LOCK"
"""Added to the trainer container with podTemplate.memoryLock (EFA pins memory for RDMA
[aws-sample]); not in Pod Security `baseline`."""


def pod_security_context(job: ResilientTrainingJob) -> Manifest:
    """The pod securityContext: the defaults, each field the template sets replacing its own."""
    template = job.spec.pod_template
    merged = copy.deepcopy(POD_SECURITY_DEFAULTS)
    if template is not None and template.security_context is not None:
        merged.update(template.security_context.to_api())
    return merged


def container_security_context(job: ResilientTrainingJob, *, memory_lock: bool) -> Manifest:
    """A container's securityContext: the defaults, each field the template sets replacing its
    own (`capabilities` as a whole), then IPC_LOCK added when `memory_lock`."""
    template = job.spec.pod_template
    merged = copy.deepcopy(CONTAINER_SECURITY_DEFAULTS)
    if template is not None and template.container_security_context is not None:
        merged.update(template.container_security_context.to_api())
    if memory_lock:
        capabilities = merged.setdefault("capabilities", {})
        added = list(capabilities.get("add") or [])
        if MEMORY_LOCK_CAPABILITY not in added:
            added.append(MEMORY_LOCK_CAPABILITY)
        capabilities["add"] = added
    return merged
