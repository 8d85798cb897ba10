"""The pod plan (`rtj_operator.podplan`): what a job's pods need, resolved once a pass from the
spec, its instance profile and the operator settings."""

from __future__ import annotations

import pytest
from rtj_operator.api import models
from rtj_operator.config import OperatorSettings
from rtj_operator.podplan import plan_for, resolve_profile
from unit.manifests import job

pytestmark = pytest.mark.unit


def test_the_p5_profile_reserves_the_whole_instance() -> None:
    resolved = resolve_profile(models.parse_job(job()).spec)
    assert resolved.procs_per_node == 8
    assert resolved.requests == {
        "cpu": "184",
        "memory": "1800Gi",
        "nvidia.com/gpu": "8",
        "vpc.amazonaws.com/efa": "32",
        "hugepages-2Mi": "5120Mi",
    }
    assert resolved.limits == {
        "nvidia.com/gpu": "8",
        "vpc.amazonaws.com/efa": "32",
        "hugepages-2Mi": "5120Mi",
    }
    assert resolved.node_selector == {"node.kubernetes.io/instance-type": "p5.48xlarge"}
    assert resolved.shm_size == "256Gi"
    assert resolved.env["FI_PROVIDER"] == "efa"


def test_explicit_resources_and_node_selector_override_the_profile_key_by_key() -> None:
    spec = models.parse_job(
        job(
            instanceType="p4d.24xlarge",
            procsPerNode=4,
            resources={"requests": {"cpu": "40"}},
            podTemplate={"nodeSelector": {"pool": "a100", "node.kubernetes.io/instance-type": "x"}},
        )
    ).spec
    resolved = resolve_profile(spec)
    assert resolved.procs_per_node == 4
    assert resolved.requests["cpu"] == "40" and resolved.requests["vpc.amazonaws.com/efa"] == "4"
    assert resolved.node_selector == {"node.kubernetes.io/instance-type": "x", "pool": "a100"}


def test_an_instance_type_without_profile_uses_exactly_the_given_resources() -> None:
    spec = models.parse_job(
        job(instanceType="g5.48xlarge", resources={"limits": {"nvidia.com/gpu": 8}})
    ).spec
    resolved = resolve_profile(spec)
    assert resolved.profile is None and resolved.procs_per_node == 1
    assert resolved.requests == {} and resolved.limits == {"nvidia.com/gpu": "8"}
    assert resolved.node_selector == {} and resolved.shm_size == "1Gi"


def test_the_plan_of_a_p5_job_has_one_rank_per_gpu_and_every_device() -> None:
    plan = plan_for(models.parse_job(job()), OperatorSettings())
    assert plan.procs_per_node == plan.resources.procs_per_node == 8
    assert (plan.gpus, plan.efa_devices) == (8, 32)
    assert (plan.termination_grace_period_seconds, plan.term_timeout_seconds) == (120, 108)
    assert plan.rendezvous_id == "1234"
    assert plan.rendezvous_endpoint == "demo-rdzv:29400"


def test_the_plan_of_a_cpu_job_has_no_devices_and_the_given_procs() -> None:
    spec = job(instanceType="c7i.8xlarge", procsPerNode=2,
               resources={"requests": {"cpu": "4"}, "limits": {}},
               podTemplate={"terminationGracePeriodSeconds": 300})
    plan = plan_for(models.parse_job(spec), OperatorSettings(rendezvous_port=1234))
    assert (plan.procs_per_node, plan.gpus, plan.efa_devices) == (2, 0, 0)
    assert (plan.termination_grace_period_seconds, plan.term_timeout_seconds) == (300, 270)
    assert plan.rendezvous_endpoint == "demo-rdzv:1234"


def test_a_job_without_uid_has_no_plan() -> None:
    body = job()
    del body["metadata"]["uid"]
    with pytest.raises(ValueError, match="uid"):
        plan_for(models.parse_job(body), OperatorSettings())
