"""A minimal valid ResilientTrainingJob body, shared by the model and pod-plan tests."""

from __future__ import annotations

from typing import Any


def job(**spec: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "nodes": 2,
        "image": "rtj-trainer:dev",
        "checkpoint": {"claimName": "fsx"},
    }
    base.update(spec)
    return {
        "apiVersion": "training.resilient.dev/v1alpha1",
        "kind": "ResilientTrainingJob",
        "metadata": {"name": "demo", "namespace": "default", "uid": "1234", "generation": 3},
        "spec": base,
    }
