"""What a team's own image needs in its pods (rtj_operator.podextras, added by
`builders.trainer_pod` and `builders.rendezvous_pod`): extra volumes and mounts, init containers,
image pull secrets, envFrom, the working directory, the /dev/shm size and the rendezvous image;
and the API's refusals of the names and paths that would collide with the operator's own
(api/spec_pods.py `PodTemplate`, api/models.py)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from rtj_operator import builders
from rtj_operator.api.models import parse_job
from rtj_operator.config import OperatorSettings
from rtj_operator.podplan import DEFAULT_SHM_SIZE, plan_for

pytestmark = pytest.mark.unit
SETTINGS = OperatorSettings()
IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/team-trainer:2.3"
RENDEZVOUS_IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/nvrx-control:0.7.0"

VOLUMES: list[dict[str, Any]] = [
    {"name": "datasets", "persistentVolumeClaim": {"claimName": "fsx-datasets",
                                                   "readOnly": True}},
    {"name": "hf-cache", "emptyDir": {"sizeLimit": "50Gi"}},
]
MOUNTS: list[dict[str, Any]] = [
    {"name": "datasets", "mountPath": "/data", "readOnly": True},
    {"name": "hf-cache", "mountPath": "/cache", "subPath": "hf"},
    {"name": "checkpoints", "mountPath": "/models", "subPath": "base-models"},
]
INIT_CONTAINERS: list[dict[str, Any]] = [
    {"name": "fetch-model", "image": "amazon/aws-cli:2.17", "command": ["aws", "s3", "sync"],
     "volumeMounts": [{"name": "hf-cache", "mountPath": "/cache"}],
     "securityContext": {"runAsUser": 1000, "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}}},
    {"name": "warm-cache", "image": IMAGE, "command": ["python", "-c", "pass"]},
]
TEMPLATE: dict[str, Any] = {
    "volumes": VOLUMES,
    "volumeMounts": MOUNTS,
    "initContainers": INIT_CONTAINERS,
    "imagePullSecrets": ["ecr-pull", "registry-mirror"],
    "envFrom": [{"configMapRef": {"name": "team-env"}},
                {"secretRef": {"name": "wandb", "optional": True}}],
    "workingDir": "/workspace",
    "shmSize": "8Gi",
}


def _job(*, template: dict[str, Any] | None = None, **spec_overrides: Any) -> Any:
    spec: dict[str, Any] = {
        "nodes": 2,
        "instanceType": "p5.48xlarge",
        "image": IMAGE,
        "command": ["python", "train.py"],
        "checkpoint": {"claimName": "fsx-checkpoints"},
    }
    if template is not None:
        spec["podTemplate"] = template
    spec.update(spec_overrides)
    return parse_job({
        "apiVersion": "training.resilient.dev/v1alpha1",
        "kind": "ResilientTrainingJob",
        "metadata": {"name": "team", "namespace": "ml", "uid": "u-team", "generation": 1},
        "spec": spec,
    })


def _byo_job(**spec_overrides: Any) -> Any:
    return _job(template=copy.deepcopy(TEMPLATE), rendezvousImage=RENDEZVOUS_IMAGE,
                **spec_overrides)


def _trainer_pod(job: Any) -> dict[str, Any]:
    return builders.trainer_pod(job, plan=plan_for(job, SETTINGS), node_index=1, attempt=0,
                                settings=SETTINGS)


def _rendezvous_pod(job: Any) -> dict[str, Any]:
    return builders.rendezvous_pod(job, plan=plan_for(job, SETTINGS), settings=SETTINGS)


def test_the_template_volumes_follow_the_operators_checkpoints_and_dshm() -> None:
    """The pod's volumes are the operator's (`checkpoints`, then `dshm`), then the template's,
    as given."""
    volumes = _trainer_pod(_byo_job())["spec"]["volumes"]
    assert [v["name"] for v in volumes] == ["checkpoints", "dshm", "datasets", "hf-cache"]
    assert volumes[0]["persistentVolumeClaim"] == {"claimName": "fsx-checkpoints"}
    assert volumes[2:] == VOLUMES


def test_the_template_mounts_follow_the_operators_mounts() -> None:
    """The trainer container mounts the checkpoint volume and /dev/shm first, then the template's
    mounts (a second mount of `checkpoints` at another path included)."""
    mounts = _trainer_pod(_byo_job())["spec"]["containers"][0]["volumeMounts"]
    assert mounts == [
        {"name": "checkpoints", "mountPath": "/checkpoints"},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "datasets", "mountPath": "/data", "readOnly": True},
        {"name": "hf-cache", "mountPath": "/cache", "subPath": "hf", "readOnly": False},
        {"name": "checkpoints", "mountPath": "/models", "subPath": "base-models",
         "readOnly": False},
    ]


def test_init_containers_get_the_trainer_security_defaults_under_their_own_fields() -> None:
    """Each init container is the template's, its securityContext the trainer container's
    (Pod Security `restricted` defaults) with the fields it sets itself on top."""
    pod = _trainer_pod(_byo_job())
    trainer_security = pod["spec"]["containers"][0]["securityContext"]
    assert trainer_security == {"allowPrivilegeEscalation": False,
                                "capabilities": {"drop": ["ALL"]}}
    first, second = pod["spec"]["initContainers"]
    assert first["securityContext"] == {"allowPrivilegeEscalation": False, "runAsUser": 1000,
                                        "capabilities": {"drop": ["ALL"], "add": ["CHOWN"]}}
    assert {k: v for k, v in first.items() if k != "securityContext"} == {
        k: v for k, v in INIT_CONTAINERS[0].items() if k != "securityContext"}
    assert second == {**INIT_CONTAINERS[1], "securityContext": trainer_security}
    assert second["securityContext"] is not trainer_security  # a copy, not an alias


def test_image_pull_secrets_are_on_the_trainer_and_the_rendezvous_pod() -> None:
    """`imagePullSecrets` names become core/v1 LocalObjectReferences on every pod of the job."""
    job = _byo_job()
    expected = [{"name": "ecr-pull"}, {"name": "registry-mirror"}]
    assert _trainer_pod(job)["spec"]["imagePullSecrets"] == expected
    assert _rendezvous_pod(job)["spec"]["imagePullSecrets"] == expected


def test_env_from_and_working_dir_are_on_the_trainer_container() -> None:
    """`envFrom` and `workingDir` reach the trainer container (and not the rendezvous one, which
    runs nvrx-control and needs neither)."""
    job = _byo_job()
    trainer = _trainer_pod(job)["spec"]["containers"][0]
    assert trainer["envFrom"] == TEMPLATE["envFrom"]
    assert trainer["workingDir"] == "/workspace"
    rendezvous = _rendezvous_pod(job)["spec"]["containers"][0]
    assert "envFrom" not in rendezvous and "workingDir" not in rendezvous


def test_the_rendezvous_pod_gets_no_volumes_init_containers_or_environment_sources() -> None:
    """The extras are the trainer's: the rendezvous pod (nvrx-control) takes only the pull
    secrets, so a dataset claim or a slow download never holds up the job's store."""
    spec = _rendezvous_pod(_byo_job())["spec"]
    assert not {"volumes", "initContainers"} & set(spec)
    assert not {"volumeMounts", "envFrom", "workingDir"} & set(spec["containers"][0])


def test_shm_size_sizes_the_memory_backed_dev_shm() -> None:
    """`shmSize: 8Gi` replaces the instance profile's /dev/shm size (256Gi on a p5.48xlarge)."""
    volumes = {v["name"]: v for v in _trainer_pod(_byo_job())["spec"]["volumes"]}
    assert volumes["dshm"] == {"name": "dshm",
                               "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}}
    profile = {v["name"]: v for v in _trainer_pod(_job())["spec"]["volumes"]}
    assert profile["dshm"]["emptyDir"]["sizeLimit"] == "256Gi"


def test_the_rendezvous_container_runs_the_rendezvous_image_else_the_image() -> None:
    """`rendezvousImage` is the rendezvous pod's image; without it the job's `image` is; the
    trainer pods run `image` either way."""
    job = _byo_job()
    assert _rendezvous_pod(job)["spec"]["containers"][0]["image"] == RENDEZVOUS_IMAGE
    assert _trainer_pod(job)["spec"]["containers"][0]["image"] == IMAGE
    assert _rendezvous_pod(_job())["spec"]["containers"][0]["image"] == IMAGE


def test_a_job_without_a_template_has_none_of_the_extras() -> None:
    """No podTemplate: no init containers, pull secrets, envFrom or workingDir, and only the
    operator's volumes."""
    pod = _trainer_pod(_job())
    spec, container = pod["spec"], pod["spec"]["containers"][0]
    assert [v["name"] for v in spec["volumes"]] == ["checkpoints", "dshm"]
    assert not {"initContainers", "imagePullSecrets"} & set(spec)
    assert not {"envFrom", "workingDir"} & set(container)
    assert "imagePullSecrets" not in _rendezvous_pod(_job())["spec"]


def test_an_instance_type_without_a_profile_gets_a_1gi_dev_shm() -> None:
    """Without a built-in profile (and no podTemplate) /dev/shm is DEFAULT_SHM_SIZE, 1Gi: the
    container runtime's 64 MiB is too little for a DataLoader's workers."""
    job = _job(instanceType="m7i.8xlarge", resources={"requests": {"cpu": "30", "memory": "100Gi"}})
    assert job.spec.pod_template is None
    pod = _trainer_pod(job)
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert DEFAULT_SHM_SIZE == "1Gi"
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}
    mounts = pod["spec"]["containers"][0]["volumeMounts"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in mounts


def _with(**changes: Any) -> dict[str, Any]:
    template = copy.deepcopy(TEMPLATE)
    template.update(changes)
    return template


@pytest.mark.parametrize(("template", "needle"), [
    pytest.param(_with(volumes=[*VOLUMES, {"name": "checkpoints", "emptyDir": {}}]),
                 "podTemplate.volumes", id="volume-named-checkpoints"),
    pytest.param(_with(volumes=[*VOLUMES, {"name": "dshm", "emptyDir": {}}]),
                 "podTemplate.volumes", id="volume-named-dshm"),
    pytest.param(_with(volumes=[*VOLUMES, {"name": "datasets", "emptyDir": {}}]),
                 "podTemplate.volumes", id="two-volumes-of-one-name"),
    pytest.param(_with(volumes=[*VOLUMES, {"emptyDir": {}}]),
                 "podTemplate.volumes", id="volume-without-a-name"),
    pytest.param(_with(volumeMounts=[*MOUNTS, {"name": "nowhere", "mountPath": "/x"}]),
                 "podTemplate.volumeMounts: 'nowhere' is not a volume", id="undeclared-volume"),
    pytest.param(_with(volumeMounts=[{"name": "hf-cache", "mountPath": "/dev/shm"}]),
                 "podTemplate.volumeMounts: /dev/shm", id="mount-at-dev-shm"),
    pytest.param(_with(volumeMounts=[{"name": "hf-cache", "mountPath": "/dev/shm/"}]),
                 "podTemplate.volumeMounts: /dev/shm", id="mount-at-dev-shm-slash"),
    pytest.param(_with(volumeMounts=[{"name": "datasets", "mountPath": "/checkpoints"}]),
                 "podTemplate.volumeMounts: /checkpoints is the checkpoint volume's mountPath",
                 id="mount-at-the-checkpoint-mount-path"),
    pytest.param(_with(volumeMounts=[{"name": "datasets", "mountPath": "/checkpoints/"}]),
                 "podTemplate.volumeMounts: /checkpoints is the checkpoint volume's mountPath",
                 id="mount-at-the-checkpoint-mount-path-slash"),
    pytest.param(_with(initContainers=[*INIT_CONTAINERS, {"image": IMAGE}]),
                 "podTemplate.initContainers", id="init-container-without-a-name"),
    pytest.param(_with(initContainers=[*INIT_CONTAINERS, dict(INIT_CONTAINERS[1])]),
                 "podTemplate.initContainers", id="two-init-containers-of-one-name"),
])
def test_the_api_refuses_names_and_paths_that_collide_with_the_operators(
        template: dict[str, Any], needle: str) -> None:
    """Each collision is a pydantic ValueError from parse_job whose message names the field."""
    with pytest.raises(ValueError) as caught:
        _job(template=template)
    assert needle in str(caught.value)


def test_the_refused_mount_path_is_the_checkpoint_volumes_own() -> None:
    """The refused path is the checkpoint volume's own mountPath, whatever it is set to."""
    moved = {"claimName": "fsx-checkpoints", "mountPath": "/ckpt"}
    with pytest.raises(ValueError, match="/ckpt is the checkpoint volume's mountPath"):
        _job(template=_with(volumeMounts=[{"name": "datasets", "mountPath": "/ckpt"}]),
             checkpoint=moved)
    job = _job(template=_with(volumeMounts=[{"name": "datasets", "mountPath": "/checkpoints"}]),
               checkpoint=moved)
    mounts = _trainer_pod(job)["spec"]["containers"][0]["volumeMounts"]
    assert [m["mountPath"] for m in mounts] == ["/ckpt", "/dev/shm", "/checkpoints"]
