"""The ResilientTrainingJob API on a real kube-apiserver: what `kubectl apply` accepts and refuses.

Every example applies with strict server-side field validation; every manifest of the invalid
corpus (tests/integration/invalid/, at least 40) is refused at apply time with an error that names
the field given on its first line (`# expect-field:`). Update cases (`# update:`) apply their first
document, which is valid, and then the second, which must be refused: immutable fields, and
fields that may change only while the job is suspended. The opposite is checked too: those
fields do change while the job is suspended, and fault-tolerance settings change at any time.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.cluster import Cluster
from rtj_operator.api import models

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
CORPUS = sorted((Path(__file__).parent / "invalid").glob("*.yaml"))
APPLY = ("apply", "--server-side", "--validate=strict", "--field-manager=rtj-tests")


@pytest.fixture(scope="module")
def api_namespace(cluster: Cluster) -> Iterator[str]:
    name = cluster.create_namespace("api-validation")
    try:
        yield name
    finally:
        cluster.delete_namespace(name)


def without_namespace(document: dict[str, Any]) -> str:
    """The examples name their own namespace; tests apply them into a fresh one."""
    document["metadata"].pop("namespace", None)
    return yaml.safe_dump(document, sort_keys=False)


def get_job(cluster: Cluster, namespace: str, name: str) -> dict[str, Any]:
    out = cluster.kubectl("get", "rtj", name, "-n", namespace, "-o", "json").stdout
    result: dict[str, Any] = json.loads(out)
    return result


def names_field(message: str, field: str) -> bool:
    """`field` appears as a whole path in the message, not as part of a longer one."""
    pattern = r"(?<![A-Za-z0-9_])" + re.escape(field) + r"(?![A-Za-z0-9_.])"
    return re.search(pattern, message) is not None


def test_the_corpus_has_at_least_forty_invalid_manifests() -> None:
    assert len(CORPUS) >= 40


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_applies_with_strict_field_validation(
    cluster: Cluster, api_namespace: str, path: Path
) -> None:
    document = yaml.safe_load(path.read_text())
    cluster.kubectl(*APPLY, "-n", api_namespace, "-f", "-", input=without_namespace(document))
    stored = get_job(cluster, api_namespace, document["metadata"]["name"])
    # The API server filled in the defaults, and the operator's models parse what it stores.
    assert stored["spec"]["checkpoint"]["mountPath"]
    assert stored["spec"]["faultTolerance"]["rankRestartBudget"]["windowSeconds"] >= 1
    assert models.parse_job(stored).spec.nodes == document["spec"]["nodes"]


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_an_invalid_manifest_is_refused_with_an_error_naming_the_field(
    cluster: Cluster, api_namespace: str, path: Path
) -> None:
    text = path.read_text()
    header = text.splitlines()[0]
    assert header.startswith("# expect-field: ")
    fields = header.removeprefix("# expect-field: ").split(" or ")
    documents = text.split("\n---\n")
    name = yaml.safe_load(documents[-1])["metadata"]["name"]
    if len(documents) == 2:
        cluster.kubectl(*APPLY, "-n", api_namespace, "-f", "-", input=documents[0])
    result = cluster.kubectl(
        *APPLY, "-n", api_namespace, "-f", "-", input=documents[-1], check=False
    )
    assert result.returncode != 0, f"{path.name} was accepted"
    message = result.stderr.replace(name, "<name>")  # the name must not count as the field
    assert any(names_field(message, f) for f in fields), (fields, message)


def job_manifest(name: str, **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "nodes": 2,
        "image": "rtj-trainer:dev",
        "checkpoint": {"storageClassName": "local-shared", "size": "1Gi"},
    }
    body.update(spec)
    return {
        "apiVersion": "training.resilient.dev/v1alpha1",
        "kind": "ResilientTrainingJob",
        "metadata": {"name": name},
        "spec": body,
    }


def apply(cluster: Cluster, namespace: str, manifest: dict[str, Any]) -> None:
    cluster.kubectl(*APPLY, "-n", namespace, "-f", "-", input=yaml.safe_dump(manifest))


def test_nodes_image_env_and_pod_template_change_while_the_job_is_suspended(
    cluster: Cluster, api_namespace: str
) -> None:
    apply(cluster, api_namespace, job_manifest("resize-suspended", suspend=True))
    changed = job_manifest(
        "resize-suspended",
        suspend=False,  # Kueue-style: change the placement and resume in one update
        nodes=4,
        image="rtj-trainer:v2",
        env=[{"name": "NCCL_DEBUG", "value": "INFO"}],
        podTemplate={"nodeSelector": {"pool": "a"}},
    )
    apply(cluster, api_namespace, changed)
    spec = get_job(cluster, api_namespace, "resize-suspended")["spec"]
    assert (spec["nodes"], spec["image"], spec["suspend"]) == (4, "rtj-trainer:v2", False)


def test_fault_tolerance_and_checkpoint_policy_change_while_the_job_runs(
    cluster: Cluster, api_namespace: str
) -> None:
    apply(cluster, api_namespace, job_manifest("tune-running"))
    tuned = job_manifest(
        "tune-running",
        faultTolerance={"rankRestartBudget": {"max": 20}, "restartStrategy": "FullRestart",
                        "podStartTimeoutSeconds": 1200},
        # keep, not intervalSteps: the interval is read by the running trainers and changes
        # only while suspended (issue 11; tests/integration/invalid/update-checkpoint-*.yaml).
        checkpoint={"storageClassName": "local-shared", "size": "1Gi", "keep": 5,
                    "staleAfterIntervals": 6},
        activeDeadlineSeconds=3600,
    )
    apply(cluster, api_namespace, tuned)
    spec = get_job(cluster, api_namespace, "tune-running")["spec"]
    assert spec["faultTolerance"]["rankRestartBudget"] == {"max": 20, "windowSeconds": 3600}
    assert spec["faultTolerance"]["podStartTimeoutSeconds"] == 1200  # the operator reads it
    assert spec["checkpoint"]["keep"] == 5
    assert spec["checkpoint"]["staleAfterIntervals"] == 6
