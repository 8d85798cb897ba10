"""The pydantic models of ResilientTrainingJob: parsing, defaults, cross-field rules, profiles.

The same models parse what the operator reads from the API server, so these tests pin down what a
parsed object looks like (snake_case attributes, the CRD's defaults filled in) and that every
cross-field rule fails with a message that names the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError
from rtj_operator.api import models
from rtj_operator.api.spec_checkpoint import Checkpoint
from rtj_operator.podplan import resolve_profile
from unit.manifests import job

pytestmark = pytest.mark.unit


def parse_spec(spec: Mapping[str, Any]) -> models.ResilientTrainingJobSpec:
    """Parse only a spec (the operator always parses whole objects)."""
    return models.ResilientTrainingJobSpec.model_validate(models.plain(spec))

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def error_text(body: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as caught:
        models.parse_job(body)
    return str(caught.value)


def test_a_minimal_job_gets_every_documented_default() -> None:
    parsed = models.parse_job(job())
    spec = parsed.spec
    assert spec.instance_type == "p5.48xlarge"
    assert spec.procs_per_node is None and resolve_profile(spec).procs_per_node == 8
    assert spec.image_pull_policy == "IfNotPresent"
    assert spec.command == ["python", "-m", "rtj_trainer"] and spec.args == [] and spec.env == []
    assert spec.suspend is False
    assert spec.active_deadline_seconds is None and spec.ttl_seconds_after_finished is None
    cp = spec.checkpoint
    assert (cp.mount_path, cp.path, cp.interval_steps, cp.keep, cp.mode) == (
        "/checkpoints",
        None,
        100,
        3,
        "Async",
    )
    ft = spec.fault_tolerance
    assert (
        ft.heartbeat_timeout_seconds,
        ft.initial_heartbeat_timeout_seconds,
        ft.progress_timeout_seconds,
    ) == (60, 600, 900)
    assert ft.in_process_restart == "Auto" and ft.launcher_max_restarts == 3
    assert (ft.rank_restart_budget.max, ft.rank_restart_budget.window_seconds) == (10, 3600)
    assert (ft.full_restart_budget.max, ft.full_restart_budget.window_seconds) == (3, 86400)
    assert ft.restart_strategy == "RankRestart" and ft.non_retryable_exit_codes == []
    assert parsed.status is None


def test_job_exposes_the_derived_names_the_operator_uses() -> None:
    parsed = models.parse_job(job())
    assert parsed.name == "demo"
    assert parsed.metadata.uid == "1234" and parsed.metadata.generation == 3
    assert parsed.checkpoint_dir == "/checkpoints/default/demo"  # scoped to the job
    assert parsed.checkpoint_claim_name == "fsx"
    dynamic = models.parse_job(
        job(
            checkpoint={
                "storageClassName": "fsx-lustre",
                "size": "1200Gi",
                "path": "runs/a",
                "mountPath": "/ckpt",
            }
        )
    )
    assert dynamic.checkpoint_dir == "/ckpt/runs/a"
    assert dynamic.checkpoint_claim_name == "demo-checkpoints"
    assert dynamic.spec.checkpoint.is_dynamic
    assert dynamic.spec.checkpoint.effective_claim_delete_policy == "Delete"


def test_camel_case_and_snake_case_names_both_parse_and_dump_as_camel_case() -> None:
    by_alias = parse_spec(
        {"nodes": 1, "image": "x", "procsPerNode": 2, "checkpoint": {"claimName": "fsx"}}
    )
    by_name = models.ResilientTrainingJobSpec(
        nodes=1, image="x", procs_per_node=2, checkpoint=Checkpoint(claim_name="fsx")
    )
    assert by_alias == by_name
    dumped = by_name.to_api()
    assert dumped["procsPerNode"] == 2 and dumped["checkpoint"]["claimName"] == "fsx"
    assert "procs_per_node" not in dumped


def test_integers_as_strings_and_yes_as_a_boolean_are_refused_as_the_api_server_does() -> None:
    assert "spec.nodes" in error_text(job(nodes="2"))
    assert "spec.suspend" in error_text(job(suspend="yes"))
    assert "spec.nodes" in error_text(job(nodes=2.5))


def test_quantities_accept_numbers_and_suffixed_strings() -> None:
    spec = parse_spec(
        {
            "nodes": 1,
            "image": "x",
            "instanceType": "g5.48xlarge",
            "resources": {"requests": {"cpu": 4, "memory": "16Gi"}},
            "checkpoint": {"claimName": "fsx"},
        }
    )
    assert spec.resources is not None
    assert spec.resources.requests == {"cpu": "4", "memory": "16Gi"}


@pytest.mark.parametrize(
    ("checkpoint", "field"),
    [
        ({"claimName": "fsx", "storageClassName": "fsx-lustre", "size": "1Gi"}, "claimName"),
        ({"intervalSteps": 5}, "claimName"),
        ({"storageClassName": "fsx-lustre"}, "checkpoint.size"),
        ({"claimName": "fsx", "size": "1Gi"}, "checkpoint.size"),
        ({"claimName": "fsx", "claimDeletePolicy": "Retain"}, "checkpoint.claimDeletePolicy"),
        ({"claimName": "fsx", "path": "a/../b"}, "checkpoint.path"),
    ],
)
def test_checkpoint_source_rules_name_the_field(checkpoint: dict[str, Any], field: str) -> None:
    text = error_text(job(checkpoint=checkpoint))
    assert "spec.checkpoint" in text and field in text


def test_initial_heartbeat_timeout_shorter_than_heartbeat_timeout_is_refused() -> None:
    text = error_text(
        job(faultTolerance={"heartbeatTimeoutSeconds": 120, "initialHeartbeatTimeoutSeconds": 60})
    )
    assert "initialHeartbeatTimeoutSeconds" in text


def test_an_instance_type_without_profile_requires_resources() -> None:
    assert "resources is required" in error_text(job(instanceType="g5.48xlarge"))
    models.parse_job(job(instanceType="g5.48xlarge", resources={"limits": {"nvidia.com/gpu": 8}}))


@pytest.mark.parametrize(
    ("env", "words"),
    [
        ([{"name": "RTJ_NNODES", "value": "3"}], "RTJ_ is reserved"),
        ([{"name": "A", "value": "1"}, {"name": "A", "value": "2"}], "duplicate"),
        (
            [{"name": "T", "value": "x", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
            "mutually exclusive",
        ),
        ([{"name": "T", "valueFrom": {}}], "exactly one of"),
    ],
)
def test_env_rules_name_the_problem(env: list[dict[str, Any]], words: str) -> None:
    text = error_text(job(env=env))
    assert "env" in text and words in text


@pytest.mark.parametrize("name", ["a" * 51, "job.v1", "1job", "Job"])
def test_names_that_cannot_become_pod_hostnames_are_refused(name: str) -> None:
    body = job()
    body["metadata"]["name"] = name
    assert "metadata.name" in error_text(body)


def test_the_longest_allowed_name_still_gives_valid_hostnames_for_the_last_node() -> None:
    name = "a" * models.MAX_JOB_NAME_LENGTH
    body = job(nodes=models.MAX_NODES)
    body["metadata"]["name"] = name
    models.parse_job(body)
    for hostname in (f"{name}-{models.MAX_NODES - 1}", f"{name}-rdzv"):
        assert len(hostname) <= 63


def test_status_round_trips_through_the_api_shape() -> None:
    when = "2026-11-29T10:50:00Z"
    status = {
        "observedGeneration": 3,
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "observedGeneration": 3,
                "lastTransitionTime": when,
                "reason": "Training",
                "message": "ok",
            }
        ],
        "state": "Running",
        "nodesReady": 2,
        "nodesDesired": 2,
        "nodes": "2/2",
        "step": 41,
        "lastCheckpoint": {"step": 40, "time": when},
        "restarts": {"total": 1, "rank": 1, "full": 0, "launcher": 0, "inProcess": 0},
        "ranks": [
            {
                "nodeIndex": 0,
                "pod": "demo-0",
                "node": "n1",
                "state": "Running",
                "lastHeartbeatTime": when,
                "step": 41,
                "restarts": 0,
                "attempt": 0,
            }
        ],
        "incidents": [
            {
                "cause": "PodFailed",
                "nodeIndex": 1,
                "rank": 2,
                "detectedTime": when,
                "actedTime": when,
                "recoveredTime": when,
                "seconds": 12,
                "action": "RankRestart",
            }
        ],
        "goodput": "93.1%",
        "startTime": when,
        "reason": "Training",
        "message": "Training.",
    }
    parsed = models.parse_status(status)
    assert parsed.conditions[0].last_transition_time == datetime(2026, 11, 29, 10, 50, tzinfo=UTC)
    assert parsed.incidents[0].seconds == 12.0
    assert parsed.to_api() == status | {"incidents": [status["incidents"][0] | {"seconds": 12.0}]}


def test_status_refuses_more_incidents_than_the_bound() -> None:
    incident = {"cause": "PodFailed", "detectedTime": "2026-11-29T10:50:00Z"}
    with pytest.raises(ValidationError, match="incidents"):
        models.parse_status({"incidents": [incident] * (models.MAX_INCIDENTS + 1)})


def test_kopf_like_mapping_bodies_parse() -> None:
    class View(dict[str, Any]):
        """Stands in for any Mapping subclass (kopf's Body is one)."""

    assert models.parse_job(View(job())).spec.nodes == 2


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_parses_with_the_models(path: Path) -> None:
    parsed = models.parse_job(yaml.safe_load(path.read_text()))
    assert parsed.spec.nodes >= 1


def test_the_cpu_tiny_example_has_two_nodes_of_two_ranks_and_a_fault_per_recovery_path() -> None:
    parsed = models.parse_job(yaml.safe_load((REPO / "examples" / "cpu-tiny.yaml").read_text()))
    assert (parsed.spec.nodes, resolve_profile(parsed.spec).procs_per_node) == (2, 2)
    assert parsed.spec.checkpoint.storage_class_name == "local-shared"
    faults = [e.value for e in parsed.spec.env if e.name == "TRAINER_FAULTS"]
    assert faults and faults[0] is not None
    kinds = {f.split(":")[2] for f in faults[0].split(",")}
    # in-process restart, ft_launcher restart, and a pod the operator must replace
    assert kinds == {"exception", "sigkill", "launcher-kill"}


