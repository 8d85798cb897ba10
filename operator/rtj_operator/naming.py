"""Names and labels of the objects the operator makes for a job (see docs/design.md).

Every module that builds, finds or reasons about a job's children takes names from here, so the
contract in docs/design.md lives in one place of the code.
"""

from __future__ import annotations

import hashlib

from rtj_operator.api import GROUP, KIND

JOB_LABEL = f"{GROUP}/job"
ROLE_LABEL = f"{GROUP}/role"
NODE_INDEX_LABEL = f"{GROUP}/node-index"
ATTEMPT_LABEL = f"{GROUP}/attempt"
SPEC_HASH_LABEL = f"{GROUP}/spec-hash"
"""On every pod: `ResilientTrainingJobSpec.pod_spec_hash()` of the spec it was built from."""

ROLE_TRAINER = "trainer"
ROLE_RENDEZVOUS = "rendezvous"

FINALIZER = f"{GROUP}/cleanup"
"""The operator's finalizer (kopf adds it because the reconcile timer needs it)."""
ANNOTATION_PREFIX = GROUP
"""Prefix of the annotations where kopf keeps handler progress and the last handled spec."""
PLACEMENT_ANNOTATION = f"{GROUP}/placement-before-admission"
"""On a job queued through Kueue and admitted: its own `podTemplate.nodeSelector` and
`tolerations` (JSON) from before the admitted flavors were merged in, restored when the Workload
is evicted (what Kueue's jobframework restores from a Workload's pod sets)."""
STOP_REASON_ANNOTATION = f"{GROUP}/stop-reason"
"""Set on a job together with `spec.suspend: true` by whoever suspends it for another reason than
a person's request: `Preempted` (a queueing system such as Kueue took its quota back) makes
`status.lastStop.reason` say so. Remove it when resuming the job."""

TRAINER_CONTAINER = "trainer"
RENDEZVOUS_CONTAINER = "rendezvous"
CHECKPOINT_VOLUME = "checkpoints"
SHM_VOLUME = "dshm"


def trainer_pod_name(job_name: str, node_index: int) -> str:
    """`<job>-<i>`: also the pod's hostname."""
    return f"{job_name}-{node_index}"


def rendezvous_name(job_name: str) -> str:
    """`<job>-rdzv`: the rendezvous pod and its ClusterIP Service."""
    return f"{job_name}-rdzv"


def headless_service_name(job_name: str) -> str:
    """`<job>`: the headless Service that gives trainer pods DNS names."""
    return job_name


def dynamic_claim_name(job_name: str) -> str:
    """`<job>-checkpoints`: the claim the operator creates for a dynamic checkpoint volume."""
    return f"{job_name}-checkpoints"


NETWORK_POLICY_ANNOTATION = f"{GROUP}/network-policy"
"""On the job's headless Service: the digest of the NetworkPolicy the operator last rendered for
the job (`builders.network_policy_digest`), so a pass sees a policy that no longer matches the
operator's settings (moved or relabelled operator or Prometheus) without reading policies."""


def network_policy_name(job_name: str) -> str:
    """The job's NetworkPolicy: named like the job (another kind, so no clash)."""
    return job_name


def job_selector(job_name: str) -> str:
    """Label selector of every child of a job."""
    return f"{JOB_LABEL}={job_name}"


WORKLOAD_NAME_MAX = 253
WORKLOAD_HASH_LENGTH = 5


def workload_name(job_name: str, job_uid: str) -> str:
    """The Kueue Workload of a job: `resilienttrainingjob-<job>-<hash>`, exactly as Kueue's
    jobframework names the Workload of a job it manages (`GetWorkloadNameForOwnerWithGVK`:
    sha1 of kind, group, name and UID), so a job deleted and created again gets a new one."""
    digest = hashlib.sha1(f"{KIND}\n{GROUP}\n{job_name}\n{job_uid}".encode()).hexdigest()
    prefix = f"{KIND.lower()}-{job_name}"[: WORKLOAD_NAME_MAX - 1 - WORKLOAD_HASH_LENGTH]
    return f"{prefix}-{digest[:WORKLOAD_HASH_LENGTH]}"
