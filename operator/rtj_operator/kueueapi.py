"""The parts of Kueue's API (sigs.k8s.io/kueue v0.17, kueue.x-k8s.io/v1beta2) the operator speaks.

A job labelled `kueue.x-k8s.io/queue-name` is queued through Kueue as an external framework
(`integrations.externalFrameworks` in Kueue's Configuration): the operator plays the part Kueue's
jobframework reconciler plays for its in-tree kinds (docs/kueue.md). The names below are Kueue's,
from apis/kueue/v1beta2 and pkg/controller/constants of that release.
"""

from __future__ import annotations

from collections.abc import Mapping

GROUP = "kueue.x-k8s.io"
VERSION = "v1beta2"
API_VERSION = f"{GROUP}/{VERSION}"
WORKLOADS = "workloads"
RESOURCE_FLAVORS = "resourceflavors"

QUEUE_NAME_LABEL = f"{GROUP}/queue-name"
"""The LocalQueue a job is submitted to: the only thing a user sets to queue a job."""
JOB_UID_LABEL = f"{GROUP}/job-uid"
"""Set on a Workload: the UID of the job it stands for (jobframework's ConstructWorkload)."""

# Workload condition types (apis/kueue/v1beta2/workload_types.go).
QUOTA_RESERVED = "QuotaReserved"
ADMITTED = "Admitted"
EVICTED = "Evicted"
FINISHED = "Finished"
REQUEUED = "Requeued"

FINISHED_SUCCEEDED = "Succeeded"
FINISHED_FAILED = "Failed"
"""Reasons of the Finished condition (WorkloadFinishedReasonSucceeded/Failed)."""
EVICTED_BY_PREEMPTION = "Preempted"
EVICTED_DUE_TO_NODE_FAILURES = "NodeFailures"
"""Evicted reasons after which jobframework sets Requeued True (the others set it False)."""
PENDING_REASON = "Pending"
"""QuotaReserved False after an eviction was handled (jobframework clears the admission with
it)."""

TRAINER_POD_SET = "trainer"
RENDEZVOUS_POD_SET = "rendezvous"


def queue_name(labels: Mapping[str, str] | None) -> str | None:
    """The LocalQueue a job's labels name, or None when the job is not queued through Kueue."""
    name = (labels or {}).get(QUEUE_NAME_LABEL)
    return name or None
