"""What a reconcile pass wants done, as plain frozen records: the vocabulary between the brain
(`decisions`, which only decides) and the hands (`actions`, which applies through the API).

Keeping them here lets `actions.py` depend on the intents alone, never on the decision rules, and
gives the operator one `Manifest` alias for a Kubernetes object as a JSON-like dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rtj_wire import lostpods

Manifest = dict[str, Any]
"""A Kubernetes object (or part of one) as a camelCase JSON-like dict."""


@dataclass(frozen=True)
class CreateObject:
    """Create a child object (Pod, Service, PersistentVolumeClaim, NetworkPolicy,
    PodDisruptionBudget, Kueue Workload); an existing one is kept."""

    manifest: Manifest

    @property
    def kind(self) -> str:
        return str(self.manifest["kind"])

    @property
    def name(self) -> str:
        return str(self.manifest["metadata"]["name"])


@dataclass(frozen=True)
class DeletePod:
    """Delete a pod, but only the incarnation with this UID (never its replacement)."""

    name: str
    uid: str
    force: bool = False
    """Delete at once (gracePeriodSeconds 0): only for a pod whose node is lost, whose kubelet
    can never confirm a graceful delete, or one whose containers have all ended (`Failed`:
    nothing is left to stop)."""
    grace_seconds: int | None = None
    """gracePeriodSeconds for a graceful delete (None: the pod's own). Fault recovery uses a
    short one (`recovery.RECOVERY_GRACE_SECONDS`): the trainers answer SIGTERM by committing a
    checkpoint first (rtj_trainer.stop), which a hung or broken job cannot do."""


@dataclass(frozen=True)
class SetClaimOwner:
    """Make the job own the claim (`owner` set) or release it (`owner` None, Retain)."""

    name: str
    owner: Manifest | None


@dataclass(frozen=True)
class DeleteJob:
    """Delete the job itself (ttlSecondsAfterFinished)."""


@dataclass(frozen=True)
class PatchJob:
    """A JSON merge patch of the job itself (not its status): `spec.suspend` and the placement
    of a job queued through Kueue, in one update (`workloads.start_patch`)."""

    patch: Manifest


@dataclass(frozen=True)
class PatchWorkload:
    """A JSON merge patch of the job's Kueue Workload (`status`: of its status subresource),
    made only if the Workload is still at `resource_version` (else 409: the next pass looks
    again)."""

    name: str
    resource_version: str
    patch: Manifest
    status: bool = False


@dataclass(frozen=True)
class SyncNetworkPolicy:
    """Bring the job's NetworkPolicy to `manifest` (replace it, or create it when it is gone),
    then record `digest` in the annotation of the headless Service `service`
    (`naming.NETWORK_POLICY_ANNOTATION`): the policy no longer matched the operator's settings
    (review-2 F7: a moved or relabelled operator or Prometheus could read no pod)."""

    manifest: Manifest
    service: str
    digest: str


Action = (CreateObject | DeletePod | SetClaimOwner | DeleteJob | PatchJob | PatchWorkload
          | SyncNetworkPolicy)
"""A change to the cluster, applied by `actions.apply` in order."""


@dataclass(frozen=True)
class AnnouncePodLoss:
    """Tell the other running trainer pods of a job that one pod's processes are all gone, so
    that NVRx's in-process wrapper in them stops waiting for that pod's ranks (`POST /lost-pods`
    to each peer's pod endpoint, rtj_trainer.podloss). Not an API action: the handler sends it
    through the operator's HTTP client for the trainers (`scraping.Scraper.announce`)."""

    uid: str
    name: str
    cause: str
    """Why the pod is known to be gone (an `IncidentCause`, e.g. `PodFailed`)."""
    peers: tuple[str, ...]
    """Pod IPs of the pods to tell."""

    def document(self) -> dict[str, Any]:
        """The request body (rtj_wire.lostpods)."""
        return lostpods.document([lostpods.LostPod(self.uid, self.name, self.cause)])


@dataclass(frozen=True)
class CreateRefused:
    """What `actions.apply` reports back: the API server refused a `CreateObject` with 403
    (Pod Security admission, an admission policy, a quota), or answered 409 for an object of
    that name that is not the job's own. Not retried by kopf: the pass writes
    it into the status (`decisions.with_refusals`) and the next pass tries again."""

    kind: str
    name: str
    message: str
    name_taken: bool = False
    """409: the name is held by an object that is not the job's."""


@dataclass(frozen=True)
class PostEvent:
    """A Kubernetes Event on the job: one for every decision. Posted by the handler (through
    kopf) after the status is written, never by `actions`."""

    type: Literal["Normal", "Warning"]
    reason: str
    message: str
