"""Issue #33 against the real API server: a job of 8,192 nodes (the new `spec.nodes` limit) is
accepted with its CEL rules within the server's cost budget (the CRD itself was applied by the
harness), 8,193 is refused naming the field, and the largest status the operator writes for it
(unit.worst_status: every list full, every message at its limit, every pod Pending) is stored
through the status subresource and read back whole, far below etcd's 1.5 MiB object limit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from harness.cluster import Cluster
from unit.worst_status import worst_status

pytestmark = pytest.mark.integration


def job(name: str, nodes: int) -> dict[str, Any]:
    return {"apiVersion": "training.resilient.dev/v1alpha1", "kind": "ResilientTrainingJob",
            "metadata": {"name": name},
            "spec": {"nodes": nodes, "image": "rtj-trainer:dev", "suspend": True,
                     "checkpoint": {"claimName": "fsx"}, "faultTolerance": {"spares": 64,
                                                                            "inProcessRestart":
                                                                            "Enabled"}}}


def test_an_8192_node_job_and_its_largest_status_are_stored(
    cluster: Cluster, namespace: str, tmp_path: Path
) -> None:
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(job("big", 8192)))
    refused = cluster.kubectl("apply", "-n", namespace, "-f", "-",
                              input=yaml.safe_dump(job("too-big", 8193)), check=False)
    assert refused.returncode != 0 and "spec.nodes" in refused.stderr
    assert "8192" in refused.stderr
    status = worst_status(8192)
    patch = tmp_path / "status.json"  # too long for a command line
    patch.write_text(json.dumps({"status": status}))
    cluster.kubectl("patch", "rtj", "big", "-n", namespace, "--subresource=status",
                    "--type=merge", "--patch-file", str(patch))
    stored = json.loads(cluster.kubectl("get", "rtj", "big", "-n", namespace, "-o",
                                        "json").stdout)
    assert stored["status"]["ranks"] == status["ranks"]
    assert stored["status"]["incidents"] == status["incidents"]
    assert len(stored["status"]["excludedNodes"]) == 32
    size = len(json.dumps(stored, separators=(",", ":")).encode())
    assert size <= 512 * 1024, size
