"""The three ways a team brings its own code, through the operator on the local cluster
(docs/byo.md), each through a fault: a pod of the job is killed mid-training and the job still
ends `Succeeded`.

1. examples/byo-script.yaml: a plain FSDP2 script with NVRx heartbeats and nothing of ours
   (examples/byo/train_fsdp2.py): watched through its rank monitors (HangDetection True), the
   lost pod replaced, its workers restarted.
2. examples/byo-library.yaml: the same script with the trainer's library: step, last checkpoint
   and goodput in the status, a resume from its commit after the fault.
3. examples/byo-hf-llama.yaml: the built-in trainer on a tiny Llama (config and weights written
   here) with a `datasets` directory, mounted through podTemplate.volumes; after the fault it
   finishes, and its export loads with transformers.

And a script that reports nothing at all (tests/e2e/scripts/train_silent.py) runs past both
heartbeat timeouts with no false hang: HangDetection False, no incident, no node excluded.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml
from e2e.test_operator_jobs import apply, describe, events, status, wait_for
from harness.cluster import Cluster

if TYPE_CHECKING:
    from e2e.conftest import OperatorProcess

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PYTHON = sys.executable


def manifest(example: str, name: str, *, command: list[str] | None = None,
             args: list[str] | None = None) -> dict[str, Any]:
    """An example, sized for the local cluster: 2 pods x 1 worker on CPU, short timeouts, the
    `local-shared` storage class."""
    body: dict[str, Any] = copy.deepcopy(yaml.safe_load((ROOT / "examples" / example)
                                                        .read_text()))
    body["metadata"]["name"] = name
    spec = body["spec"]
    spec.update(nodes=2, procsPerNode=1, activeDeadlineSeconds=600)
    if command is not None:
        spec["command"] = command
    if args is not None:
        spec["args"] = args
    spec["checkpoint"] = {**spec["checkpoint"], "storageClassName": "local-shared",
                          "size": "1Gi", "intervalSteps": 10}
    spec["faultTolerance"] = {**spec.get("faultTolerance", {}), "heartbeatTimeoutSeconds": 15,
                              "initialHeartbeatTimeoutSeconds": 60,
                              "rankRestartBudget": {"max": 3, "windowSeconds": 600}}
    return body


def condition(job_status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in job_status.get("conditions", []) if c["type"] == kind), {})


def run_through_a_pod_kill(cluster: Cluster, ns: str, name: str, body: dict[str, Any],
                           operator: OperatorProcess, *, kill_when: Any) -> dict[str, Any]:
    """Apply `body`, kill pod 1 once `kill_when(status)` holds, and wait for `Succeeded`; the
    final status."""
    apply(cluster, ns, body)
    context = lambda: describe(cluster, ns, name, operator)  # noqa: E731
    wait_for("the moment to kill a pod", lambda: kill_when(status(cluster, ns, name)),
             timeout=240, context=context)
    cluster.nodes.kill_pod(ns, f"{name}-1")
    done = wait_for("Succeeded", lambda: (
        s if (s := status(cluster, ns, name)).get("state") in ("Succeeded", "Failed") else None),
        timeout=360, context=context)
    assert done["state"] == "Succeeded", context()
    assert done["restarts"]["rank"] + done["restarts"]["full"] >= 1  # the kill was recovered
    return done


def test_a_plain_script_with_nvrx_heartbeats_is_watched_and_recovered(
        cluster: Cluster, namespace: str, operator: OperatorProcess) -> None:
    name = "byo-script"
    body = manifest("byo-script.yaml", name,
                    command=[PYTHON, str(ROOT / "examples" / "byo" / "train_fsdp2.py")],
                    args=["--steps", "60", "--step-seconds", "0.5"])
    watched: list[dict[str, Any]] = []

    def running_and_watched(job_status: dict[str, Any]) -> bool:
        hang = condition(job_status, "HangDetection")
        if job_status.get("state") == "Running" and hang.get("status") == "True":
            watched.append(hang)
            return True
        return False

    done = run_through_a_pod_kill(cluster, namespace, name, body, operator,
                                  kill_when=running_and_watched)
    assert watched[0]["reason"] == "HeartbeatsWatched"
    assert not events(cluster, namespace, "HeartbeatStale")  # no false stale heartbeat
    assert not done.get("excludedNodes")


def test_a_script_with_the_library_reports_and_resumes_its_state(
        cluster: Cluster, namespace: str, operator: OperatorProcess) -> None:
    name = "byo-library"
    body = manifest("byo-library.yaml", name,
                    command=[PYTHON, str(ROOT / "examples" / "byo" / "train_fsdp2_rtj.py")],
                    args=["--steps", "60", "--step-seconds", "0.4"])
    done = run_through_a_pod_kill(
        cluster, namespace, name, body, operator,
        kill_when=lambda s: (s.get("lastCheckpoint") or {}).get("step", 0) >= 20)
    assert done["step"] == 60 and done["lastCheckpoint"]["step"] == 60
    assert done.get("goodput", "").endswith("%")
    assert condition(done, "HangDetection")["status"] == "True"
    log = cluster.pod_log(namespace, f"{name}-0")
    resumed = [line for line in log.splitlines() if line.startswith("step 30 loss")]
    assert resumed, log[-2000:]  # trained on past the kill


def _tiny_llama(directory: Path) -> None:
    code = f"""
import numpy as np, torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM
config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
torch.manual_seed(0)
LlamaForCausalLM(config).save_pretrained({str(directory / 'llama')!r})
rng = np.random.default_rng(0)
docs = [[int(t) for t in (rng.integers(0, 300) + np.arange(rng.integers(20, 200))
                          * rng.integers(1, 7)) % 300] for _ in range(300)]
Dataset.from_dict({{"input_ids": docs}}).save_to_disk({str(directory / 'data')!r})
"""
    subprocess.run([PYTHON, "-c", code], check=True, capture_output=True)


def test_the_built_in_trainer_on_a_hugging_face_llama_and_dataset(
        cluster: Cluster, namespace: str, operator: OperatorProcess, tmp_path: Path) -> None:
    """The example's models claim is a hostPath volume here, mounted at /models through
    podTemplate.volumes and volumeMounts: the pods see the model and the dataset only there."""
    name = "byo-hf-llama"
    models = cluster.shared_dir / f"models-{namespace}"
    models.mkdir(mode=0o755)
    _tiny_llama(models)
    body = manifest("byo-hf-llama.yaml", name, args=[
        "--preset", "tiny", "--set", "train.device=cpu", "--set", "train.steps=60",
        "--set", "train.min_step_seconds=0.3",
        "--set", "model.hf_path=/models/llama", "--set", "model.seq_len=32",
        "--set", "data.kind=hf", "--set", "data.path=/models/data"])
    spec = body["spec"]
    spec["podTemplate"] = {
        "volumes": [{"name": "models", "hostPath": {"path": str(models), "type": "Directory"}}],
        "volumeMounts": [{"name": "models", "mountPath": "/models", "readOnly": True}]}
    done = run_through_a_pod_kill(
        cluster, namespace, name, body, operator,
        kill_when=lambda s: (s.get("lastCheckpoint") or {}).get("step", 0) >= 20)
    assert done["step"] == 60 and done["lastCheckpoint"]["step"] == 60
    pod = json.loads(cluster.kubectl("get", "pod", f"{name}-0", "-n", namespace, "-o",
                                     "json", check=False).stdout or "{}")
    if pod:  # still there unless cleaned up already
        assert {"name": "models", "mountPath": "/models", "readOnly": True} in \
            pod["spec"]["containers"][0]["volumeMounts"]
    (checkpoints,) = {m.parent.parent for m in cluster.shared_dir.glob(
        f"*/**/{name}/step-*/manifest.json")}
    export = subprocess.run([PYTHON, "-m", "rtj_trainer.export", str(checkpoints), "--out",
                             str(tmp_path / "export")], capture_output=True, text=True)
    assert export.returncode == 0, export.stderr
    loaded = subprocess.run([PYTHON, "-c", f"""
from transformers import AutoModelForCausalLM
print(AutoModelForCausalLM.from_pretrained({str(tmp_path / 'export')!r}).config.model_type)
"""], capture_output=True, text=True)
    assert loaded.stdout.strip().splitlines()[-1] == "llama", loaded.stderr[-2000:]


# long: ~100 s; the decision is pinned by tests/unit/test_decisions_byo_liveness.py, and
# make test keeps the three adoption paths (docs/development.md, tiers)
@pytest.mark.long
def test_a_script_that_reports_nothing_is_never_taken_for_hung(
        cluster: Cluster, namespace: str, operator: OperatorProcess) -> None:
    """It runs 90 s, past heartbeatTimeoutSeconds + initialHeartbeatTimeoutSeconds (15 + 60):
    no incident, no node excluded, HangDetection False naming its pods; then Succeeded."""
    name = "byo-silent"
    body = manifest("byo-script.yaml", name,
                    command=[PYTHON, str(ROOT / "tests" / "e2e" / "scripts" / "train_silent.py")],
                    args=["--steps", "90", "--step-seconds", "1"])
    apply(cluster, namespace, body)
    context = lambda: describe(cluster, namespace, name, operator)  # noqa: E731
    off = wait_for("HangDetection False", lambda: (
        c if (c := condition(status(cluster, namespace, name), "HangDetection"))
        .get("status") == "False" else None), timeout=180, context=context)
    assert off["reason"] == "WorkersReportNoHeartbeats" and f"{name}-0" in off["message"]
    done = wait_for("the end", lambda: (
        s if (s := status(cluster, namespace, name)).get("state") in ("Succeeded", "Failed")
        else None), timeout=300, context=context)
    assert done["state"] == "Succeeded", context()
    assert not done.get("incidents") and not done.get("excludedNodes")
    assert done["restarts"]["total"] == 0
    assert not events(cluster, namespace, "HeartbeatStale")
