"""What the benchmarks on Kubernetes share (`operator_recovery`, `chaos`, `scale`): the operator as
a subprocess on free ports, examples/cpu-tiny.yaml as a benchmark's job, a job's status and its
directory on the shared checkpoint volume, and the header of a JSON result.

The cluster itself is the test harness's (`tests/harness`; bench/__init__.py puts it on `sys.path`).
"""

from __future__ import annotations

import argparse
import copy
import shlex
import socket
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from .common import REPO_ROOT, StampedProcess, machine_description

EXAMPLE = REPO_ROOT / "examples" / "cpu-tiny.yaml"
GROUP_PATH = "/apis/training.resilient.dev/v1alpha1"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def operator_ports() -> dict[str, str]:
    """Free ports for one operator: metrics, liveness and the rendezvous port it gives jobs."""
    return {"RTJ_OPERATOR_METRICS_PORT": str(free_port()),
            "RTJ_OPERATOR_LIVENESS_PORT": str(free_port()),
            "RTJ_OPERATOR_RENDEZVOUS_PORT": str(free_port())}


def start_operator(cluster: Any, log_path: Path, reconcile: float | None,
                   ports: dict[str, str] | None = None) -> StampedProcess:
    """The operator as a subprocess, live. An operator started again must get the same `ports`:
    the rendezvous port is part of the running jobs' pods."""
    ports = ports or operator_ports()
    liveness = int(ports["RTJ_OPERATOR_LIVENESS_PORT"])
    env = cluster.env() | ports
    if reconcile is not None:
        env["RTJ_OPERATOR_RECONCILE_INTERVAL_SECONDS"] = f"{reconcile:g}"
    operator = StampedProcess([sys.executable, "-m", "rtj_operator"], log_path=log_path, env=env)
    deadline = time.monotonic() + 90
    while True:
        if operator.process.poll() is not None:
            raise RuntimeError(f"the operator exited; see {log_path}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{liveness}/healthz", timeout=1).read()
            return operator
        except OSError:
            if time.monotonic() > deadline:
                operator.stop()
                raise RuntimeError(f"the operator did not become live; see {log_path}") from None
            time.sleep(0.3)


def example_job(name: str, steps: int, interval: int, trainer_faults: str = "") -> dict[str, Any]:
    """examples/cpu-tiny.yaml named `name`, `steps` long, a checkpoint every `interval` steps, and
    `trainer_faults` as its TRAINER_FAULTS (none when empty)."""
    manifest: dict[str, Any] = copy.deepcopy(yaml.safe_load(EXAMPLE.read_text()))
    manifest["metadata"]["name"] = name
    spec = manifest["spec"]
    spec["args"] = [f"train.steps={steps}" if a.startswith("train.steps=") else a
                    for a in spec["args"]]
    spec["env"] = [e for e in spec.get("env", []) if e["name"] != "TRAINER_FAULTS"]
    if trainer_faults:
        spec["env"].append({"name": "TRAINER_FAULTS", "value": trainer_faults})
    if not spec["env"]:
        del spec["env"]
    spec["checkpoint"]["intervalSteps"] = interval
    return manifest


def job_path(namespace: str, name: str) -> str:
    return f"{GROUP_PATH}/namespaces/{namespace}/resilienttrainingjobs/{name}"


def job_status(cluster: Any, namespace: str, name: str) -> dict[str, Any]:
    """The job's `status` ({} while it has none, or when the job is gone)."""
    job = cluster.api.get_or_none(job_path(namespace, name)) or {}
    status: dict[str, Any] = job.get("status") or {}
    return status


def job_dir(cluster: Any, namespace: str, name: str) -> Path | None:
    """The job's directory on the shared checkpoint volume (`losses.jsonl`, the checkpoints):
    the claim's directory, then checkpoint.path (`<namespace>/<name>` by default)."""
    found = sorted(Path(cluster.shared_dir).glob(f"{namespace}-{name}-*/{namespace}/{name}"))
    return found[0] if found else None


def result_header(benchmark: str, argv: list[str] | None, args: argparse.Namespace,
                  **after_command: Any) -> dict[str, Any]:
    """The first keys of a benchmark's JSON result: what ran (`after_command` goes right after the
    command), on what machine, with which settings, when."""
    return {
        "benchmark": benchmark,
        "command": f"python -m bench.{benchmark} " + shlex.join(
            argv if argv is not None else sys.argv[1:]),
        **after_command,
        "machine": machine_description(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
