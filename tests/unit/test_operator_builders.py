"""The objects the operator creates, built from a spec: the p5.48xlarge trainer pod is pinned by
a golden file (tests/unit/golden/); set UPDATE_GOLDEN=1 to rewrite it after a deliberate change."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from rtj_operator import builders, podsecurity
from rtj_operator.api.models import parse_job
from rtj_operator.config import OperatorSettings
from rtj_operator.podplan import plan_for

pytestmark = pytest.mark.unit
GOLDEN = Path(__file__).with_name("golden")
SETTINGS = OperatorSettings()


def p5_job(**overrides: Any) -> Any:
    spec: dict[str, Any] = {
        "nodes": 8,
        "instanceType": "p5.48xlarge",
        "image": "123456789012.dkr.ecr.us-west-2.amazonaws.com/trainer:1.0",
        "args": ["--preset", "llama-8b"],
        "env": [{"name": "HF_HOME", "value": "/checkpoints/.cache"}],
        "checkpoint": {"claimName": "fsx-checkpoints", "intervalSteps": 500, "keep": 2},
        "faultTolerance": {"heartbeatTimeoutSeconds": 120, "initialHeartbeatTimeoutSeconds": 1200},
        "podTemplate": {
            "labels": {"kueue.x-k8s.io/queue-name": "training"},
            "priorityClassName": "training-high",
            "terminationGracePeriodSeconds": 120,
            "tolerations": [{"key": "dedicated", "value": "ml", "effect": "NoSchedule"}],
        },
    }
    spec.update(overrides)
    return parse_job({
        "apiVersion": "training.resilient.dev/v1alpha1",
        "kind": "ResilientTrainingJob",
        "metadata": {"name": "llama", "namespace": "ml", "uid": "0e5a-uid", "generation": 1},
        "spec": spec,
    })


def trainer_pod(job: Any, **where: Any) -> dict[str, Any]:
    return builders.trainer_pod(job, plan=plan_for(job, where["settings"]), **where)


def rendezvous_pod(job: Any) -> dict[str, Any]:
    return builders.rendezvous_pod(job, plan=plan_for(job, SETTINGS), settings=SETTINGS)


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom"))
            for e in pod["spec"]["containers"][0]["env"]}


def check_golden(name: str, manifest: dict[str, Any]) -> None:
    path = GOLDEN / name
    text = yaml.safe_dump(manifest, sort_keys=False, width=100)
    if os.environ.get("UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert path.exists(), f"{name} is missing; run with UPDATE_GOLDEN=1 to write it"
    assert text == path.read_text(), f"{name} changed; rerun with UPDATE_GOLDEN=1 if intended"


def test_p5_trainer_pod_matches_the_golden_file() -> None:
    pod = trainer_pod(p5_job(), node_index=3, attempt=2, settings=SETTINGS)
    check_golden("p5-trainer-pod.yaml", pod)


def test_p5_trainer_pod_reserves_the_whole_instance() -> None:
    pod = trainer_pod(p5_job(), node_index=0, attempt=0, settings=SETTINGS)
    container = pod["spec"]["containers"][0]
    limits = container["resources"]["limits"]
    requests = container["resources"]["requests"]
    assert limits["nvidia.com/gpu"] == requests["nvidia.com/gpu"] == "8"
    assert limits["vpc.amazonaws.com/efa"] == requests["vpc.amazonaws.com/efa"] == "32"
    assert limits["hugepages-2Mi"] == requests["hugepages-2Mi"]
    assert {"cpu", "memory"} <= set(requests)
    # Pod Security `restricted` shape; no IPC_LOCK unless podTemplate.memoryLock asks for it.
    assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                            "capabilities": {"drop": ["ALL"]}}
    assert pod["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    tolerations = pod["spec"]["tolerations"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    assert {"key": "vpc.amazonaws.com/efa", "operator": "Exists",
            "effect": "NoSchedule"} in tolerations
    assert {"key": "dedicated", "value": "ml", "effect": "NoSchedule"} in tolerations


def test_p5_trainer_pod_mounts_the_checkpoint_claim_and_a_memory_backed_shm() -> None:
    pod = trainer_pod(p5_job(), node_index=0, attempt=0, settings=SETTINGS)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "fsx-checkpoints"}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    mounts = {m["name"]: m["mountPath"] for m in pod["spec"]["containers"][0]["volumeMounts"]}
    assert mounts == {"checkpoints": "/checkpoints", "dshm": "/dev/shm"}


def test_p5_trainer_pod_identity_and_restart_policy() -> None:
    job = p5_job()
    pod = trainer_pod(job, node_index=3, attempt=2, settings=SETTINGS)
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "llama-3"
    assert meta["labels"] == {
        "kueue.x-k8s.io/queue-name": "training",
        "training.resilient.dev/job": "llama",
        "training.resilient.dev/role": "trainer",
        "training.resilient.dev/node-index": "3",
        "training.resilient.dev/attempt": "2",
        "training.resilient.dev/spec-hash": job.spec.pod_spec_hash(),
    }
    assert meta["ownerReferences"] == [{
        "apiVersion": "training.resilient.dev/v1alpha1", "kind": "ResilientTrainingJob",
        "name": "llama", "uid": "0e5a-uid", "controller": True, "blockOwnerDeletion": True,
    }]
    assert (spec["hostname"], spec["subdomain"]) == ("llama-3", "llama")
    assert spec["restartPolicy"] == "Never"
    assert spec["priorityClassName"] == "training-high"
    assert spec["terminationGracePeriodSeconds"] == 120


def test_p5_trainer_env_carries_the_contract_and_the_efa_settings() -> None:
    env = env_of(trainer_pod(p5_job(), node_index=3, attempt=2, settings=SETTINGS))
    assert env["POD_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["RTJ_METRICS_HOST"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    expected = {
        "RTJ_JOB_NAME": "llama", "RTJ_JOB_UID": "0e5a-uid", "RTJ_NODE_INDEX": "3",
        "GROUP_RANK": "3", "RTJ_NNODES": "8", "RTJ_PROCS_PER_NODE": "8", "RTJ_ATTEMPT": "2",
        "RTJ_CHECKPOINT_DIR": "/checkpoints/ml/llama", "RTJ_CHECKPOINT_INTERVAL_STEPS": "500",
        "RTJ_CHECKPOINT_KEEP": "2", "RTJ_CHECKPOINT_MODE": "async", "RTJ_METRICS_PORT": "9400",
        "RTJ_INPROCESS_RESTART": "1", "RTJ_HEARTBEAT_TIMEOUT_SECONDS": "120",
        "FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1",
        "RDMAV_FORK_SAFE": "1", "NCCL_NVLS_ENABLE": "0", "NCCL_SOCKET_IFNAME": "^lo,docker,veth",
        # In-process restart (on by default) needs the survivors' processes kept on an abort.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "HF_HOME": "/checkpoints/.cache",
    }
    assert {k: env[k] for k in expected} == expected


def test_without_in_process_restart_an_nccl_error_ends_the_worker() -> None:
    job = p5_job(faultTolerance={"inProcessRestart": "Disabled"})
    env = env_of(trainer_pod(job, node_index=0, attempt=0, settings=SETTINGS))
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert "TORCH_NCCL_RETHROW_CUDA_ERRORS" not in env


def test_user_env_overrides_the_platform_defaults_without_duplicates() -> None:
    job = p5_job(env=[{"name": "NCCL_SOCKET_IFNAME", "value": "eth0"}])
    pod = trainer_pod(job, node_index=0, attempt=0, settings=SETTINGS)
    names = [e["name"] for e in pod["spec"]["containers"][0]["env"]]
    assert names.count("NCCL_SOCKET_IFNAME") == 1
    assert env_of(pod)["NCCL_SOCKET_IFNAME"] == "eth0"


@pytest.mark.parametrize(("field", "variable"), [
    ("warmWorkers", "RTJ_WARM_WORKERS"), ("deviceKeepers", "RTJ_DEVICE_KEEPER"),
])
@pytest.mark.parametrize(("setting", "gpu", "cpu"), [
    ("Auto", "1", "0"), ("Enabled", "1", "1"), ("Disabled", "0", "0"),
])
def test_warm_workers_and_device_keepers_are_on_with_gpus_unless_the_job_says_otherwise(
        field: str, variable: str, setting: str, gpu: str, cpu: str) -> None:
    job = p5_job(faultTolerance={field: setting})
    assert env_of(trainer_pod(job, node_index=0, attempt=0, settings=SETTINGS))[variable] == gpu
    cpu_job = p5_job(instanceType="c7i.8xlarge", procsPerNode=2,
                     resources={"requests": {"cpu": "4", "memory": "8Gi"}}, env=[],
                     faultTolerance={field: setting})
    assert env_of(trainer_pod(cpu_job, node_index=0, attempt=0, settings=SETTINGS))[
        variable] == cpu


def test_trainer_command_is_ft_launcher_with_the_trainer_argv() -> None:
    pod = trainer_pod(p5_job(), node_index=0, attempt=0, settings=SETTINGS)
    command = pod["spec"]["containers"][0]["command"]
    assert command[:4] == ["python", "-m", "rtj_trainer.launcher",
                           "--rtj-non-retryable-exit-codes=94"]
    container = pod["spec"]["containers"][0]
    assert container["terminationMessagePath"] == "/dev/termination-log"
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert {"name": "RTJ_TERMINATION_MESSAGE_PATH",
            "value": "/dev/termination-log"} in container["env"]
    assert command[-5:] == ["python", "-m", "rtj_trainer", "--preset", "llama-8b"]
    assert "args" not in pod["spec"]["containers"][0]


def test_a_cpu_job_without_gpus_gets_no_efa_or_nccl_settings_and_a_default_shm() -> None:
    """An instance type without a profile gets a 1Gi /dev/shm (the runtime's 64 MiB breaks
    DataLoader workers); podTemplate.shmSize sets any size."""
    job = p5_job(instanceType="c7i.8xlarge", procsPerNode=2,
                 resources={"requests": {"cpu": "4", "memory": "8Gi"}}, env=[])
    pod = trainer_pod(job, node_index=1, attempt=0, settings=SETTINGS)
    env = env_of(pod)
    assert not {"FI_PROVIDER", "NCCL_NVLS_ENABLE", "FI_EFA_FORK_SAFE"} & set(env)
    assert [v["name"] for v in pod["spec"]["volumes"]] == ["checkpoints", "dshm"]
    assert pod["spec"]["volumes"][1]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    assert "add" not in pod["spec"]["containers"][0]["securityContext"]["capabilities"]
    assert pod["spec"]["tolerations"] == [
        {"key": "dedicated", "value": "ml", "effect": "NoSchedule"}
    ]
    assert [p["containerPort"] for p in pod["spec"]["containers"][0]["ports"]] == [9400, 9401]


def test_dynamic_fsx_builds_a_read_write_many_claim_of_the_storage_class() -> None:
    job = p5_job(checkpoint={"storageClassName": "fsx-lustre", "size": "1200Gi"})
    claim = builders.checkpoint_claim(job)
    assert claim["metadata"]["name"] == "llama-checkpoints"
    assert claim["spec"] == {
        "accessModes": ["ReadWriteMany"],
        "storageClassName": "fsx-lustre",
        "resources": {"requests": {"storage": "1200Gi"}},
    }
    assert claim["metadata"]["ownerReferences"][0]["uid"] == "0e5a-uid"
    pod = trainer_pod(job, node_index=0, attempt=0, settings=SETTINGS)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "llama-checkpoints"}


def test_a_retained_claim_has_no_owner() -> None:
    job = p5_job(checkpoint={"storageClassName": "fsx-lustre", "size": "1200Gi",
                             "claimDeletePolicy": "Retain"})
    assert "ownerReferences" not in builders.checkpoint_claim(job)["metadata"]


def test_rendezvous_pod_runs_nvrx_control_with_the_trainer_image() -> None:
    pod = rendezvous_pod(p5_job())
    container = pod["spec"]["containers"][0]
    assert pod["metadata"]["name"] == "llama-rdzv"
    assert pod["metadata"]["labels"]["training.resilient.dev/role"] == "rendezvous"
    assert container["image"] == p5_job().spec.image
    assert container["command"][0] == "nvrx-control"
    assert "nvidia.com/gpu" not in container["resources"]["requests"]
    assert pod["spec"]["restartPolicy"] == "Never"


def test_services_select_their_pods() -> None:
    rdzv = builders.rendezvous_service(p5_job(), settings=SETTINGS)
    headless = builders.headless_service(p5_job(), settings=SETTINGS)
    assert rdzv["metadata"]["name"] == "llama-rdzv"
    assert rdzv["spec"]["selector"]["training.resilient.dev/role"] == "rendezvous"
    assert rdzv["spec"]["ports"][0]["port"] == 29400
    assert headless["metadata"]["name"] == "llama"
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert headless["spec"]["selector"]["training.resilient.dev/role"] == "trainer"


def test_pods_built_from_one_plan_share_no_resource_dicts() -> None:
    job = p5_job()
    plan = plan_for(job, SETTINGS)
    first, second = (
        builders.trainer_pod(job, plan=plan, node_index=i, attempt=0, settings=SETTINGS)
        for i in (0, 1)
    )
    first["spec"]["containers"][0]["resources"]["requests"]["cpu"] = "1"
    assert second["spec"]["containers"][0]["resources"]["requests"]["cpu"] == "184"
    assert plan.resources.requests["cpu"] == "184"


def test_fault_injection_reaches_the_trainer_only_when_the_spec_enables_it() -> None:
    plain = env_of(trainer_pod(p5_job(), node_index=0, attempt=0, settings=SETTINGS))
    assert "RTJ_FAULT_INJECTION" not in plain
    armed = p5_job(faultTolerance={"faultInjection": "Enabled"},
                   env=[{"name": "TRAINER_FAULTS", "value": "10:1:sigkill"}])
    env = env_of(trainer_pod(armed, node_index=0, attempt=0, settings=SETTINGS))
    assert env["RTJ_FAULT_INJECTION"] == "1" and env["TRAINER_FAULTS"] == "10:1:sigkill"
    with pytest.raises(ValueError, match=r"TRAINER_FAULTS needs faultTolerance\.faultInjection"):
        p5_job(env=[{"name": "TRAINER_FAULTS", "value": "10:1:sigkill"}])


# --- excluded nodes: a preferred node anti-affinity, merged with the user's ---------------------

USER_AFFINITY: dict[str, Any] = {
    "nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "topology.kubernetes.io/zone", "operator": "In",
                                   "values": ["us-west-2a"]}]}]},
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": 10, "preference": {"matchExpressions": [
                {"key": "capacity", "operator": "In", "values": ["reserved"]}]}}],
    },
    "podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []},
}
# One requirement per node: the API server refuses a `metadata.name` field selector with more
# than one value ("must have one element"), so two excluded nodes are two ANDed requirements.
AVOID_TERM = {"weight": 100, "preference": {"matchFields": [
    {"key": "metadata.name", "operator": "NotIn", "values": ["ip-10-0-1-5"]},
    {"key": "metadata.name", "operator": "NotIn", "values": ["ip-10-0-1-7"]}]}}


def test_a_trainer_pod_prefers_every_node_but_the_excluded_ones() -> None:
    job = p5_job()
    plan = plan_for(job, SETTINGS)
    pod = builders.trainer_pod(job, plan=plan, node_index=3, attempt=1, settings=SETTINGS,
                               avoid_nodes=["ip-10-0-1-7", "ip-10-0-1-5"])
    assert pod["spec"]["affinity"] == {
        "nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [AVOID_TERM]}}
    plain = builders.trainer_pod(job, plan=plan, node_index=3, attempt=1, settings=SETTINGS)
    assert "affinity" not in plain["spec"]


def test_the_excluded_nodes_merge_with_the_users_affinity_and_leave_it_unchanged() -> None:
    template = {"labels": {}, "affinity": USER_AFFINITY}
    job = p5_job(podTemplate=template)
    plan = plan_for(job, SETTINGS)
    before = yaml.safe_dump(job.spec.pod_template.affinity)
    pod = builders.trainer_pod(job, plan=plan, node_index=0, attempt=2, settings=SETTINGS,
                               avoid_nodes=["ip-10-0-1-5", "ip-10-0-1-7"])
    node_affinity = pod["spec"]["affinity"]["nodeAffinity"]
    assert node_affinity["requiredDuringSchedulingIgnoredDuringExecution"] == (
        USER_AFFINITY["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"])
    assert node_affinity["preferredDuringSchedulingIgnoredDuringExecution"] == [
        *USER_AFFINITY["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"],
        AVOID_TERM]
    assert pod["spec"]["affinity"]["podAntiAffinity"] == USER_AFFINITY["podAntiAffinity"]
    assert yaml.safe_dump(job.spec.pod_template.affinity) == before  # the spec is not touched
    rendezvous = builders.rendezvous_pod(job, plan=plan, settings=SETTINGS)
    assert rendezvous["spec"]["affinity"] == USER_AFFINITY  # only trainer pods avoid nodes


# --- Pod Security (docs/security.md) ----------------------------------------------------------

RESTRICTED_POD = {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def test_trainer_and_rendezvous_pods_default_to_the_restricted_shape_without_a_token() -> None:
    job = p5_job()
    for pod in (trainer_pod(job, node_index=0, attempt=0, settings=SETTINGS),
                rendezvous_pod(job)):
        assert pod["spec"]["securityContext"] == RESTRICTED_POD
        assert pod["spec"]["containers"][0]["securityContext"] == RESTRICTED_CONTAINER
        assert pod["spec"]["automountServiceAccountToken"] is False


def test_memory_lock_adds_ipc_lock_to_the_trainer_only() -> None:
    job = p5_job(podTemplate={"memoryLock": True})
    trainer = trainer_pod(job, node_index=0, attempt=0, settings=SETTINGS)
    assert trainer["spec"]["containers"][0]["securityContext"]["capabilities"] == {
        "drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert rendezvous_pod(job)["spec"]["containers"][0]["securityContext"] == \
        RESTRICTED_CONTAINER


def test_the_templates_security_contexts_replace_the_defaults_field_by_field() -> None:
    job = p5_job(podTemplate={
        "securityContext": {"fsGroup": 10001, "fsGroupChangePolicy": "OnRootMismatch",
                            "runAsUser": 2000, "runAsGroup": 3000,
                            "seccompProfile": {"type": "Localhost",
                                               "localhostProfile": "profiles/trainer.json"}},
        "containerSecurityContext": {"readOnlyRootFilesystem": True,
                                     "capabilities": {"add": ["SYS_PTRACE"], "drop": ["NET_RAW"]}},
        "memoryLock": True,
        "automountServiceAccountToken": True,
    })
    pod = trainer_pod(job, node_index=0, attempt=0, settings=SETTINGS)
    assert pod["spec"]["securityContext"] == {
        "runAsNonRoot": True, "runAsUser": 2000, "runAsGroup": 3000, "fsGroup": 10001,
        "fsGroupChangePolicy": "OnRootMismatch",
        "seccompProfile": {"type": "Localhost", "localhostProfile": "profiles/trainer.json"},
    }
    assert pod["spec"]["containers"][0]["securityContext"] == {
        "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
        "capabilities": {"add": ["SYS_PTRACE", "IPC_LOCK"], "drop": ["NET_RAW"]},
    }
    assert pod["spec"]["automountServiceAccountToken"] is True
    assert podsecurity.POD_SECURITY_DEFAULTS == RESTRICTED_POD, "the defaults are not mutated"


def test_the_accepted_foreign_jobs_reach_the_trainer_only_when_named() -> None:
    plain = env_of(trainer_pod(p5_job(), node_index=0, attempt=0, settings=SETTINGS))
    assert "RTJ_CHECKPOINT_RESUME_FROM_JOBS" not in plain
    job = p5_job(checkpoint={"claimName": "fsx", "path": "runs/base",
                             "resumeFromJobs": ["ml/base-run", "other/warmup"]})
    env = env_of(trainer_pod(job, node_index=0, attempt=0, settings=SETTINGS))
    assert env["RTJ_CHECKPOINT_RESUME_FROM_JOBS"] == "ml/base-run,other/warmup"
    assert env["RTJ_CHECKPOINT_DIR"] == "/checkpoints/runs/base"


# --- NetworkPolicy ----------------------------------------------------------------------------


def test_the_network_policy_admits_the_jobs_pods_everywhere_and_the_operator_to_metrics() -> None:
    settings = replace(SETTINGS, network_policy_operator_namespace="rtj-system",
                       network_policy_operator_labels="app.kubernetes.io/name=rtj-operator,"
                                                      "app.kubernetes.io/instance=rtj")
    job = p5_job()
    policy = builders.network_policy(job, plan=plan_for(job, settings), settings=settings)
    assert policy["metadata"]["name"] == "llama" and policy["metadata"]["namespace"] == "ml"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "0e5a-uid"
    own = {"matchLabels": {"training.resilient.dev/job": "llama"}}
    assert policy["spec"]["podSelector"] == own
    assert policy["spec"]["policyTypes"] == ["Ingress"]  # egress (DNS, S3, images) stays open
    assert policy["spec"]["ingress"] == [
        {"from": [{"podSelector": own}]},
        {"from": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "rtj-system"}},
                   "podSelector": {"matchLabels": {"app.kubernetes.io/name": "rtj-operator",
                                                   "app.kubernetes.io/instance": "rtj"}}}],
         "ports": [{"protocol": "TCP", "port": 9399, "endPort": 9407}]},  # pod endpoint, 8 ranks
    ]


def test_a_named_prometheus_is_admitted_to_the_ranks_metrics_ports_only() -> None:
    # review-2: the shipped dashboard queries rtj_trainer_* but the policy admitted only the
    # operator, so Prometheus could scrape no rank.
    settings = replace(SETTINGS, network_policy_scraper_namespace="monitoring",
                       network_policy_scraper_labels="app.kubernetes.io/name=prometheus")
    job = p5_job()
    policy = builders.network_policy(job, plan=plan_for(job, settings), settings=settings)
    assert policy["spec"]["ingress"][-1] == {
        "from": [{"namespaceSelector": {"matchLabels": {
            "kubernetes.io/metadata.name": "monitoring"}},
                  "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}],
        "ports": [{"protocol": "TCP", "port": 9400, "endPort": 9407}]}  # ranks, not 9399
    everyone = replace(settings, network_policy_scraper_labels="")
    policy = builders.network_policy(job, plan=plan_for(job, everyone), settings=everyone)
    assert policy["spec"]["ingress"][-1]["from"][0]["podSelector"] == {}


def test_without_an_operator_namespace_only_the_jobs_own_pods_are_admitted() -> None:
    job = p5_job()
    policy = builders.network_policy(job, plan=plan_for(job, SETTINGS), settings=SETTINGS)
    assert policy["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": {"training.resilient.dev/job": "llama"}}}]}]
