"""Every Kubernetes object the operator creates for a job, as pure functions of the parsed job.

Objects (names and labels in docs/design.md): the trainer pods `<job>-<i>`, the rendezvous pod and
ClusterIP Service `<job>-rdzv`, the headless Service `<job>`, the NetworkPolicy `<job>` (unless
switched off), and, for a dynamic checkpoint volume, the ReadWriteMany claim `<job>-checkpoints`.
Each carries an ownerReference to the job (controller=true), so deleting the job deletes them
through the garbage collector. Golden tests pin the p5.48xlarge trainer pod (tests/unit/golden/).
The pod builders read the pass's `PodPlan` (`podplan.py`: resources, device counts, procs, grace
period, rendezvous id) instead of resolving the instance profile themselves; the trainer
container's command line is `launcher.py`'s, its environment `trainerenv.py`'s.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence

from rtj_wire.pod import pod_endpoint_port

from rtj_operator import launcher, naming, podextras, podsecurity, profiles
from rtj_operator.api import API_VERSION, KIND
from rtj_operator.api.models import ResilientTrainingJob
from rtj_operator.config import OperatorSettings, label_map
from rtj_operator.intents import Manifest
from rtj_operator.podplan import PodPlan
from rtj_operator.trainerenv import TERMINATION_MESSAGE_PATH, field_env, trainer_env

RENDEZVOUS_REQUESTS = {"cpu": "250m", "memory": "512Mi"}
"""nvrx-control is a small Python process (the TCPStore and the round loop)."""


def owner_reference(job: ResilientTrainingJob) -> Manifest:
    """The ownerReference every child carries: the job, as controller."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job.name,
        "uid": job.metadata.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _namespace(job: ResilientTrainingJob) -> str:
    if job.metadata.namespace is None:
        raise ValueError("metadata.namespace is not set")
    return job.metadata.namespace


def _metadata(
    job: ResilientTrainingJob,
    *,
    name: str,
    labels: dict[str, str],
    annotations: dict[str, str] | None = None,
    owned: bool = True,
) -> Manifest:
    meta: Manifest = {"name": name, "namespace": _namespace(job), "labels": labels}
    if annotations:
        meta["annotations"] = annotations
    if owned:
        meta["ownerReferences"] = [owner_reference(job)]
    return meta


def _pod_labels(job: ResilientTrainingJob, role: str) -> dict[str, str]:
    template = job.spec.pod_template
    labels = dict(template.labels) if template is not None else {}
    labels.update({naming.JOB_LABEL: job.name, naming.ROLE_LABEL: role,
                   naming.SPEC_HASH_LABEL: job.spec.pod_spec_hash()})
    return labels


def _scheduling(job: ResilientTrainingJob) -> Manifest:
    """The podTemplate fields that apply to every pod of the job (trainer and rendezvous)."""
    template = job.spec.pod_template
    if template is None:
        return {}
    spec: Manifest = {}
    if template.affinity:
        spec["affinity"] = template.affinity
    if template.priority_class_name:
        spec["priorityClassName"] = template.priority_class_name
    if template.service_account_name:
        spec["serviceAccountName"] = template.service_account_name
    if template.scheduler_name:
        spec["schedulerName"] = template.scheduler_name
    if template.image_pull_secrets:
        spec["imagePullSecrets"] = podextras.image_pull_secrets(job)
    return spec


def _automount_token(job: ResilientTrainingJob) -> bool:
    template = job.spec.pod_template
    return template is not None and template.automount_service_account_token


def _template_tolerations(job: ResilientTrainingJob) -> list[Manifest]:
    template = job.spec.pod_template
    return [t.to_api() for t in template.tolerations] if template is not None else []


AVOID_NODES_WEIGHT = 100
"""Weight of the preferred node anti-affinity against excluded nodes (the most a term may
have): the scheduler's NodeAffinity score then favours every other node that fits."""


def avoiding(affinity: Manifest | None, nodes: Sequence[str]) -> Manifest | None:
    """`affinity` (the podTemplate's, left unchanged) plus a PREFERRED node anti-affinity
    against `nodes`: a pod lands elsewhere unless no other node fits. The term matches the
    node's name (`matchFields metadata.name`), not a label that may differ from it: one
    `NotIn` requirement per node (ANDed within the term), since the API server allows exactly
    one value for a `metadata.name` field selector with `In`/`NotIn`."""
    if not nodes:
        return affinity
    merged: Manifest = copy.deepcopy(affinity) if affinity else {}
    node_affinity: Manifest = dict(merged.get("nodeAffinity") or {})
    preferred = list(node_affinity.get("preferredDuringSchedulingIgnoredDuringExecution") or [])
    preferred.append({
        "weight": AVOID_NODES_WEIGHT,
        "preference": {"matchFields": [
            {"key": "metadata.name", "operator": "NotIn", "values": [node]}
            for node in sorted(set(nodes))]},
    })
    node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] = preferred
    merged["nodeAffinity"] = node_affinity
    return merged


def trainer_pod(
    job: ResilientTrainingJob,
    *,
    plan: PodPlan,
    node_index: int,
    attempt: int,
    settings: OperatorSettings,
    avoid_nodes: Sequence[str] = (),
) -> Manifest:
    """Trainer pod `<job>-<i>`: one ft_launcher that runs procsPerNode workers; it prefers any
    node but `avoid_nodes` (the job's excluded nodes, see `avoiding`)."""
    name = naming.trainer_pod_name(job.name, node_index)
    labels = _pod_labels(job, naming.ROLE_TRAINER)
    labels.update({naming.NODE_INDEX_LABEL: str(node_index), naming.ATTEMPT_LABEL: str(attempt)})
    template = job.spec.pod_template
    annotations = dict(template.annotations) if template is not None else {}
    tolerations = _trainer_tolerations(job, plan)
    mounts, volumes = _trainer_volumes(job, plan)
    container = _trainer_container(job, plan=plan, node_index=node_index, attempt=attempt,
                                   settings=settings, mounts=mounts)
    pod_spec: Manifest = {
        "hostname": name,
        "subdomain": naming.headless_service_name(job.name),
        # The operator, not the kubelet, decides restarts.
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": plan.termination_grace_period_seconds,
        "enableServiceLinks": False,
        "automountServiceAccountToken": _automount_token(job),
        "securityContext": podsecurity.pod_security_context(job),
        "containers": [container],
        "volumes": volumes,
        **_scheduling(job),
    }
    starting = podextras.init_containers(job, container["securityContext"])
    if starting:
        pod_spec["initContainers"] = starting
    affinity = avoiding(pod_spec.get("affinity"), avoid_nodes)
    if affinity is not None:
        pod_spec["affinity"] = affinity
    if plan.resources.node_selector:
        pod_spec["nodeSelector"] = dict(plan.resources.node_selector)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _metadata(job, name=name, labels=labels, annotations=annotations),
        "spec": pod_spec,
    }


def _trainer_tolerations(job: ResilientTrainingJob, plan: PodPlan) -> list[Manifest]:
    """The trainer pod's tolerations: of the GPU and EFA taints when it asks for those
    devices, then the podTemplate's."""
    tolerations: list[Manifest] = []
    if plan.gpus:
        tolerations.append(
            {"key": profiles.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
        )
    if plan.efa_devices:
        tolerations.append(
            {"key": profiles.EFA_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
        )
    tolerations.extend(_template_tolerations(job))
    return tolerations


def _trainer_volumes(
    job: ResilientTrainingJob, plan: PodPlan
) -> tuple[list[Manifest], list[Manifest]]:
    """The trainer container's volume mounts and the pod's volumes: the checkpoint claim, and
    a memory-backed /dev/shm when the plan sizes one."""
    resolved = plan.resources
    mounts: list[Manifest] = [
        {"name": naming.CHECKPOINT_VOLUME, "mountPath": job.spec.checkpoint.mount_path}
    ]
    volumes: list[Manifest] = [
        {
            "name": naming.CHECKPOINT_VOLUME,
            "persistentVolumeClaim": {"claimName": job.checkpoint_claim_name},
        }
    ]
    if resolved.shm_size is not None:
        # NCCL and dataloader workers need far more shared memory than the runtime's 64 MiB.
        mounts.append({"name": naming.SHM_VOLUME, "mountPath": "/dev/shm"})
        volumes.append(
            {"name": naming.SHM_VOLUME,
             "emptyDir": {"medium": "Memory", "sizeLimit": resolved.shm_size}}
        )
    return mounts + podextras.extra_mounts(job), volumes + podextras.extra_volumes(job)


def _trainer_container(
    job: ResilientTrainingJob,
    *,
    plan: PodPlan,
    node_index: int,
    attempt: int,
    settings: OperatorSettings,
    mounts: list[Manifest],
) -> Manifest:
    """The trainer container: ft_launcher's command line (`launcher`), the environment
    (`trainerenv`), one metrics port per rank, the plan's resources and `mounts`."""
    spec = job.spec
    resolved = plan.resources
    template = spec.pod_template
    return {
        "name": naming.TRAINER_CONTAINER,
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": launcher.trainer_argv(job, plan, settings),
        "env": trainer_env(
            job, plan=plan, node_index=node_index, attempt=attempt, settings=settings
        ),
        "ports": [
            {"name": f"metrics-{r}", "containerPort": settings.trainer_metrics_port + r,
             "protocol": "TCP"}
            for r in range(plan.procs_per_node)
        ],
        # Copies: the plan is shared by every pod of the pass, a manifest must not alias it.
        "resources": {
            key: dict(value)
            for key, value in (("requests", resolved.requests), ("limits", resolved.limits))
            if value
        },
        "volumeMounts": mounts,
        # The trainer's termination message (rtj_wire.termination); when the trainer wrote
        # none and the container failed, the kubelet keeps the log's tail there instead.
        "terminationMessagePath": TERMINATION_MESSAGE_PATH,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": podsecurity.container_security_context(
            job, memory_lock=template is not None and template.memory_lock),
        **podextras.container_extras(job),
    }


def rendezvous_pod(
    job: ResilientTrainingJob, *, plan: PodPlan, settings: OperatorSettings
) -> Manifest:
    """Rendezvous pod `<job>-rdzv`: nvrx-control hosting the store, so that no trainer pod is
    special and any of them can be lost (nvrx.md E5/E6). Same image as the trainer."""
    spec = job.spec
    name = naming.rendezvous_name(job.name)
    template = spec.pod_template
    annotations = dict(template.annotations) if template is not None else {}
    pod_spec: Manifest = {
        "hostname": name,
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "automountServiceAccountToken": _automount_token(job),
        "securityContext": podsecurity.pod_security_context(job),
        "terminationGracePeriodSeconds": 10,
        "containers": [
            {
                "name": naming.RENDEZVOUS_CONTAINER,
                "image": spec.rendezvous_image or spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                "command": launcher.rendezvous_argv(job, plan, settings),
                "env": [field_env("POD_IP", "status.podIP")],
                "ports": [{"name": "rendezvous", "containerPort": settings.rendezvous_port,
                           "protocol": "TCP"}],
                "resources": {"requests": dict(RENDEZVOUS_REQUESTS)},
                "securityContext": podsecurity.container_security_context(job, memory_lock=False),
            }
        ],
        **_scheduling(job),
    }
    if template is not None and template.node_selector:
        pod_spec["nodeSelector"] = dict(template.node_selector)
    tolerations = _template_tolerations(job)
    if tolerations:
        pod_spec["tolerations"] = tolerations
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _metadata(
            job, name=name, labels=_pod_labels(job, naming.ROLE_RENDEZVOUS),
            annotations=annotations,
        ),
        "spec": pod_spec,
    }


def _service_labels(job: ResilientTrainingJob) -> dict[str, str]:
    return {naming.JOB_LABEL: job.name}


def _rendezvous_selector(job: ResilientTrainingJob) -> dict[str, str]:
    """The labels that select the job's rendezvous pod (its Service, its disruption budget)."""
    return {naming.JOB_LABEL: job.name, naming.ROLE_LABEL: naming.ROLE_RENDEZVOUS}


def rendezvous_service(job: ResilientTrainingJob, *, settings: OperatorSettings) -> Manifest:
    """ClusterIP Service `<job>-rdzv`: the stable address trainers join (`--rdzv-endpoint`)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(
            job, name=naming.rendezvous_name(job.name), labels=_service_labels(job)
        ),
        "spec": {
            "type": "ClusterIP",
            "selector": _rendezvous_selector(job),
            "ports": [{"name": "rendezvous", "port": settings.rendezvous_port,
                       "targetPort": settings.rendezvous_port, "protocol": "TCP"}],
        },
    }


def rendezvous_disruption_budget(job: ResilientTrainingJob) -> Manifest:
    """PodDisruptionBudget `<job>-rdzv` (`faultTolerance.rendezvousDisruptionBudget`): no
    voluntary eviction of the rendezvous pod (a drain waits), since losing its store restarts
    the whole job. A rendezvous pod that is not Ready may still be evicted
    (`unhealthyPodEvictionPolicy: AlwaysAllow`): it serves no one. Deletes are not evictions,
    so the operator's own (suspend, finish, a full restart) go through."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(
            job, name=naming.rendezvous_name(job.name), labels=_service_labels(job)
        ),
        "spec": {
            "maxUnavailable": 0,
            "selector": {"matchLabels": _rendezvous_selector(job)},
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def headless_service(
    job: ResilientTrainingJob, *, settings: OperatorSettings, network_policy: str | None = None
) -> Manifest:
    """Headless Service `<job>`: DNS names `<job>-<i>.<job>.<ns>.svc` for the trainer pods;
    `network_policy`: the digest of the job's NetworkPolicy created with it
    (`network_policy_digest`), kept in an annotation so drift is seen without reading policies."""
    annotations = ({naming.NETWORK_POLICY_ANNOTATION: network_policy}
                   if network_policy is not None else None)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(
            job, name=naming.headless_service_name(job.name), labels=_service_labels(job),
            annotations=annotations,
        ),
        "spec": {
            "clusterIP": "None",
            # Pods must resolve each other before they are ready (during rendezvous).
            "publishNotReadyAddresses": True,
            "selector": {naming.JOB_LABEL: job.name, naming.ROLE_LABEL: naming.ROLE_TRAINER},
            "ports": [{"name": "metrics", "port": settings.trainer_metrics_port,
                       "targetPort": settings.trainer_metrics_port, "protocol": "TCP"}],
        },
    }


NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
"""Set by the API server on every namespace: selects the operator's namespace by name."""


def network_policy(
    job: ResilientTrainingJob, *, plan: PodPlan, settings: OperatorSettings
) -> Manifest:
    """NetworkPolicy `<job>`: the job's pods accept ingress only from the job's own pods (every
    port: the rendezvous store, the trainers' c10d/gloo/NCCL sockets, metrics) and, on the
    trainers' liveness endpoint and metrics ports (`RTJ_METRICS_PORT - 1` to
    `RTJ_METRICS_PORT + procsPerNode - 1`), from the operator's pods (when the settings name
    them), and on the ranks' metrics ports from a Prometheus (when the settings name its
    namespace: `network_policy_scraper_*`). Egress is not restricted. Enforced only by a CNI
    that implements NetworkPolicy (docs/security.md)."""
    job_pods = {"podSelector": {"matchLabels": {naming.JOB_LABEL: job.name}}}
    ingress: list[Manifest] = [{"from": [job_pods]}]
    operator_labels = label_map(settings.network_policy_operator_labels)
    if settings.network_policy_operator_namespace:
        peer: Manifest = {"namespaceSelector": {"matchLabels": {
            NAMESPACE_NAME_LABEL: settings.network_policy_operator_namespace}}}
        peer["podSelector"] = {"matchLabels": operator_labels} if operator_labels else {}
        # The pod's liveness endpoint (one below the first rank's port) and every rank's.
        first = pod_endpoint_port(settings.trainer_metrics_port)
        last = settings.trainer_metrics_port + plan.procs_per_node - 1
        port: Manifest = {"protocol": "TCP", "port": first, "endPort": last}
        ingress.append({"from": [peer], "ports": [port]})
    if settings.network_policy_scraper_namespace:
        scraper_labels = label_map(settings.network_policy_scraper_labels)
        scraper: Manifest = {
            "namespaceSelector": {"matchLabels": {
                NAMESPACE_NAME_LABEL: settings.network_policy_scraper_namespace}},
            "podSelector": {"matchLabels": scraper_labels} if scraper_labels else {}}
        ranks: Manifest = {"protocol": "TCP", "port": settings.trainer_metrics_port,
                           "endPort": settings.trainer_metrics_port + plan.procs_per_node - 1}
        ingress.append({"from": [scraper], "ports": [ranks]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _metadata(
            job, name=naming.network_policy_name(job.name), labels=_service_labels(job)
        ),
        "spec": {
            "podSelector": job_pods["podSelector"],
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def network_policy_digest(policy: Manifest) -> str:
    """A short digest of a NetworkPolicy's spec: equal digests, equal rules."""
    text = json.dumps(policy["spec"], sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def checkpoint_claim(job: ResilientTrainingJob) -> Manifest:
    """ReadWriteMany claim `<job>-checkpoints` from spec.checkpoint.storageClassName.

    Owned by the job (deleted with it) unless claimDeletePolicy is Retain.
    """
    checkpoint = job.spec.checkpoint
    if checkpoint.storage_class_name is None or checkpoint.size is None:
        raise ValueError("checkpoint_claim needs checkpoint.storageClassName and size")
    return {
        "apiVersion": "v1",
        "kind": "PersistentVolumeClaim",
        "metadata": _metadata(
            job,
            name=naming.dynamic_claim_name(job.name),
            labels=_service_labels(job),
            owned=checkpoint.effective_claim_delete_policy == "Delete",
        ),
        "spec": {
            "accessModes": ["ReadWriteMany"],
            "storageClassName": checkpoint.storage_class_name,
            "resources": {"requests": {"storage": checkpoint.size}},
        },
    }
