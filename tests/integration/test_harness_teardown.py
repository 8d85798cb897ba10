"""A test session that dies abruptly (SIGTERM, SIGKILL) leaves no cluster or pod process behind.

SIGTERM runs the harness's signal handler (orderly teardown); SIGKILL cannot be handled, so the
parent-death signal of every child does the work.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from harness.cluster import TESTS_DIR

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

OWNER = """
import sys, time
from pathlib import Path
from harness.cluster import Cluster

cluster = Cluster.start(Path(sys.argv[1]), nodes=1)
namespace = cluster.create_namespace("owner")
cluster.api.create(f"/api/v1/namespaces/{namespace}/pods", {
    "metadata": {"name": "sleeper"},
    "spec": {"restartPolicy": "Never", "containers": [
        {"name": "main", "image": "ignored", "command": ["sleep", "300"]}]},
})
cluster.wait_for_pod(namespace, "sleeper")
while True:
    pod = cluster.api.get(f"/api/v1/namespaces/{namespace}/pods/sleeper")
    pgid = pod["metadata"].get("annotations", {}).get("harness.local/pgid")
    if pgid:
        break
    time.sleep(0.1)
print(pgid, flush=True)
time.sleep(600)
"""


def processes_mentioning(text: str) -> str:
    found = subprocess.run(["pgrep", "-af", text], capture_output=True, text=True)
    return found.stdout


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_killing_the_owner_of_a_cluster_stops_every_process_it_started(
    tmp_path: Path, sig: signal.Signals
) -> None:
    run_dir = tmp_path / "owned"
    with open(tmp_path / "owner.log", "w") as owner_log:
        owner = subprocess.Popen(
            [sys.executable, "-c", OWNER, str(run_dir)],
            env={**os.environ, "PYTHONPATH": str(TESTS_DIR)},
            stdout=subprocess.PIPE,
            stderr=owner_log,
            text=True,
        )
    try:
        assert owner.stdout is not None
        line = owner.stdout.readline().strip()
        assert line.isdigit(), f"the owner failed:\n{(tmp_path / 'owner.log').read_text()}"
        pod_pgid = int(line)
        assert os.getpgid(pod_pgid) == pod_pgid
        assert processes_mentioning(str(run_dir)) != ""
        owner.send_signal(sig)
        assert owner.wait(30) == -sig
    finally:
        owner.kill()
        owner.wait()

    deadline = time.monotonic() + 30
    while processes_mentioning(str(run_dir)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_mentioning(str(run_dir)) == ""
    with pytest.raises(ProcessLookupError):
        os.killpg(pod_pgid, 0)
