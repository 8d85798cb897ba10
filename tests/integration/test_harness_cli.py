"""`python -m harness up/down` (behind `make cluster-up/cluster-down`) leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness.cluster import TESTS_DIR, VENV_BIN

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

SLEEPER = """
apiVersion: v1
kind: Pod
metadata: {name: sleeper}
spec:
  restartPolicy: Never
  containers:
  - name: main
    image: ignored
    command: [sh, -c, 'echo "PYTHONPATH=[$PYTHONPATH]"; exec sleep 300']
"""


def harness(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(TESTS_DIR)}
    return subprocess.run(
        [sys.executable, "-m", "harness", *args],
        env=env,
        cwd=TESTS_DIR.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def in_cluster_shell(env_file: Path, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "-c", f"source {env_file} && {script}"],
        capture_output=True,
        text=True,
        timeout=90,
    )


def test_up_runs_a_cluster_in_the_background_and_down_leaves_no_process_behind(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "cli-cluster"
    up = harness("up", "--nodes", "1", "--dir", str(run_dir))
    try:
        assert up.returncode == 0, up.stderr + up.stdout
        env_file = run_dir / "env"
        nodes = in_cluster_shell(env_file, "kubectl get nodes -o name && command -v python")
        assert nodes.returncode == 0, nodes.stderr
        assert nodes.stdout.splitlines() == ["node/p5-node-0", str(VENV_BIN / "python")]
        assert harness("status", "--dir", str(run_dir)).returncode == 0
        started = in_cluster_shell(
            env_file,
            f"kubectl apply -f - <<'EOF'\n{SLEEPER}\nEOF\n"
            "kubectl wait --for=condition=Ready pod/sleeper --timeout=60s >/dev/null && "
            "kubectl get pod sleeper -o jsonpath='{.metadata.annotations.harness\\.local/pgid}'",
        )
        assert started.returncode == 0, started.stderr
        pod_pgid = int(started.stdout.strip().splitlines()[-1])
        assert os.getpgid(pod_pgid) == pod_pgid
        pod_log = next((run_dir / "pods").glob("*_sleeper_main.log")).read_text()
        assert pod_log == "PYTHONPATH=[]\n", "tests/ on PYTHONPATH must not leak into pods"
    finally:
        down = harness("down", "--dir", str(run_dir), timeout=120)

    assert down.returncode == 0, down.stderr
    assert "killed leftovers" not in down.stdout, "the daemon stops everything by itself"
    left = subprocess.run(["pgrep", "-af", str(run_dir)], capture_output=True, text=True)
    assert left.stdout == "", f"processes left behind:\n{left.stdout}"
    with pytest.raises(ProcessLookupError):
        os.killpg(pod_pgid, 0)
    assert not (run_dir / "env").exists()
    assert harness("status", "--dir", str(run_dir)).returncode == 1
